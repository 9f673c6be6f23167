"""Checkpoint pieces without a training run: validation, safe loading, re-planning, HF names/RoPE, CLI plumbing."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor import checkpoint_files as ck
from executor.config import ConfigError
from executor.elastic import nnodes_range, replan
from search_spaces.plan import Plan
from tests.distributed.harness import ROOT, env, titan_run_cmd


def fake_checkpoint(folder: Path, step: int, *, fingerprint: str | None = None, model: str = "llama3-debug") -> Path:
    """A tiny but well-formed checkpoint folder (real DCP files of a small state dict, our JSON)."""
    import torch.distributed.checkpoint as dcp
    from cost_models.specs import load_model
    path = folder / ck.step_name(step)
    path.mkdir(parents=True)
    with pytest.warns(UserWarning):
        dcp.save({"model": {"w": torch.arange(1000, dtype=torch.float32)}}, checkpoint_id=str(path), no_dist=True)
    meta = {"format": ck.FORMAT, "kind": "train", "model": model, "step": step,
            "fingerprint": fingerprint or ck.model_fingerprint(load_model(model)), "data": {"global_batch": 4}}
    (path / ck.META).write_text(json.dumps(meta))
    (path / ck.MARKER).write_text(json.dumps({"files": ck.manifest(path), "step": step}))
    return path


def test_fingerprint_is_layout_independent_and_model_specific():
    from cost_models.specs import load_model
    a = ck.model_fingerprint(load_model("llama3-debug"))
    assert a == ck.model_fingerprint(load_model("llama3-debug")) and len(a) == 16
    assert a != ck.model_fingerprint(load_model("moe-debug"))


def test_truncated_garbled_and_unmarked_checkpoints_are_skipped_with_a_warning(tmp_path):
    good = fake_checkpoint(tmp_path, 2)
    s4, s6, s8 = (fake_checkpoint(tmp_path, s) for s in (4, 6, 8))
    shard = next(s8.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])                       # truncated
    shard = next(s6.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF                                       # garbled, same size
    shard.write_bytes(bytes(data))
    (s4 / ck.MARKER).unlink()                                          # never completed
    (tmp_path / "step-000010.tmp").mkdir()                             # a save in progress
    assert "truncated" in ck.problem(s8) and "sha256" in ck.problem(s6) and "marker" in ck.problem(s4)
    warnings: list[str] = []
    assert ck.resolve("latest", tmp_path, warn=warnings.append) == good
    assert len(warnings) == 3 and all(w.startswith("warning: skipping checkpoint") for w in warnings)
    assert ck.resolve(str(tmp_path), tmp_path / "elsewhere", warn=warnings.append) == good   # a folder of them
    with pytest.raises(ck.CheckpointError, match=r"cannot be loaded: file .* \(truncated\?\)"):
        ck.resolve(str(s8), tmp_path)                                  # named explicitly: refused, not skipped
    (next(good.glob("*.distcp"))).unlink()
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint"):
        ck.resolve("latest", tmp_path, warn=lambda m: None)


def test_digests_computed_elsewhere_are_merged_and_still_verified(tmp_path):
    path = fake_checkpoint(tmp_path, 2)
    full = ck.manifest(path)
    shard = next(path.glob("*.distcp")).name
    paced = []
    own = ck.manifest(path, names=[shard], pace=lambda: paced.append(1))   # what a writer computes for its file
    assert own == {shard: full[shard]} and paced
    assert ck.manifest(path, known=own) == full
    wrong = {shard: [full[shard][0], "0" * 64]}                    # a wrong digest from a rank is caught at load
    (path / ck.MARKER).write_text(json.dumps({"files": ck.manifest(path, known=wrong), "step": 2}))
    assert "sha256" in ck.problem(path)


def test_background_writer_pacer_keeps_its_cpu_share():
    import time
    from executor.checkpoint_writer import _Pacer
    pacer = _Pacer(0.25)
    w0, c0 = time.perf_counter(), time.thread_time()
    while time.thread_time() - c0 < 0.2:                            # 0.2 s of CPU work in small pieces
        sum(range(2000))
        pacer()
    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    assert cpu / wall <= 0.27 and pacer.slept >= 0.5
    free = _Pacer(1.0)
    free()
    assert free.slept == 0.0


def test_dcp_metadata_is_unpickled_with_an_allow_list(tmp_path):
    path = fake_checkpoint(tmp_path, 1)
    meta = ck.safe_unpickle((path / ".metadata").read_bytes())
    assert type(meta).__name__ == "Metadata"
    state = {"model": {"w": torch.zeros(1000)}}
    ck.dcp_load(state, path, no_dist=True)
    assert torch.equal(state["model"]["w"], torch.arange(1000, dtype=torch.float32))

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(Exception, match="not allowed"):
        ck.dcp_load({"model": {"w": torch.zeros(1000)}}, path, no_dist=True)
    assert not (tmp_path / "pwned").exists()


def test_pickled_objects_inside_a_checkpoint_are_refused(tmp_path):
    """DCP stores non-tensor values as torch.save bytes and loads them with weights_only=False: we refuse."""
    import torch.distributed.checkpoint as dcp
    with pytest.warns(UserWarning):
        dcp.save({"extra": {"obj": {"a": 1}}}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(Exception, match="pickled object"):
        ck.dcp_load({"extra": {"obj": {"a": 0}}}, tmp_path, no_dist=True)


def test_replan_keeps_model_parallel_degrees_and_the_global_batch():
    p = replan(Plan(dp_shard=4, tp=2, microbatch=2), 4)
    assert (p.dp_shard, p.tp, p.microbatch, p.n_microbatches) == (2, 2, 2, 2) and p.global_batch() == 8
    p = replan(Plan(dp_replicate=2, dp_shard=2, pp=2, microbatch=1, n_microbatches=2), 4)
    assert (p.dp_replicate, p.dp_shard, p.pp, p.n_microbatches) == (1, 2, 2, 4) and p.global_batch() == 8
    with pytest.raises(ConfigError, match="tp\\*pp\\*cp = 1\\*2\\*1 = 2 does not divide"):
        replan(Plan(pp=2, dp_shard=2, microbatch=1, n_microbatches=2), 3)
    with pytest.raises(ConfigError, match="not divisible by dp"):
        replan(Plan(dp_shard=2, microbatch=2), 3)
    assert nnodes_range("2:4") == (2, 4) and nnodes_range("3") == (3, 3)
    with pytest.raises(ConfigError):
        nnodes_range("4:2")


def test_replan_needs_a_divisible_global_batch():
    with pytest.raises(ConfigError, match="global batch 6 is not divisible by dp = 4"):
        replan(Plan(dp_shard=2, microbatch=3), 4, global_batch=6)


def test_hf_names_and_rope_permutation_match_hf_rotate_half():
    from executor.export import from_hf_rope, hf_name, our_name, to_hf_rope
    from executor.models.llama import apply_rope, rope_cos_sin
    assert hf_name("layers.3.attention.wq.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("layers.0.feed_forward.w1.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert hf_name("layers.0.feed_forward.w3.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight" and our_name("model.norm.weight") == "norm.weight"
    heads, hd, dim, seq = 4, 16, 32, 7
    w, x = torch.randn(heads * hd, dim), torch.randn(1, seq, dim)
    assert torch.equal(from_hf_rope(to_hf_rope(w, hd), hd), w)
    cos, sin = rope_cos_sin(torch.arange(seq), hd, 10000.0, torch.float32)
    ours = apply_rope((x @ w.T).view(1, seq, heads, hd), cos, sin)               # interleaved pairs
    q = (x @ to_hf_rope(w, hd).T).view(1, seq, heads, hd)                         # HF: rotate_half
    c, s = torch.cat([cos, cos], -1)[None, :, None, :], torch.cat([sin, sin], -1)[None, :, None, :]
    rot = torch.cat([-q[..., hd // 2:], q[..., :hd // 2]], -1)
    hf = q * c + rot * s
    # HF's output is ours with each head's dims permuted the same way as the weights
    assert torch.allclose(to_hf_rope(ours.reshape(seq, heads * hd).T, hd).T.reshape(hf.shape), hf, atol=1e-5)


def run_cli(args, timeout=120):
    return subprocess.run(titan_run_cmd(*args), cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def test_checkpoint_of_another_model_is_refused_before_start(tmp_path):
    fake_checkpoint(tmp_path / "ck", 3, fingerprint="0123456789abcdef", model="moe-debug")
    p = run_cli(["--steps", "5", "--run-dir", str(tmp_path / "run"), "--resume", str(tmp_path / "ck")])
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "is of model 'moe-debug'" in lines[0] and "parameter shapes differ" in lines[0]
    assert not (tmp_path / "run").exists()
    p = run_cli(["--steps", "5", "--run-dir", str(tmp_path / "run"), "--resume"])       # latest, none there
    assert p.returncode == 2 and "no complete checkpoint under" in p.stderr


def test_elastic_flags_reach_torchrun(monkeypatch):
    """titan-run's flags reach torchrun's own parser, and its agent (run in titan-run's process) starts the
    workers with child_env(); the launcher's environment and signal handlers are put back afterwards.  Only the
    agent's start is replaced (it would start workers): torchrun parses the real command line."""
    import torch.distributed.run as torchrun

    from executor import launch
    seen = []

    def fake_run(args):
        seen.append((args, dict(os.environ)))
        signal.signal(signal.SIGTERM, lambda *a: None)     # as the agent does (its handler stops the workers)
    monkeypatch.setattr(torchrun, "run", fake_run)
    term = signal.getsignal(signal.SIGTERM)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = dict(os.environ)
    assert launch.run_torchrun(4, ["--plan", "p.yaml"], max_restarts=3, nnodes="1:2", rdzv_endpoint="h:29400",
                               rdzv_id="job7") == 0
    args, env = seen[-1]
    assert (args.max_restarts, args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id,
            args.nproc_per_node, args.standalone) == (3, "1:2", "c10d", "h:29400", "job7", "4", False)
    assert (args.module, args.training_script, args.training_script_args) == (True, "executor.cli",
                                                                               ["--plan", "p.yaml"])
    assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONPATH"].split(os.pathsep)[0] == str(launch.REPO_ROOT)
    assert dict(os.environ) == before and signal.getsignal(signal.SIGTERM) is term
    launch.run_torchrun(2, [])
    args, _ = seen[-1]
    assert args.standalone and args.max_restarts == 0


def test_export_without_safetensors_is_a_clear_error(monkeypatch):
    import builtins

    from executor import export
    real = builtins.__import__

    def no_st(name, *a, **k):
        if name.startswith("safetensors"):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_st)
    with pytest.raises(ck.CheckpointError, match="pip install safetensors"):
        export._safetensors()


def test_train_keys_are_validated():
    from executor.config import TrainConfig
    t = TrainConfig(checkpoint_every=5, keep_checkpoints=2, async_checkpoint=True, resume="latest")
    assert t.checkpoint_every == 5
    with pytest.raises(ConfigError, match="checkpoint_every"):
        TrainConfig(checkpoint_every=-1)
    with pytest.raises(ConfigError, match="async_checkpoint"):
        TrainConfig(async_checkpoint="yes")
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match=r"async_checkpoint_cpu_share' must be in \(0, 1\]"):
            TrainConfig(async_checkpoint_cpu_share=bad)
    assert sys.version_info >= (3, 10)


def test_metrics_after_a_resume_keep_earlier_steps_and_drop_rerun_ones(tmp_path):
    from executor.metrics_writer import MetricsWriter

    def rec(step):
        return {"step": step, "loss": 1.0 / step, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0,
                "tokens_per_s_per_device": 1.0, "step_time_s": 0.1, "data_time_s": 0.0}

    def steps():
        return [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    w = MetricsWriter(tmp_path, enabled=True, total_steps=8, tensorboard=False)
    for s in range(1, 7):
        w.write(rec(s))
    w.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')                        # torn line of a process killed mid-write
    w = MetricsWriter(tmp_path, enabled=True, total_steps=8, tensorboard=False, resume_step=4)
    assert steps() == [1, 2, 3, 4]                         # steps 5, 6 are trained again; the torn line goes
    for s in range(5, 9):
        w.write(rec(s))
    w.close()
    assert steps() == list(range(1, 9))
    assert all("time" in json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    MetricsWriter(tmp_path, enabled=True, total_steps=8, tensorboard=False).close()     # a fresh run: starts over
    assert steps() == []
    MetricsWriter(tmp_path / "elsewhere", enabled=False, total_steps=8, tensorboard=False, resume_step=3).close()
