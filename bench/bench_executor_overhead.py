"""Executor overhead: titan-run's training step vs a plain PyTorch loop, side by side (world 1, CPU).

Both train the same model (llama3-debug by default, seq 256, batch 8, fp32) on
the same batches in the same process, alternating rounds of a few steps so
drift (thermal, other processes) hits both alike; the figure is the median of
the per-round ratios.  The titan side runs the very
function the executor's loop runs per step (`executor.train.run_one_step`:
data, forward/backward, global grad-norm clip, AdamW, LR schedule, loss
reduction, metrics and communication timers); the plain side is the
textbook loop.  Prints tokens/s per round, the medians, and last the ratio
titan/plain (target >= 0.95).

    python bench/bench_executor_overhead.py [--rounds 12] [--steps 2] [--seq-len 256] [--batch 8] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-debug")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=2, help="steps per round per side")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 keeps the comparison steady on a shared 2-core machine)")
    args = ap.parse_args()

    from executor.config import load_run_config
    from executor.data import build_batches
    from executor.launch import single_process_env
    from cost_models.flops import flops_per_token
    from executor.models.llama import Transformer
    from executor.train import lr_lambda, run_one_step, setup

    single_process_env()
    total_steps = 2 + args.rounds * args.steps + 1
    cfg = load_run_config(None, [f"model={args.model}", f"workload.seq_len={args.seq_len}",
                                 f"workload.global_batch={args.batch}", "train.profile_step=0",
                                 "train.tensorboard=false", f"train.steps={total_steps}", "train.dtype=fp32"],
                          world_size=1)
    tr = setup(cfg)
    torch.set_num_threads(args.threads)
    titan_model = tr.stages[0][1]

    # the plain loop: same initial weights, same data, same optimizer settings
    plain = Transformer(cfg.spec)
    plain.load_state_dict(titan_model.state_dict())
    t = cfg.train
    opt = torch.optim.AdamW([{"params": [p for p in plain.parameters() if p.ndim >= 2], "weight_decay": t.weight_decay},
                             {"params": [p for p in plain.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)   # as titan-run (auto)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    plain_batches = build_batches(cfg, 0, 1)

    def plain_step():
        x, y = plain_batches.next_batch()
        loss = torch.nn.functional.cross_entropy(plain(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    fpt = flops_per_token(cfg.spec, cfg.seq_len)
    step_no = [0]

    def titan_step():
        step_no[0] += 1
        return run_one_step(tr, step_no[0], fpt, None)["loss"]

    def timed(fn, n):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return n * cfg.tokens_per_step / (time.perf_counter() - t0)

    tr.comm.install()
    try:
        for _ in range(2):                          # warm-up both
            titan_step(), plain_step()
        titan, plainr = [], []
        for r in range(args.rounds):
            order = [("titan", titan_step), ("plain", plain_step)]
            if r % 2:
                order.reverse()
            for name, fn in order:
                (titan if name == "titan" else plainr).append(timed(fn, args.steps))
            print(f"round {r + 1}: titan {titan[-1]:,.0f} tok/s   plain {plainr[-1]:,.0f} tok/s   "
                  f"ratio {titan[-1] / plainr[-1]:.3f}", flush=True)
    finally:
        tr.comm.uninstall()
    mt, mp = statistics.median(titan), statistics.median(plainr)
    paired = statistics.median(a / b for a, b in zip(titan, plainr))
    print(f"model {cfg.spec.name} seq {cfg.seq_len} batch {cfg.global_batch} fp32, world 1 CPU, "
          f"{torch.get_num_threads()} thread(s), {args.rounds} rounds x {args.steps} steps per side")
    print(f"median tokens/s: titan-run {mt:,.1f}   plain PyTorch {mp:,.1f}   (ratio of medians {mt / mp:.3f})")
    print(f"ratio titan/plain = {paired:.3f}   (median of the per-round ratios)", flush=True)
    import torch.distributed as dist
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
