"""Hugging Face interop with the real `transformers`: tiny random Llama models built here (nothing is
downloaded), with and without tied embeddings and Llama 3.1 rope scaling, round-trip both ways.

* HF folder (sharded safetensors + index) -> ``titan-run import --hf`` -> our model: logits within 1e-5
  (fp32) of HF's on the same tokens, at positions beyond ``original_max_position_embeddings``.
* our checkpoint (a real ``titan-run`` training run) -> ``titan-run export --hf-dir`` ->
  ``AutoModelForCausalLM.from_pretrained``: logits within 1e-5 of ours.
* config.json -> ModelSpec (``hf:DIR``), the built parameter count equals the cost model's, and the
  bad inputs (unsupported architecture / rope type, missing file, folder without config.json): one
  line, exit 2, no traceback.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from cost_models.flops import param_counts
from cost_models.specs import SpecError, load_model
from executor.checkpoint_files import dcp_load, read_meta
from executor.cli import main as executor_main
from executor.models.llama import Transformer
from planner.cli import main as plan_main
from tests.distributed.harness import ROOT, env, titan_run_cmd

transformers = pytest.importorskip("transformers")       # the dev extra
pytest.importorskip("safetensors")
pytest.importorskip("huggingface_hub")

VOCAB, SEQ = 96, 48
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}          # SEQ = 48 > 16: the scaling matters


def hf_model(folder: Path, *, tied: bool, scaling: dict | None, seed: int = 0):
    """A tiny random LlamaForCausalLM saved as a sharded checkpoint (several safetensors files + index)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_theta=5000.0, rope_scaling=scaling,
                                   tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 1
    return model


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(titan_run_cmd(*args), cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def our_model(checkpoint: Path) -> Transformer:
    """Our Transformer with the model part of a checkpoint (any layout), fp32, on the CPU."""
    model = Transformer(load_model(read_meta(checkpoint)["model"])).eval()
    state = {"model": {k: torch.empty(v.shape) for k, v in model.state_dict().items()}}
    dcp_load(state, checkpoint, no_dist=True)
    model.load_state_dict(state["model"])
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["rope", "llama3"])
def test_hf_folder_imports_with_matching_logits(tmp_path, tied, scaling):
    hf = hf_model(tmp_path / "hf", tied=tied, scaling=scaling)
    p = cli("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"))
    assert p.returncode == 0, p.stderr
    ours = our_model(tmp_path / "ck")
    spec = ours.spec
    assert spec.tie_embeddings is tied and spec.rope_scaling == ("llama3" if scaling else "none")
    assert (ours.output.weight is ours.tok_embeddings.weight) is tied
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    with torch.no_grad():
        diff = (ours(tokens()) - hf(tokens()).logits).abs().max().item()
    print(f"import tied={tied} scaling={bool(scaling)}: max logit diff {diff:.2e}")
    assert diff < 1e-5


def test_rope_scaling_is_not_ignored(tmp_path):
    """The same weights without the llama3 scaling give other logits past the original context."""
    hf = hf_model(tmp_path / "hf", tied=False, scaling=LLAMA3)
    assert cli("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")).returncode == 0
    ours = our_model(tmp_path / "ck")
    plain = Transformer(load_model(read_meta(tmp_path / "ck")["model"]).__class__(
        **{**ours.spec.to_dict(), "rope_scaling": "none"})).eval()
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        ref = hf(tokens()).logits
        assert (ours(tokens()) - ref).abs().max() < 1e-5
        assert (plain(tokens()) - ref).abs().max() > 1e-3


def test_trained_checkpoint_exports_to_from_pretrained(tmp_path):
    """A real titan-run training run of a tied, llama3-scaled model -> export --hf-dir -> transformers."""
    spec = {"name": "tiny-tied", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
            "vocab_size": 512, "rope_theta": 10000.0, "max_seq_len": 128, "tie_embeddings": True,
            "rope_scaling": "llama3", "rope_factor": 4.0, "rope_original_max_seq_len": 16}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    p = cli("--nproc-per-node", "1", "--steps", "2", "--run-dir", str(run), "--set", f"model={tmp_path / 'tiny.yaml'}",
            "--set", "workload.seq_len=32", "--set", "train.checkpoint_every=2", "--set", "train.tensorboard=false",
            timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    checkpoint = run / "checkpoints" / "step-000002"
    out = tmp_path / "hf"
    p = cli("export", "--checkpoint", str(checkpoint), "--hf-dir", str(out), "--max-shard-size", "100KB")
    assert p.returncode == 0, p.stderr
    assert "shard(s) + config.json" in p.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rope_scaling"]["rope_type"] == "llama3"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ours = our_model(checkpoint)
    tok = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(2))    # 64 > 16
    with torch.no_grad():
        diff = (ours(tok) - hf(tok).logits).abs().max().item()
    print(f"export (trained, tied, llama3): max logit diff {diff:.2e}")
    assert diff < 1e-5
    # the exported folder imports back to the same weights
    assert cli("import", "--hf", str(out), "--out", str(tmp_path / "back")).returncode == 0
    back = our_model(tmp_path / "back")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))
    # bf16 export: half the bytes, loads in transformers
    p = cli("export", "--checkpoint", str(checkpoint), "--hf-dir", str(tmp_path / "bf16"), "--dtype", "bf16")
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert hf16.model.embed_tokens.weight.dtype == torch.bfloat16


def test_config_json_maps_to_the_model_spec(tmp_path):
    hf_model(tmp_path / "hf", tied=True, scaling=LLAMA3)
    spec = load_model(f"hf:{tmp_path / 'hf'}")
    assert (spec.dim, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.vocab_size,
            spec.ffn_hidden, spec.max_seq_len) == (32, 2, 4, 2, 8, VOCAB, 64, 64)
    assert (spec.rope_theta, spec.norm_eps, spec.tie_embeddings) == (5000.0, 1e-5, True)
    assert (spec.rope_scaling, spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor,
            spec.rope_original_max_seq_len) == ("llama3", 4.0, 1.0, 4.0, 16)
    # the transformers-4 form of the same config (rope_theta + rope_scaling, as published checkpoints have)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=5000.0, rope_scaling=dict(LLAMA3))
    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "config.json").write_text(json.dumps(cfg))
    assert load_model(f"hf:{tmp_path / 'v4'}").to_dict() | {"name": "", "source": ""} == \
        spec.to_dict() | {"name": "", "source": ""}


@pytest.mark.parametrize("tied", [False, True])
def test_built_parameters_are_what_the_cost_model_counts(tied):
    spec = load_model("llama3-debug").__class__(**{**load_model("llama3-debug").to_dict(), "tie_embeddings": tied})
    with torch.device("meta"):
        model = Transformer(spec)
    model.to_empty(device="cpu")                    # the executor materializes this way: still tied
    assert (model.output.weight is model.tok_embeddings.weight) is tied
    assert sum(p.numel() for p in model.parameters()) == param_counts(spec)["total"]


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _refusal(module: str, main, argv: list[str], capsys, *, real: bool) -> tuple[int, str]:
    """(exit code, stderr) of a command line: through ``python -m module`` when `real`, else through the same
    `main` in this process (the refusals are the CLI's own code either way; one real run per command checks the
    wiring, the rest skip an interpreter start each)."""
    if real:
        p = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=env(), capture_output=True,
                           text=True, timeout=300)
        return p.returncode, p.stderr
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_bad_hf_inputs_are_one_line_exit_2(tmp_path, capsys):
    good = tmp_path / "hf"
    hf_model(good, tied=False, scaling=None)
    cases = {}
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}))
    cases["moe"] = (["import", "--hf", str(moe)], "architecture 'Qwen2MoeForCausalLM'")
    yarn = tmp_path / "yarn"
    hf_model(yarn, tied=False, scaling=None)
    _edit_config(yarn, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0})
    cases["yarn"] = (["import", "--hf", str(yarn)], "rope_type 'yarn' is not supported")
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((good / "config.json").read_text())
    cases["no weights"] = (["import", "--hf", str(noweights)], "neither model.safetensors nor")
    shard = tmp_path / "shard"
    hf_model(shard, tied=False, scaling=None)
    sorted(shard.glob("model-*.safetensors"))[0].unlink()
    cases["missing shard"] = (["import", "--hf", str(shard)], "does not exist")
    noconfig = tmp_path / "noconfig"
    noconfig.mkdir()
    cases["no config"] = (["import", "--hf", str(noconfig)], "has no config.json")
    cases["no folder"] = (["import", "--hf", str(tmp_path / "nope")], "is not a folder")
    cases["index as file"] = (["import", "--safetensors", str(good / "model.safetensors.index.json"),
                               "--model", "llama3-debug"], "has shape")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    cases["damaged"] = (["import", "--safetensors", str(bad), "--model", "llama3-debug"],
                        "not a readable safetensors file")
    for i, (name, (args, want)) in enumerate(cases.items()):
        argv = [*args, "--out", str(tmp_path / "out" / name.replace(" ", "_"))]
        rc, err = _refusal("executor.cli", executor_main, argv, capsys, real=i == 0)
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (name, err)
        assert want in lines[0], (name, lines[0])
    # the planner reads the same config.json: same one-line refusals
    for i, (folder, want) in enumerate(((moe, "architecture"), (yarn, "rope_type 'yarn'"),
                                        (noconfig, "no config.json"))):
        argv = ["--model", f"hf:{folder}", "--gpus", "2", "--out", str(tmp_path / "plan.yaml")]
        rc, err = _refusal("planner.cli", plan_main, argv, capsys, real=i == 0)
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and want in lines[0], err
    with pytest.raises(SpecError, match="rope_type 'yarn'"):
        load_model(f"hf:{yarn}")


def test_mixtral_round_trips_both_ways(tmp_path):
    """MixtralForCausalLM = the executor's MoE (softmax over all experts, top-k, renormalised; SwiGLU experts):
    import -> our logits, and export -> from_pretrained (a MixtralForCausalLM again) -> the same logits."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="30KB")
    assert cli("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")).returncode == 0
    ours = our_model(tmp_path / "ck")
    assert (ours.spec.n_experts, ours.spec.top_k, ours.spec.moe_ffn_hidden) == (4, 2, 48)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters()) == \
        param_counts(ours.spec)["total"]
    p = cli("export", "--checkpoint", str(tmp_path / "ck"), "--hf-dir", str(tmp_path / "out"), "--max-shard-size", "30KB")
    assert p.returncode == 0, p.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        ref = hf(tokens()).logits
        d_import, d_export = (ours(tokens()) - ref).abs().max().item(), (back(tokens()).logits - ref).abs().max().item()
    print(f"mixtral: import max logit diff {d_import:.2e}, export {d_export:.2e}")
    assert d_import < 1e-5 and d_export < 1e-5


def test_titan_plan_plans_for_an_hf_folder(tmp_path):
    hf_model(tmp_path / "hf", tied=True, scaling=LLAMA3)
    out = tmp_path / "plan.yaml"
    p = subprocess.run([sys.executable, "-m", "planner.cli", "--model", f"hf:{tmp_path / 'hf'}", "--gpus", "2",
                        "--out", str(out)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(out.read_text())["model"] == f"hf:{tmp_path / 'hf'}"


@pytest.mark.parametrize("layout", [pytest.param("plan.dp_shard=2", marks=pytest.mark.slow),   # (pp=2 in CI)
                                    "plan.pp=2"])
def test_training_resumes_from_imported_hf_weights(tmp_path, layout):
    """import --hf -> titan-run --resume on 2 FSDP ranks, or 2 pipeline stages whose last holds a copy of the
    embedding (tied embeddings): the trained weights are the imported ones plus one small optimizer step, not a
    fresh initialization, and the saved copies stay one tied weight."""
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_theta=5000.0, rope_scaling=dict(LLAMA3),
                                   tie_word_embeddings=True)             # 320 >= the byte tokenizer's 259
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert cli("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "init")).returncode == 0
    run = tmp_path / "run"
    p = cli("--nproc-per-node", "2", "--steps", "1", "--run-dir", str(run), "--resume", str(tmp_path / "init"),
            "--set", f"model=hf:{tmp_path / 'hf'}", "--set", "workload.seq_len=32", "--set", layout,
            "--set", "plan.dp_shard=1" if layout == "plan.pp=2" else "plan.pp=1", "--set", "train.checkpoint_every=1", "--set", "train.tensorboard=false", "--set", "train.lr=1e-4",
            timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    before, after = our_model(tmp_path / "init"), our_model(run / "checkpoints" / "step-000001")
    assert after.output.weight is after.tok_embeddings.weight
    for (name, a), b in zip(before.named_parameters(), after.parameters()):
        assert not torch.equal(a, b), f"{name} was not trained"
        # Adam's first step moves each weight by about lr: tiny next to the weights' own spread
        assert (a - b).abs().max() < 1e-3 * max(1.0, a.abs().max().item() / 0.02), name
