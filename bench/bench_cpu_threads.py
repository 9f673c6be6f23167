"""One CPU process on one thread vs on every core: the measured speedup of a training step against the cost
model's (HardwareSpec.threads_per_process / for_world with the hardware spec's thread scalings).

titan-run gives each process of a CPU host cores // processes threads, so a host running fewer processes than
cores computes each op on several threads.  This times the executor's model (fwd + bwd + fused AdamW, the
same step titan-run runs for a world-1 plan) at 1 thread and at all cores, alternating, and compares the
median ratio with the cost model's prediction for the same plan (world 1, the whole batch as one
micro-batch) on `--hardware` with host_cores 1 vs this machine's cores.

    python bench/bench_cpu_threads.py [--model llama3-debug] [--batch 8] [--seq 256] [--reps 7] [--compile]
        [--hardware cpu]

Measured 2026-12-05 on the 2-core build machine (the stock cpu preset), llama3-debug, batch 8 x 256, fp32,
medians of 7 alternating pairs: see docs/torch_on_cpu.md §12 and the figures printed last.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cost_models.estimate import estimate  # noqa: E402
from cost_models.specs import load_hardware, load_model, this_host_cores  # noqa: E402
from cost_models.workload import Workload  # noqa: E402
from executor.models.llama import Transformer  # noqa: E402
from search_spaces.plan import Plan  # noqa: E402
from search_spaces.table import CandidateTable  # noqa: E402


def predicted_speedup(model, hw, cores: int, batch: int, seq: int, compiled: bool) -> tuple[float, float, float]:
    plan = Plan(microbatch=batch, n_microbatches=1, compile=compiled)
    wl = Workload(seq_len=seq, global_batch=batch, dtype="fp32")
    table = CandidateTable.from_plans([plan])
    t1 = float(estimate(table, model, dataclasses.replace(hw, host_cores=1, gpus_per_node=1), wl).step_time_s[0])
    tn = float(estimate(table, model, dataclasses.replace(hw, host_cores=cores, gpus_per_node=1), wl).step_time_s[0])
    return t1, tn, t1 / tn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-debug")
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    cores = this_host_cores()
    if cores < 2:
        print("this machine has one core: nothing to compare", file=sys.stderr)
        return 2
    spec = load_model(args.model)
    torch.manual_seed(0)
    model = Transformer(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model) if args.compile else model
    x = torch.randint(0, spec.vocab_size, (args.batch, args.seq))

    def step() -> float:
        t0 = time.perf_counter()
        out = fwd(x)
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times: dict[int, list[float]] = {1: [], cores: []}
    for th in (1, cores):                   # warm-up (and compile) at each count
        torch.set_num_threads(th)
        step(), step()
    for r in range(args.reps):
        order = (1, cores) if r % 2 == 0 else (cores, 1)
        for th in order:
            torch.set_num_threads(th)
            times[th].append(step())
        ratio_r = times[1][-1] / times[cores][-1]
        print(f"pair {r + 1}/{args.reps}: 1 thread {times[1][-1]:.3f} s, {cores} threads {times[cores][-1]:.3f} s "
              f"(x{ratio_r:.2f})", file=sys.stderr, flush=True)
    ratios = [a / b for a, b in zip(times[1], times[cores])]
    measured = statistics.median(ratios)
    t1, tn, predicted = predicted_speedup(spec, load_hardware(args.hardware), cores, args.batch, args.seq, args.compile)
    m1, mn = statistics.median(times[1]), statistics.median(times[cores])
    print(f"{args.model} batch {args.batch} x {args.seq}, fp32, {'compiled' if args.compile else 'eager'}, "
          f"one process, medians of {args.reps} alternating pairs")
    print(f"  measured : 1 thread {m1:.3f} s, {cores} threads {mn:.3f} s")
    print(f"  predicted: 1 thread {t1:.3f} s, {cores} threads {tn:.3f} s  ({args.hardware} preset figures)")
    print(f"RESULT cpu_threads: speedup on {cores} threads measured x{measured:.2f} "
          f"(pairs x{min(ratios):.2f}-x{max(ratios):.2f}), predicted x{predicted:.2f} "
          f"({(predicted / measured - 1) * 100:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
