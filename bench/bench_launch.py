"""titan-run's start-to-finish wall time with its own one-node launcher vs torchrun's agent, side by side.

The same short run (llama3-debug, seq 32, global batch 2, FSDP over 2 CPU processes, 1 step) is started as a
user starts it, `python -m executor.cli --plan ...`, in alternating rounds: once as titan-run launches it now
(`executor.launch.run_local`: the launcher starts the workers itself and, on a host without a GPU, never imports
torch) and once through torchrun's elastic agent in the launcher process (`executor.launch.run_torchrun`, what
titan-run keeps for elastic and multi-node runs).  Prints each round's seconds, the medians, and last the ratio
torchrun / own launcher (> 1: the own launcher starts and finishes sooner).

    python bench/bench_launch.py [--rounds 4] [--nproc 2]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OWN = "import sys; from executor.cli import main; sys.exit(main())"
# the same titan-run, its one-node launch sent through torchrun's agent instead
AGENT = ("import sys, executor.launch as L; L.run_local = lambda n, a: L.run_torchrun(n, a); "
         "from executor.cli import main; sys.exit(main())")


def one_run(code: str, plan: Path, run_dir: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, "--plan", str(plan), "--run-dir", str(run_dir)], cwd=ROOT,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"bench_launch: titan-run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2, help="worker processes (FSDP over all of them)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        plan = Path(tmp) / "plan.yaml"
        plan.write_text(yaml.safe_dump({"model": "llama3-debug", "workload": {"seq_len": 32, "global_batch": args.nproc},
                                        "plan": {"dp_shard": args.nproc, "microbatch": 1},
                                        "train": {"steps": 1, "tensorboard": False, "profile_step": 0}}))
        walls: dict[str, list[float]] = {"own launcher": [], "torchrun agent": []}
        for i in range(args.rounds):
            for name, code in (("torchrun agent", AGENT), ("own launcher", OWN)):
                walls[name].append(one_run(code, plan, Path(tmp) / f"run-{name[:3]}-{i}"))
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in walls.items()), flush=True)
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(f"median wall per run ({args.nproc} processes, 1 step): own launcher {med['own launcher']:.2f} s, "
          f"torchrun agent {med['torchrun agent']:.2f} s")
    print(f"RESULT launch: torchrun agent / own launcher {med['torchrun agent'] / med['own launcher']:.2f}x")


if __name__ == "__main__":
    main()
