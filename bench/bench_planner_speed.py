"""Planner speed: llama3-405b on 16,384 H100 with the full default (dense) space.

Targets: enumeration + scoring <= 1 s in-process; the CLI <= 2 s cold.  Both search what `titan-plan` does
for a question that states no pipeline split: the space under each split (``pp_split`` layers and weighted).
Also reported, without a target: deepseek-v3-671b on 2,048 H800 with a 16M-token batch over the MoE space
(over half a million candidates per split).  Prints medians of several runs; the last line is the headline.

Measured 2026-12-07 on the shared 2-core machine (its speed swings by a third between runs), before -> after the
per-layout memo, links per mesh, step time only where memory fits and lazily overlaid regimes (a2f3009..80e3f82),
side by side in one session: in-process 1.43 -> 0.89 s (medians of 4 alternating processes x 5 runs; this script
alone printed 0.71 s), CLI cold 2.42 -> 1.69 s (medians of 4 alternating runs), deepseek-v3-671b 9.2 -> 4.2 s (one
run each; peak RSS 1,100 -> 878 MiB); every candidate that fits scored bit-identically.
2026-12-08, dense.yaml's interleaved chunks 2 / 4 -> 2 / 4 / 8 (106,560 -> 121,920 candidates): in-process 0.79 ->
0.84 s (medians of 4 alternating rounds x 3 runs, one process); this script alone printed 0.87 s, CLI cold 1.73 s.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time

ARGS = ["--model", "llama3-405b", "--gpus", "16384", "--hardware", "h100-sxm", "--seq-len", "8192",
        "--global-batch-tokens", "16M"]


def in_process(repeats: int = 5, model_name: str = "llama3-405b", hardware: str = "h100-sxm", seq_len: int = 8192,
               world: int = 16384, space_name: str = "dense") -> tuple[float, int, int]:
    from cost_models.specs import load_hardware, load_model
    from cost_models.workload import Workload
    from planner.rank import plan_candidates
    from search_spaces.space import load_space

    model, hw = load_model(model_name), load_hardware(hardware)
    wl = Workload(seq_len=seq_len, global_batch=16 * 2 ** 20 // seq_len)
    space = load_space(space_name)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        # what `titan-plan` searches when the question states none: both pipeline splits, both TP regimes, both
        # pipeline gradient syncs, both selective-checkpointing policies
        res = plan_candidates(space, model, hw, wl, world_size=world, pp_splits=("layers", "weighted"),
                              tp_activations=("auto", "sharded"), grad_syncs=("auto", "every_microbatch"),
                              selective_acs=("auto", "op"))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), res.n_candidates, res.n_feasible


def cold_cli(repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "planner.cli", *ARGS, "--no-write"], capture_output=True,
                           text=True)
        times.append(time.perf_counter() - t0)
        if r.returncode:
            raise SystemExit(f"titan-plan failed: {r.stderr}")
    return statistics.median(times)


if __name__ == "__main__":
    t_moe, n_moe, feas_moe = in_process(3, "deepseek-v3-671b", "h800", 4096, 2048, "moe")
    print(f"in-process, deepseek-v3-671b on 2,048 h800 (moe space, both splits): {n_moe:,} candidates "
          f"({feas_moe:,} feasible), median {t_moe:.3f} s")
    t_in, n, feas = in_process()
    print(f"in-process enumerate+score: {n:,} candidates ({feas:,} feasible), median {t_in:.3f} s")
    t_cli = cold_cli()
    print(f"CLI cold (new interpreter, incl. imports and printing): median {t_cli:.3f} s")
    print(f"RESULT planner_405b_16384: in-process {t_in:.3f} s (target <= 1 s), CLI {t_cli:.3f} s (target <= 2 s)")
