"""Run the real `titan-run` training in N real processes (torchrun, gloo) and read back the losses.

    from tests.distributed.harness import run_training, reference_losses, assert_losses_close
    losses = run_training(Plan(dp_shard=2, microbatch=2), nproc=2)          # 5 steps, llama3-debug, seq 64
    assert_losses_close(losses, reference_losses(global_batch=4))

Every rank writes its per-step global loss to ``<run>/ranks/rank<r>.json``;
`run_training` checks that all ranks agree and returns rank 0's list.  Runs
with more than 4 processes take ``/tmp/titan_heavy.lock`` so two heavy runs
never overlap on a small machine.
"""
from __future__ import annotations

import fcntl
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from search_spaces.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
HEAVY_LOCK = "/tmp/titan_heavy.lock"
DEFAULT_SEQ_LEN = 64
# small, deterministic, fast: enough learning rate that 5 steps move the loss
DEFAULT_TRAIN = {"lr": 3e-3, "warmup": 2, "seed": 0, "profile_step": 0, "tensorboard": False,
                 "max_corpus_bytes": 1_000_000, "grad_clip": 1.0}


def titan_run_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "executor.cli", *args]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    e.setdefault("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def run_training_all_ranks(plan: Plan, nproc: int, steps: int = 5, model: str = "llama3-debug",
                           seq_len: int = DEFAULT_SEQ_LEN, global_batch: int | None = None,
                           extra: dict | None = None, timeout: float = 900) -> dict[int, list[float]]:
    """Per-rank per-step losses of a real run; `extra` are ``--set`` overrides (``{"train.lr": 1e-3}``)."""
    global_batch = plan.global_batch() if global_batch is None else global_batch
    with tempfile.TemporaryDirectory(prefix="titan-harness-") as tmp:
        tmp = Path(tmp)
        plan_file = tmp / "plan.yaml"
        plan_file.write_text(yaml.safe_dump({
            "model": model, "workload": {"seq_len": seq_len, "global_batch": global_batch},
            "plan": plan.to_dict(), "train": {**DEFAULT_TRAIN, "steps": steps}}))
        cmd = titan_run_cmd("--plan", str(plan_file), "--nproc-per-node", str(nproc), "--run-dir",
                            str(tmp / "run"))
        for k, v in (extra or {}).items():
            cmd += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
        with _heavy_lock(nproc > 4):
            proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"titan-run failed (exit {proc.returncode}) for {plan.describe()} on {nproc} procs:\n"
                               f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
        out = {}
        for r in range(nproc):
            out[r] = json.loads((tmp / "run" / "ranks" / f"rank{r}.json").read_text())["losses"]
        return out


def run_training(plan: Plan, nproc: int, steps: int = 5, model: str = "llama3-debug",
                 seq_len: int = DEFAULT_SEQ_LEN, global_batch: int | None = None, extra: dict | None = None,
                 timeout: float = 900) -> list[float]:
    """Rank 0's per-step global losses (after checking every rank reports the same ones)."""
    per_rank = run_training_all_ranks(plan, nproc, steps, model, seq_len, global_batch, extra, timeout)
    first = per_rank[0]
    assert len(first) == steps, f"expected {steps} losses, got {len(first)}"
    for r, losses in per_rank.items():
        assert losses == first, f"rank {r} reports losses {losses}, rank 0 {first}"
    return first


@functools.lru_cache(maxsize=None)
def _reference(steps: int, model: str, seq_len: int, global_batch: int, extra_items: tuple) -> tuple[float, ...]:
    plan = Plan(microbatch=global_batch)
    return tuple(run_training(plan, 1, steps, model, seq_len, global_batch, dict(extra_items)))


def reference_losses(steps: int = 5, model: str = "llama3-debug", seq_len: int = DEFAULT_SEQ_LEN,
                     global_batch: int = 4, extra: dict | None = None) -> list[float]:
    """The single-process run of the same model, data and seed (cached per configuration)."""
    return list(_reference(steps, model, seq_len, global_batch, tuple(sorted((extra or {}).items()))))


def assert_losses_close(got: list[float], want: list[float], rtol: float = 1e-4) -> None:
    assert len(got) == len(want), f"{len(got)} losses vs {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), f"step {i + 1}: loss {g!r} vs reference {w!r} (rel {abs(g - w) / abs(w):.2e})"


class _heavy_lock:
    def __init__(self, take: bool):
        self.take, self.f = take, None

    def __enter__(self):
        if self.take:
            self.f = open(HEAVY_LOCK, "w")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.f is not None:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()
        return False


def check_worker_run(run: dict, ref_losses: list[float]) -> None:
    """A `_pp_cp_worker.py` run equals the single-process run: losses, step-0 grads, final params."""
    assert "error" not in run, run.get("error")
    for step, (a, b) in enumerate(zip(run["losses"], ref_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: loss {a} vs single-process {b}"
    assert run["grad_diff"] < 1e-5, f"step-0 gradient differs by {run['grad_diff']:.3g}"
    assert run["param_diff"] < 5e-4, f"parameters after 5 AdamW steps differ by {run['param_diff']:.3g}"
