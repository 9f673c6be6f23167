"""DeepSeek-V3's stated memory mechanisms (arXiv:2412.19437 Sec. 3.2.3 and 3.3.3) as workload keys, and the
trained 2,048-H800 run's fit verdict: ``moment_dtype`` (bf16 AdamW moments, fp32 master weights and gradients)
and ``float8_cache`` (what float8 linears keep for backward: ``fine_grained`` is the report's fp8 caching with
1x128 tile scales, the E5M6 input of the linear after attention and fp8 MoE SwiGLU inputs)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from cost_models.activations import FULL, SEQ, SHARD, layer_activation_terms
from cost_models.coefficients import Coefficients
from cost_models.estimate import GIB, estimate
from cost_models.memory import memory_breakdown
from cost_models.specs import SpecError, load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import assert_titan_run_refuses, load_bench, planner_cli

DSV3 = load_model("deepseek-v3-671b")
H800 = load_hardware("h800")
LLAMA8 = load_model("llama3-8b")
MEGATRON = dict(state_layout="megatron", zero=1)
DS_CLI = ["estimate", "--model", "deepseek-v3-671b", "--gpus", "2048", "--hardware", "h800", "--pp", "16", "--ep", "64",
          "--seq-len", "4096", "--global-batch", "15360", "--schedule", "DualPipeV", "--framework", "megatron-lm",
          "--ac", "selective", "--selective-ac", "modules", "--float8", "--compile", "--json"]


def _wl(**kw) -> Workload:
    return Workload(seq_len=4096, global_batch=64, **kw)


def _state(wl: Workload, plan: Plan, model=LLAMA8) -> dict:
    m = memory_breakdown(CandidateTable.from_plans([plan]), model, wl, Coefficients(), hw=H800)
    return {k: float(v[0]) for k, v in m.items()}


# --------------------------------------------------------------------------- moment_dtype
@pytest.mark.parametrize("layout, per_param", [(dict(state_layout="fsdp2"), (8.0, 4.0)),
                                               (MEGATRON, (12.0, 8.0))])   # megatron: + the fp32 master copy
def test_bf16_moments_take_four_optimizer_bytes_per_parameter_less(layout, per_param):
    plan = Plan(dp_shard=8, pp=2, microbatch=1, n_microbatches=8, ac="full", runnable=False)
    fp32, bf16 = _state(_wl(**layout), plan), _state(_wl(moment_dtype="bf16", **layout), plan)
    assert bf16["optimizer"] == pytest.approx(fp32["optimizer"] * per_param[1] / per_param[0], rel=1e-12)
    assert bf16["optimizer"] < fp32["optimizer"]
    for k in ("params", "grads", "activations", "logits", "fsdp_buffers", "overhead"):
        assert bf16[k] == fp32[k], k


# --------------------------------------------------------------------------- float8_cache
def _terms(wl: Workload, moe: bool = True, *, ac: str = "none", float8: bool = True, f8: float = 1.0) -> np.ndarray:
    return layer_activation_terms(DSV3, wl, moe, ac, True, f8, float8=float8)


def test_fine_grained_cache_is_the_reports_bytes_per_token():
    """Megatron layout, compiled (fused norm and SwiGLU), no recompute, one MoE block: every linear input at
    1 + 4/128 bytes (fp8 with an fp32 scale per 1x128 tile), the attention output once at 1.5 + 4/128 bytes
    (E5M6, no separate bf16 copy), the routed experts' gate and up at fp8, the rest unchanged."""
    m, e, tile = DSV3, 2.0, 1.0 + 4.0 / 128
    h, w, k = m.dim, m.moe_ffn_hidden, m.top_k
    d_o, lat = m.n_heads * m.v_head_dim, m.kv_lora_rank + m.q_lora_rank
    # the high-precision cache (what float8 off keeps) against the report's
    auto, fine = _terms(_wl(**MEGATRON), float8=False), _terms(_wl(float8_cache="fine_grained", **MEGATRON))
    saved_per_byte = (2 * h            # the QKV (down projections') and FFN inputs
                      + lat            # the normalized latents: the up projections' inputs
                      + k * h          # the dispatched tokens: the experts' first linear inputs
                      + k * w          # the experts' down projection inputs
                      + m.n_shared_experts * w)    # the shared expert's down projection input
    expected = (e - tile) * saved_per_byte + (e - 1.5 - 4.0 / 128) * d_o + k * 2 * w * (e - tile)
    assert auto.sum() - fine.sum() == pytest.approx(expected, rel=1e-12)
    # without float8 the key changes nothing
    assert (_terms(_wl(**MEGATRON), float8=False) == _terms(_wl(float8_cache="fine_grained", **MEGATRON),
                                                             float8=False)).all()
    # a dense block has no MoE SwiGLU: only the linear inputs and the attention output change
    dense_gap = _terms(_wl(**MEGATRON), moe=False, float8=False).sum() - _terms(_wl(float8_cache="fine_grained", **MEGATRON),
                                                                  moe=False).sum()
    assert dense_gap == pytest.approx((e - tile) * (2 * h + lat + m.ffn_hidden) + (e - 1.5 - 4.0 / 128) * d_o,
                                      rel=1e-12)


def test_fp8_cache_is_the_te_coefficient_and_auto_follows_the_coefficient():
    """``fp8``: 1-byte linear inputs and the attention's own O (Transformer Engine), what the coefficient
    ``float8_saved_input_fraction`` 0.5 gives for bf16; ``auto`` keeps reading that coefficient."""
    for moe in (False, True):
        te = _terms(_wl(float8_cache="fp8"), moe)
        assert (te == _terms(_wl(), moe, f8=0.5)).all()
        # the saved linear inputs shrink; the attention output is kept twice (bf16 O and the fp8 input)
        d_o = DSV3.n_heads * DSV3.v_head_dim
        assert te[SHARD] - _terms(_wl(), moe)[SHARD] < 2.0 * d_o
        # fsdp2 (DTensor-style TP) keeps the QKV and FFN inputs unsharded: 1 byte less each, and the latents
        assert _terms(_wl(), moe)[FULL] - te[FULL] == 2 * DSV3.dim + DSV3.kv_lora_rank + DSV3.q_lora_rank
        assert (_terms(_wl(float8_cache="fp8"), moe, float8=False) == _terms(_wl(), moe, float8=False)).all()


def test_auto_cache_follows_the_state_layout():
    """``auto`` under the megatron layout is Transformer Engine's fp8 cache (its linears save the fp8 cast of
    their input); under fsdp2 it is the coefficient (torchao's tensorwise float8 keeps the bf16 input)."""
    for moe in (False, True):
        mega = _terms(_wl(**MEGATRON), moe)
        assert (mega == _terms(_wl(float8_cache="fp8", **MEGATRON), moe)).all()
        assert mega.sum() < _terms(_wl(**MEGATRON), moe, float8=False).sum()
        assert (_terms(_wl(), moe) == _terms(_wl(), moe, float8=False)).all()     # fsdp2, coefficient 1.0
        assert (_terms(_wl(), moe) != _terms(_wl(float8_cache="fp8"), moe)).any()


def test_layernorm_recompute_keeps_the_latent_norms_inputs():
    """Recomputing all RMSNorms (the report) keeps each MLA latent norm's input, in the compute dtype, not the
    fp8 input of the up projection; the block norms' outputs (the QKV and FFN inputs) are dropped."""
    kw = dict(selective_ac="modules", recompute_modules=("layernorm",), **MEGATRON)
    for cache in ("auto", "fp8", "fine_grained"):
        t = _terms(_wl(float8_cache=cache, **kw), ac="selective")
        assert t[FULL] == 2.0 * (DSV3.kv_lora_rank + DSV3.q_lora_rank), cache
        assert t[SEQ] == 2 * 2.0 * DSV3.dim, cache          # the two fused block norms' bf16 inputs only
        kept = _terms(_wl(float8_cache=cache, **MEGATRON))   # no recompute: the up projections' inputs
        # auto under the megatron layout is Transformer Engine's fp8 cache
        assert kept[FULL] == (1.0 if cache in ("auto", "fp8") else 1 + 4 / 128) * \
            (DSV3.kv_lora_rank + DSV3.q_lora_rank), cache
    up = _terms(_wl(selective_ac="modules", recompute_modules=("mla_up_proj",), **MEGATRON), ac="selective")
    both = _terms(_wl(selective_ac="modules", recompute_modules=("layernorm", "mla_up_proj"), **MEGATRON),
                  ac="selective")
    assert both[SHARD] == up[SHARD] and both[SEQ] < up[SEQ]


def test_bad_values_are_refused_in_one_line():
    for key, bad, allowed in (("moment_dtype", "fp16", "fp32, bf16"), ("float8_cache", "e5m6", "auto, fp8, fine_grained")):
        with pytest.raises(SpecError) as ei:
            _wl(**{key: bad})
        msg = str(ei.value)
        assert "\n" not in msg and key in msg and bad in msg and allowed in msg, msg


def test_flags_plan_file_and_json_echo(tmp_path):
    keys = ["--recompute-modules", "layernorm,mla_up_proj,moe_act"]
    via_flag = planner_cli(*DS_CLI, *keys, "--moment-dtype", "bf16", "--float8-cache", "fine_grained")
    assert via_flag.returncode == 0, via_flag.stderr
    doc = json.loads(via_flag.stdout)
    assert doc["workload"]["moment_dtype"] == "bf16" and doc["workload"]["float8_cache"] == "fine_grained"
    plain = json.loads(planner_cli(*DS_CLI, *keys).stdout)
    assert plain["workload"]["moment_dtype"] == "fp32" and plain["workload"]["float8_cache"] == "auto"
    mem, mem0 = doc["predicted"]["memory_gib"], plain["predicted"]["memory_gib"]
    assert mem["optimizer"] < mem0["optimizer"] and mem["activations"] < mem0["activations"]
    assert mem["params"] == mem0["params"] and mem["grads"] == mem0["grads"]
    plan_file = tmp_path / "plan.yaml"
    plan = Plan(dp_shard=128, pp=16, ep=64, microbatch=1, n_microbatches=120, schedule="DualPipeV", stages_per_rank=2,
                ac="selective", compile=True, float8=True, runnable=False)
    plan_file.write_text(yaml.safe_dump({"model": "deepseek-v3-671b", "plan": plan.to_dict(), "workload": {
        "seq_len": 4096, "global_batch": 15360, "moment_dtype": "bf16", "float8_cache": "fine_grained"}}))
    via_file = planner_cli(*DS_CLI, *keys, "--plan", str(plan_file))
    assert via_file.returncode == 0, via_file.stderr
    assert json.loads(via_file.stdout)["predicted"] == doc["predicted"]


def test_titan_run_refuses_what_it_does_not_run(tmp_path):
    assert_titan_run_refuses(tmp_path, "moment_dtype", "bf16", ["fp32"])
    assert_titan_run_refuses(tmp_path, "float8_cache", "fine_grained", ["auto"])
    assert_titan_run_refuses(tmp_path, "float8_cache", "fp8", ["auto"])


# --------------------------------------------------------------------------- the published run
def test_the_trained_deepseek_v3_run_is_scored_for_its_fit_and_fits():
    vr = load_bench("validate_reference")
    row = next(r for r in vr.load_extra_rows() if r["id"] == "deepseekv3_report_671B_2048gpu")
    case = vr.build_case(row)
    assert case.trained and not case.oom
    assert case.plan.schedule == "DualPipeV" and case.plan.pp == 16 and case.plan.ep == 64 and case.plan.float8
    wl = case.workload
    assert (wl.moment_dtype, wl.float8_cache, wl.state_layout, wl.zero) == ("bf16", "fine_grained", "megatron", 1)
    assert set(wl.recompute_modules) == {"layernorm", "mla_up_proj", "moe_act"}
    assert "tokens_per_s_per_gpu" in case.measured and "tokens_per_s_per_gpu" in case.not_counted
    assert case.measured["tokens_per_s_per_gpu"] == pytest.approx(1e12 / (180000 * 3600))
    fit = vr.fit_check([case])
    assert fit == {"n": 1, "misses": []}
    res = vr.evaluate([case])
    assert [r["counted"] for r in res] == [False]
    # the verdict rests on the stated mechanisms: without them the same layout is predicted not to fit
    # (fp32 moments, no moe_act recompute, the linears' bf16 inputs cached: float8 off for the cache)
    bare = dataclasses.replace(wl, moment_dtype="fp32", float8_cache="auto", recompute_modules=("layernorm", "mla_up_proj"))
    est = estimate(CandidateTable.from_plans([Plan.from_dict({**case.plan.to_dict(), "float8": False},
                                                                runnable=False)]), case.model, case.hw,
                   bare, Coefficients())
    assert not bool(est.fits[0]), float(est.peak_memory_bytes[0]) / GIB
