"""The presets of published models: their parameter counts are the published totals, and their shapes are the ones
the validated reference rows of the same model state (bench/reference_extra.yaml), so `--model bloom-176b` asks
about the model those rows measured."""
from __future__ import annotations

import pytest

from cost_models.flops import param_counts
from cost_models.specs import load_model

from tests.cost_model_helpers import load_bench


# (preset, total parameters, active parameters, as published (billions), their tolerance)
PUBLISHED = [("bloom-176b", 176.2, 176.2, 0.1), ("gpt3-175b", 175.0, 175.0, 0.6), ("llama2-70b", 69.0, 69.0, 0.1),
             ("mixtral-8x22b", 141.0, 39.0, 0.5), ("nemotron4-340b", 341.0, 341.0, 0.5),
             ("qwen3-235b-a22b", 235.0, 22.0, 0.3)]


@pytest.mark.parametrize("preset, total, active, tol", PUBLISHED)
def test_parameter_counts_are_the_published_ones(preset, total, active, tol):
    p = param_counts(load_model(preset))
    assert p["total"] / 1e9 == pytest.approx(total, abs=tol) and p["active"] / 1e9 == pytest.approx(active, abs=tol)


# (preset, a reference row of that model); the rows' vocabularies are the trained (padded) ones
ROWS = [("bloom-176b", "bloom_tr11_176B_384gpu_gbs2048"),
        ("qwen3-235b-a22b", "mzoo_qwen3_readme_H100_Qwen3-235B-A22B_256gpu_ep32_pp8"),
        ("nemotron4-340b", "nemo_25.02_B200_Nemotron-340B_128gpu")]
SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "mlp", "norm", "n_experts", "top_k",
         "moe_ffn_hidden", "n_shared_experts", "n_dense_layers")


@pytest.mark.parametrize("preset, row_id", ROWS)
def test_shapes_are_the_reference_rows(preset, row_id):
    vr = load_bench("validate_reference")
    cases, _ = vr.build_cases([r for r in vr.load_set("extra") if r["id"] == row_id])
    assert cases, row_id
    measured = cases[0].model
    mine = load_model(preset)
    assert {k: getattr(mine, k) for k in SHAPE} == {k: getattr(measured, k) for k in SHAPE}
    assert mine.tie_embeddings == measured.tie_embeddings
    assert abs(mine.vocab_size - measured.vocab_size) <= 128 * 8     # padding to a multiple of 128 x TP at most


def test_mixtral_8x22b_is_the_model_zoo_rows_model():
    """Mixtral 8x22B's rows (Megatron-MoE-ModelZoo launch scripts) are not scored, so their model is read as written."""
    rows = [r["model"] for r in load_bench("validate_reference").load_set("extra")
            if r["model"].get("name") == "Mixtral-8x22B" and "moe_ffn_hidden" in r["model"]]
    assert rows
    m, want = load_model("mixtral-8x22b"), rows[0]
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.vocab_size, m.n_experts, m.top_k, m.moe_ffn_hidden) == \
        tuple(int(want[k]) for k in ("layers", "hidden", "heads", "kv_heads", "vocab", "n_experts", "top_k",
                                     "moe_ffn_hidden"))


def test_a_preset_titan_run_cannot_build_is_planned_as_a_what_if(tmp_path):
    """BLOOM's embedding LayerNorm is a cost-model fact titan-run's models lack: titan-plan still ranks and writes
    the plan, saying it is a what-if in one line, and titan-run refuses the plan with the same reason."""
    from executor.config import ConfigError, load_run_config
    from tests.cost_model_helpers import planner_cli
    out = tmp_path / "plan.yaml"
    r = planner_cli("--model", "bloom-176b", "--gpus", "384", "--hardware", "a100-80g", "--seq-len", "2048",
                    "--global-batch", "1536", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "a what-if: titan-run cannot build this model: model key 'embed_norm' is true" in r.stdout
    with pytest.raises(ConfigError, match="model key 'embed_norm' is true"):
        load_run_config(str(out), [], world_size=384)
