"""Dry-run step-peak estimate vs the measured peak of real CPU runs, per rank (llama3-debug, world 4).

For each plan: ``titan-run --dry-run --memory --ranks 0,1,2,3`` (one process, fake process group)
and a real ``titan-run --nproc-per-node 4 --steps 3`` (gloo; summary.json has the profiler-measured
peak per rank, executor/metrics.py).  Prints dry-run / measured per rank (the dry run's
pp_recv_buffers left out: the CPU measurement does not see buffers allocated before the profiled step).  The real runs start 5
processes, so they go through ``flock /tmp/titan_heavy.lock`` (shared machine).

    python bench/bench_dry_run_memory.py --out /tmp/drbench [--reuse]   # --reuse: keep finished runs
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

WORKLOAD = {"seq_len": 256, "dtype": "fp32"}
PLANS = {   # name: (plan, global batch)
    "pp2dp2_1f1b": ({"pp": 2, "dp_shard": 2, "n_microbatches": 4, "schedule": "1F1B", "microbatch": 2}, 16),
    "pp2dp2_interleaved": ({"pp": 2, "dp_shard": 2, "n_microbatches": 4, "schedule": "Interleaved1F1B",
                            "stages_per_rank": 2, "microbatch": 2}, 16),
    "pp2dp2_zbv": ({"pp": 2, "dp_shard": 2, "n_microbatches": 4, "schedule": "ZBVZeroBubble",
                    "stages_per_rank": 2, "microbatch": 2}, 16),
    "pp2tp2_dualpipev": ({"pp": 2, "tp": 2, "n_microbatches": 4, "schedule": "DualPipeV",
                          "stages_per_rank": 2, "microbatch": 2}, 8),
    "pp2cp2_gpipe": ({"pp": 2, "cp": 2, "n_microbatches": 4, "schedule": "GPipe", "microbatch": 2}, 8),
    "cp2dp2": ({"cp": 2, "dp_shard": 2, "microbatch": 2, "n_microbatches": 2}, 8),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/drbench")
    ap.add_argument("--reuse", action="store_true", help="reuse real runs whose summary.json exists")
    ap.add_argument("--only", nargs="*", help="plan names")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (plan, gb) in PLANS.items():
        if args.only and name not in args.only:
            continue
        f = out / f"{name}.yaml"
        f.write_text(yaml.safe_dump({"model": "llama3-debug", "workload": {**WORKLOAD, "global_batch": gb},
                                     "plan": plan}))
        dr = subprocess.run([sys.executable, "-m", "executor.cli", "--dry-run", "--plan", str(f), "--memory",
                             "--ranks", "0,1,2,3", "--json"], capture_output=True, text=True, timeout=600)
        doc = json.loads(dr.stdout.strip().splitlines()[-1])
        assert doc["status"] == "ok", doc
        run = out / f"run_{name}"
        if not (args.reuse and (run / "summary.json").exists()):
            r = subprocess.run(["flock", "/tmp/titan_heavy.lock", sys.executable, "-m", "executor.cli", "--plan",
                                str(f), "--nproc-per-node", "4", "--steps", "3", "--run-dir", str(run)],
                               capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, r.stderr[-2000:]
        measured = json.loads((run / "summary.json").read_text())["peak_memory_bytes_per_rank"]
        for x in doc["ranks"]:
            # the CPU measurement (executor/metrics.py) counts the state at the step start plus what the
            # profiled step allocates: the pipeline's receive buffers, allocated at step 1 and kept, are
            # outside both, so they are left out of the comparison
            est = x["memory_estimate"]["total"] - x["memory_estimate"].get("pp_recv_buffers", 0.0)
            how = x["memory_model"]
            m = measured[x["rank"]]
            rows.append((name, x["rank"], est, m, est / m, how["in_flight_max"], how.get("in_flight_cost_model")))
    print(f"{'plan':<20} {'rank':>4} {'dry-run MiB':>12} {'measured MiB':>13} {'ratio':>6} {'in flight':>9} {'cost model':>10}")
    for name, r, est, m, ratio, infl, cm in rows:
        print(f"{name:<20} {r:>4} {est / 2**20:>12.1f} {m / 2**20:>13.1f} {ratio:>6.3f} {infl:>9g} "
              f"{'' if cm is None else format(cm, 'g'):>10}")
    ratios = sorted(r[4] for r in rows)
    if ratios:
        print(f"ratio dry-run/measured over {len(ratios)} ranks: min {ratios[0]:.3f} median "
              f"{ratios[len(ratios) // 2]:.3f} max {ratios[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
