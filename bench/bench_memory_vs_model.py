"""Measured peak memory per rank (titan-run on CPU) vs the cost model's prediction, layout by layout.

For each plan, `titan-run` trains llama3-debug for 3 steps (fp32, gloo) and
measures the peak tensor bytes of step 2 on every rank (CPU profiler allocation
events + the training state alive at the step start; executor/metrics.py); the
cost model's `cost_models.estimate.estimate` predicts the worst rank's peak
for the same plan, model and workload.  Prints one row per plan and, last, the
median and worst absolute percentage error.

    python bench/bench_memory_vs_model.py [--seq-len 256] [--global-batch 8] [--max-procs 4] [--cache F.json]

`--cache`: a JSON file of measured per-rank peaks keyed by plan; plans found there are not
re-run (to compare cost-model changes against the same measurements), new ones are added.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from search_spaces.plan import Plan  # noqa: E402

PLANS = [
    Plan(microbatch=8),
    Plan(microbatch=8, ac="full"),
    Plan(dp_shard=2, microbatch=4),
    Plan(dp_shard=2, microbatch=4, reshard_after_forward=False),
    Plan(tp=2, microbatch=8),
    Plan(dp_shard=2, microbatch=2, n_microbatches=2, ac="selective"),
    Plan(dp_shard=2, tp=2, microbatch=4),
    Plan(dp_shard=4, microbatch=2),
]


def measure(plan: Plan, model: str, seq_len: int, global_batch: int) -> list[int]:
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "plan.yaml"
        f.write_text(yaml.safe_dump({"model": model, "workload": {"seq_len": seq_len, "global_batch": global_batch},
                                     "plan": plan.to_dict(),
                                     "train": {"steps": 3, "profile_step": 2, "tensorboard": False,
                                               "dtype": "fp32", "max_corpus_bytes": 2_000_000}}))
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "executor.cli", "--plan", str(f), "--nproc-per-node", str(plan.world_size),
               "--run-dir", str(Path(tmp) / "run")]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"titan-run failed for {plan.describe()}:\n{p.stderr[-3000:]}")
        return json.loads((Path(tmp) / "run" / "summary.json").read_text())["peak_memory_bytes_per_rank"]


def predict(plan: Plan, model: str, seq_len: int, global_batch: int):
    from cost_models.estimate import estimate
    from cost_models.specs import load_hardware, load_model
    from cost_models.workload import Workload
    from search_spaces.table import CandidateTable
    est = estimate(CandidateTable.from_plans([plan]), load_model(model), load_hardware("cpu"),
                   Workload(seq_len=seq_len, global_batch=global_batch, dtype="fp32"))
    return float(est.peak_memory_bytes[0]), {k: float(v[0]) for k, v in est.memory.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-debug")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--max-procs", type=int, default=4)
    ap.add_argument("--cache", default=None, help="JSON file of measured peaks to reuse and extend")
    args = ap.parse_args()
    cache = json.loads(Path(args.cache).read_text()) if args.cache and Path(args.cache).exists() else {}
    mib = 2 ** 20
    errors = []
    print(f"{'plan':<40} {'measured MiB (max rank)':>24} {'predicted MiB':>14} {'error':>8}   predicted breakdown MiB")
    for plan in PLANS:
        if plan.world_size > args.max_procs or plan.global_batch() != args.global_batch:
            continue
        key = f"{args.model} s{args.seq_len} gb{args.global_batch} " + json.dumps(plan.to_dict(), sort_keys=True)
        peaks = cache.get(key) or measure(plan, args.model, args.seq_len, args.global_batch)
        if args.cache:
            cache[key] = peaks
            Path(args.cache).write_text(json.dumps(cache, indent=1))
        got = max(peaks)
        want, parts = predict(plan, args.model, args.seq_len, args.global_batch)
        err = (want - got) / got
        errors.append(abs(err))
        brk = " ".join(f"{k}={v / mib:.0f}" for k, v in parts.items() if v)
        print(f"{plan.describe():<40} {got / mib:>24.1f} {want / mib:>14.1f} {100 * err:>+7.1f}%   {brk}", flush=True)
    print(f"absolute error: median {100 * statistics.median(errors):.1f}%  worst {100 * max(errors):.1f}% "
          f"over {len(errors)} plans")


if __name__ == "__main__":
    main()
