"""titan-run vs TorchTitan 0.3.0 on CPU, side by side: tokens/s per rank, and where each step's time goes.

The work of ``../shared/torchtitan/side_by_side.sh`` (TorchTitan's llama3 debugmodel: dim 256,
6 layers, 16 heads, FFN 768, vocab 2048; seq 512, local batch 2 per rank, fp32, AdamW, no
activation checkpointing, no compile, 2 gloo processes, SDPA causal attention on both sides
through the shim's ``SHIM_SDPA_CAUSAL=1``), for the two layouts of issue 13 (FSDP 2, TP 2), on
one chosen backend per side (default: spmd_types on both).  Runs strictly alternate TorchTitan /
ours (which one goes first flips every round), so drift on a shared machine hits both alike.

Throughput is the wall definition of ``side_by_side_report.py``: TorchTitan's logged ``tps``
(this rank's tokens since the last log over the wall time since then, / tp); ours, the global
tokens of a step over the wall time since the previous step's record (metrics.jsonl ``time``)
/ world size.  A run's figure is the median over steps FROM..N; the ratio of a layout is the
median of the per-round ratios ours/TT (each round's two runs are adjacent in time).  Every
run also records the load average and the cores the rest of the machine used while it ran.
Two figures that other jobs distort less come from a ``sitecustomize`` hook in every worker
(on PYTHONPATH, so neither trainer is modified; it times each optimizer step): the CPU
milliseconds a step costs the rank processes (the work, median over steps, mean over ranks),
and the tokens/s at the lower quartile of rank 0's step wall times (other jobs only ever add
time to a step).  The fast-quartile ratio is printed last.

``--profile`` adds one more run per side and layout under ``torch.profiler`` (steps
PROFILE_START+1 .. PROFILE_START+PROFILE_STEPS, started and stopped by the same hook), and
prints per step: aten ops dispatched (all, and the ones called from outside another aten op),
collectives with their count and elements, copies/casts, allocations, and the top ops by self
CPU time side by side.

    python bench/bench_vs_torchtitan.py --tt-python VENV/bin/python [--work DIR] [--configs fsdp2 tp2]
        [--reps 3] [--steps 20] [--from 4] [--ours-src DIR ...] [--nice -10] [--profile] [--profile-only]

Measured 2026-12-01 on the shared 2-core machine (load1 4-48, the rest of the machine using
0.7-1.6 cores during the runs, so wall figures swing 0.5-3.6x between rounds; CPU ms per step
is the steadier figure), medians of 3 alternating rounds, 20 steps, TorchTitan spmd_types / ours
before (eadc681) / ours after (fused AdamW on CPU, cached spmd step types, async FSDP prefetch):
CPU ms per step FSDP 2 584 / 578 / 566, TP 2 385 / 387 / 379; CPU-work ratio TT/ours before ->
after: FSDP 2 1.014 -> 1.050 (another run 0.941 -> 1.011), TP 2 0.996 -> 1.042 (1.033 -> 1.056).
Per-step profile (rank 0, counts exact, FSDP 2): aten ops TT 6,028 / ours before 7,795 / after
6,447; copies and casts 1,094 / 1,555 / 1,076; all-gathers 17 / 14 / 14 (ours: 13 FSDP + the
metrics gather), reduce-scatters 9 / 7 / 7.

RoPE as one complex multiply (``layers.Rotary``, e445124), measured 2026-12-01 22:35-22:45 (load1
2.4-4.6, the rest of the machine 0.7-0.85 cores: wall figures soft), TorchTitan spmd_types / ours
before / ours after, medians of 3 alternating rounds: CPU ms per step FSDP 2 670 / 673 / 630, TP 2
507 / 434 / 414; CPU-work ratio TT/ours before -> after: FSDP 2 1.025 -> 1.054 (an earlier, more
loaded run 0.974 -> 0.987), TP 2 1.081 -> 1.110 (1.050 -> 1.174).  Wall tokens/s ratios ours/TT after:
FSDP 2 1.235 (rounds 1.069, 1.235, 1.296), TP 2 1.006 (1.006, 1.123, 0.770) -- load-driven swings.
On a quiet machine (22:50-22:57, the rest of the machine 0.00 cores, load1 2.0 = these runs), ours
after / TT: FSDP 2 1,597 / 1,444 tok/s/rank = 1.094x (rounds 1.094, 1.118, 1.071; fast quartile
1.097x; CPU ms per step 607 / 653, 1.045x), TP 2 1,104 / 995 = 1.110x (1.000, 1.110, 1.125; fast
quartile 1.119x; CPU 393 / 427, 1.087x); the session before measured 1.056x / 1.061x quiet.  Quiet
profile of ours, FSDP 2, rank 0, per step (640 ms): mm 260 ms (129 calls), SDPA fwd+bwd 151 ms,
mul 38 ms, copy_ 32 ms (471 calls: FSDP2 copy-in/out and gloo's reduce-scatter input clone), FSDP2
post-backward reduce waits ~50 ms, RoPE (Rotary) fwd+bwd ~6 ms.
Per-step profile after (rank 0, FSDP 2): aten ops TT 6,028 / ours 6,243, copies and casts 1,094 /
1,136; TP 2: aten ops 7,645 / 7,063, copies and casts 1,451 / 1,123, collectives TT 26 all-gathers +
26 reduce-scatters + 38 all-reduces / ours 26 + 26 + 20.  The goal (>= 1.2x) is not met on CPU
work: matmul and SDPA self time are the same on both sides (FSDP 2: mm 370 / 336 ms, SDPA 232 / 192
ms per step in one profiled pair), and what is left differs mostly in FSDP2's own all-gather /
reduce-scatter waits, the same library on both sides.

RMSNorm as an autograd Function (``layers.RMSNormFunction``, f0ca973: keeps its input and rstd, backward by
hand), measured 2026-12-02 01:52-02:02 on a loaded machine (load1 1.6-7.3, the rest of the machine 0.0-1.2
cores, median 0.72: wall ratios swing 0.6-2.0x between rounds, so only the steadier figures are read),
TorchTitan spmd_types / ours before / ours after, medians of 3 alternating rounds: CPU ms per step FSDP 2
666 / 650 / 651, TP 2 489 / 436 / 406; CPU-work ratio TT/ours before -> after: FSDP 2 1.025 -> 1.023, TP 2
1.097 -> 1.114; the one quiet round (TP 2, the rest 0.00 cores) 957 / 1,039 / 1,079 tok/s/rank, after/TT
1.127x (before 1.086x).  Again 02:03-02:11, mostly quiet (the rest of the machine 0.02 cores median, 0.8
at most; TP 2 round 2 loaded), TT / before / after: FSDP 2 1,291 / 1,636 / 1,662 tok/s/rank, after/TT
1.194x (rounds 1.194, 1.093, 1.430; before 1.162x), fast quartile 1.156x (before 1.134x), CPU ms per step
661 / 584 / 577 (CPU-work ratio 1.072 -> 1.109); TP 2 934 / 1,024 / 1,027, after/TT 1.050x (1.222, 0.898,
1.050; before 1.047x), fast quartile 1.054x (1.046x), CPU ms 450 / 422 / 412 (1.054 -> 1.080).  Load-free
figures of the change itself: one norm fwd+bwd at 2 x 512 x 256 fp32,
one thread, 2.44 -> 1.86 ms; the bench's model fwd+bwd in one process, 30 alternating steps with the
same weights: CPU ms min 488 vs 499, lower quartile 505 vs 518 (-2.5%), median 524 vs 528.
Per-step profile (rank 0, FSDP 2, counts exact, times under load): aten ops TT 6,028 / ours 6,204, copies
and casts 1,094 / 1,162, mm calls 114 / 129 -- TorchTitan 0.3.0 projects q, k, v with one fused matmul
(and chunks the loss in 8), but on this CPU a fused [1024, 256] x [256, 768] fwd+bwd is no faster than
three [1024, 256] x [256, 256] (10.3-12.8 vs 9.3-9.6 ms, one thread): not a saving to copy.  gloo's
reduce-scatter is a clone + a full all-reduce + a chunk copy (ProcessGroupGloo::reduce_scatter_tensor_
coalesced); at one block's 3 MB on 2 ranks an in-place all-reduce + chunk copy takes 6.41 ms vs 6.30, the
list reduce_scatter 11.1 ms: no saving there either.  What is left between the sides is FSDP2's own
collective waits (the same library) and load.

gloo point-to-point collectives (``parallel/seq_collectives.py``, docs/torch_on_cpu.md §11: the spmd TP
boundaries' sequence all-gather / reduce-scatter as isend/irecv + a local sum, and FSDP2's gradient
reduce-scatter through ``set_custom_reduce_scatter``; half the bytes of gloo's clone + full all-reduce + chunk
copy) and the vocab-parallel loss as one autograd Function (``parallel/vocab_parallel_loss.py``); losses and
grad norms of 8 steps bitwise unchanged on both layouts.  Profile first (rank 0, TP 2, per step, 04:24, quiet:
the rest of the machine 0.2-0.3 cores), TorchTitan spmd_types / ours before: self CPU 676 / 522 ms, mm 137 / 139
ms (114 / 129 calls), SDPA fwd+bwd 79 / 82 ms, ours' collective waits 118 ms over 108 wait_tensor calls
(reduce-scatter 63 ms / 52, all-gather 40 ms / 26, the FSDP norm-grad redistributes 12 ms / 26; TorchTitan's
inside _ReduceScatterShard / _AllGatherShard 104 / 79 ms self), gloo's reduce-scatter input clone 4.8 ms,
copies/casts 1,149 / 31 ms, the loss's autograd chain (zeros + scatter + add of a [1024, 1024] gradient).  Paired
in-process A/B (the same 2 ranks alternating steps, 20-30 pairs, load 2.7-3.8): TP 2 P2P boundaries wall 473 ->
437 ms per step, CPU 399 -> 369 ms (paired 1.073x / 1.067x); FSDP 2 reduce-scatter wall 670 -> 654 ms, CPU 628
-> 614 (1.035x / 1.024x); loss fwd+bwd at [1024, 1024] per rank 16.7 -> 11.3 ms.  Measured 2026-12-02 04:52-05:11,
TorchTitan spmd_types / ours before (aa64ceb) / ours after (f9648d2), medians of 3 alternating rounds, most
rounds loaded (the rest of the machine up to 0.97 cores): CPU ms per step TP 2 468 / 433 / 385 (04:52 run) and
461 / 422 / 421 (05:03 run, two of its after runs loaded), FSDP 2 660 / 628 / 606; the quiet rounds (the rest of
the machine 0.00-0.02 cores): TP 2 916 / 990 / 1,138 tok/s/rank, after/TT 1.242x (fast quartile 1.229x), and 968
/ 1,059 / 1,214, 1.254x (1.256x; CPU 446 / 405 / 357 ms); FSDP 2 1,485 / 1,650 / 1,735, 1.168x (before 1.111x;
CPU 633 / 588 / 553 ms).  On a fully quiet machine (05:11-05:16, the rest of the machine 0.00-0.01 cores in every
run, load1 1.2-2.0 = these runs), TorchTitan spmd_types / ours after: TP 2 1,060 / 1,266 tok/s/rank, ratio
1.154x (rounds 1.154, 1.203, 1.154), fast quartile 1.139x, CPU ms per step 397 / 342 (CPU-work ratio 1.147);
FSDP 2 1,575 / 1,771, 1.108x (1.088, 1.108, 1.137), fast quartile 1.097x, CPU 593 / 541 (1.079): quiet, TorchTitan
runs faster than in the loaded rounds above, so the goal (>= 1.2x) is not met on either layout.  Quiet profile
after (05:17, rank 0, TP 2, per step): self CPU TorchTitan 498 / ours 428 ms, mm 125 / 121, SDPA fwd+bwd 70 / 71,
copies/casts 1,451 (41 ms) / 1,094 (15 ms), aten ops 7,645 / 6,144; ours' collectives: 52 isend + 52 irecv (12 +
21 ms), the SP Functions' own time (their waits) 71 ms over 52 calls, 26 wait_tensor 14 ms, FSDP's norm-grad
redistributes 4 ms; TorchTitan's _ReduceScatterShard / _AllGatherShard 53 / 45 ms + 38 wait_tensor 35 ms.  Ours
still idles ~60 ms of a 404 ms step (wall minus CPU): the ~75 sync points a step, each a gloo wake-up and
loopback transfer.  Then the TP norms' pending grads in one all-reduce after backward on a one-rank dp axis
(``fsdp.defer_tp_grad_reduction``, 9e49644: FSDP2's 13 blocking post-backward redistributes were 21.5 ms of that
step; paired in-process A/B 752 -> 729 ms, 1.057x): 05:31-05:36, TorchTitan spmd_types / ours, medians of 3
alternating rounds (round 1 and TP 2 round 2 loaded, the rest of the machine up to 0.86 cores), TP 2 1,115 /
1,332 tok/s/rank, ratio 1.208x (rounds 1.988, 1.060, 1.208), fast quartile 1.243x, CPU ms per step 387 / 324
(CPU-work ratio 1.202); the quiet round (0.00 cores): 1,115 / 1,347, 1.208x, fast quartile 1.226x.  FSDP 2 1,574 /
1,756, 1.116x (1.328, 1.109, 1.116), fast quartile 1.117x, CPU 594 / 539 (1.064); quiet round 1.116x.  TP 2 reaches
the goal of 1.2x on this machine, FSDP 2 does not (FSDP2's own all-gather / reduce-scatter schedule on both sides).
Tried and dropped: batching the Partial norm gradients of the grad-norm clip into one
all-reduce (spmd_types TP-only: FSDP2 already reduces them in its post-backward, 13 blocking 256-element
redistributes a step; nothing is Partial at the clip, no change).

FSDP2's all-gather as a direct exchange and its reduce-scatter left in flight (``fsdp.GlooAllGather``, received in
place, no staging copy; ``fsdp.GlooReduceScatter._can_defer``: summed when the next one is posted or in an autograd
final callback; bitwise unchanged), 2026-12-02.  Quiet profile first (07:33, rank 0, FSDP 2, per step, TorchTitan
spmd_types / ours): self CPU 707 / 623 ms, mm 245 / 252 ms (114 / 129 calls), SDPA fwd+bwd 144 / 150, mul 33 / 35,
copy_ 41 (470) / 18 (446), loss log_softmax fwd+bwd 4.5 (8 chunks) / 9.2; TorchTitan's blocking FSDP2 all-gathers
~76 ms (17) and reduce-scatters ~47 ms (9 units); ours' blocking reduce-scatter waits 29 ms (7 units), all-gather
copy-out waits ~15 ms (13, async), gloo's all-gather unflatten 6 ms (24 copies a step of a 426,240-element shard, in
gloo's thread).  Paired in-process A/Bs (the same 2 ranks, variants alternating step by step, wall / process CPU /
training-thread CPU per step, means of the ranks): stock -> direct all-gather CPU 577.7 -> 568.2 ms, thread CPU
531 -> 535 (the sends are socket writes in the training thread now; 20 pairs, load 1.6-3.4); synchronous -> in-flight
reduce-scatter wall paired 1.039 (lower quartile 1.005), CPU 1.000 (20 pairs, load 1.2-2.3); both vs before (30
pairs, load 1.3-2.0): wall 592.5 / 592.7 ms, lower quartile 583.8 -> 572.0, paired 1.005, CPU 559.7 -> 551.3 (1.008).
Quiet profile after (08:11): self CPU 645 / 621 ms; the blocks' reduce-scatters 0.7-2.6 ms each, the wait is now at
the root unit's in FSDP2's final callback (25 ms: embedding + LM head, 1.05 M elements, after the last block's);
isend / irecv 20 + 20 a step, 9.7 + 15.8 ms.  Measured 08:08-08:11 on a quiet machine (the rest of the machine
0.00-0.16 cores, load1 1.7-2.1 = these runs), TorchTitan spmd_types / ours before (98e4dde) / ours after, medians of 3
alternating rounds: FSDP 2 1,606 / 1,791 / 1,801 tok/s/rank, after/TT 1.108x (rounds 1.095, 1.144, 1.108; before
1.102x), fast quartile 1.125x (before 1.101x), CPU ms per step 575 / 543 / 530 (CPU-work ratio 1.050 -> 1.070).  The
goal (>= 1.2x) is not met on FSDP 2: at TorchTitan's 1,606 tok/s it needs 1,927, i.e. 531 ms a step, which is ours'
whole CPU work per step with no idle at all; of that, mm + SDPA + the elementwise ops are ~480 ms, the same kernels on
both sides.  Tried (measured): not resharding the last block after forward (TorchTitan's default): paired
CPU 1.0025 and 1.006 in two A/Bs, wall within the noise here -- kept since a4f2f07 all the same (fsdp.py keep_last),
as it removes an all-gather that nothing hides on a GPU cluster (the last block's, right at the start of backward);
dropped: TorchTitan's FSDP units outside the blocks (the embedding;
norm + LM head) instead of one root unit: paired wall 0.977, CPU 0.985 (slower: three units' FSDP2 overhead; 30
pairs, load 0.7-2.2); the loss's log_softmax in 8 row chunks (TorchTitan chunks its loss): bitwise the same, one
thread fwd+bwd at [1024, 2048] 4.34 -> 4.89 ms (slower).  TP 2 is unchanged by these (its FSDP axis has one rank), 08:16-08:19,
quiet (the rest of the machine 0.00 cores, one round 0.37), TT / before / after: 1,204 / 1,443 / 1,438 tok/s/rank,
after/TT 1.194x (rounds 1.194, 1.276, 1.132; before 1.194x), CPU ms per step 356 / 293 / 295 (CPU-work ratio 1.210);
ours idles ~60 ms of its ~355 ms step there (wall minus CPU: the ~75 blocking TP exchanges a step).  Last, the
fast-quartile ratios of that run: TP 2 after/TT 1.245x (before 1.243x); of the FSDP 2 run above: 1.125x.

After the fused eager loss and the SwiGLU Function (82a634f) and the in-process torchrun agent (7be0fe0; start-up
only, outside the timed steps), measured 2026-12-06 10:55-11:01 on a quiet machine (the rest of the machine
0.00-0.01 cores in every run, load1 1.0-2.2 = these runs), TorchTitan spmd_types / ours, medians of 3 alternating rounds:
FSDP 2 1,601 / 1,779 tok/s/rank, ratio 1.124x (rounds 1.141, 1.124, 1.102), fast quartile 1.115x, CPU ms per step
579 / 543 (CPU-work ratio 1.070); TP 2 1,102 / 1,339, 1.215x (1.261, 1.215, 1.189), fast quartile 1.199x, CPU 389 /
328 (1.186).  A 20-step run's wall time, start-up included: FSDP 2 TorchTitan 24-27 s, ours 17-18 s; TP 2
20-21 s, 13-14 s.  TP 2 meets the goal (>= 1.2x) on tokens/s; FSDP 2 does not.

The rebuilt FFN input (executor/models/layers.py ``rebuilt_input``: the down projection keeps no copy of the SwiGLU
product, which backward makes again; on for eager blocks without recompute, as here) trades work for memory: one
elementwise SwiGLU more per FFN backward.  Measured 2026-12-06 17:52-17:55 with ``--ours-src`` before (9a9097c) and
after in the same alternation, quiet (the rest of the machine 0.00 cores), FSDP 2, medians of 3 rounds: TorchTitan /
before / after CPU ms per step 621 / 589 / 594, ratio to TorchTitan 1.096x / 1.067x (rounds 1.096, 1.126, 1.085 /
1.067, 1.110, 1.048): about 2.5% of this tiny model's step (llama3-debug's FFN is 768 wide on one CPU thread, where
elementwise passes cost as much as its matmuls), for one [tokens, 768] fp32 tensor per block less (bench_memory_vs_model:
FSDP 2 101.0 -> 92.0 MiB).  On the 405B layout the cost model gives the pass 0.3% of the step (11.712 -> 11.747 s)
for 13.4 GiB per GPU less (91.3 -> 77.8 GiB).

``--tt-python`` is an interpreter with torchtitan 0.3.0 (no deps) and spmd_types 0.2.3 (its
pin), torch 2.14.1; e.g. ``python -m venv --system-site-packages V && V/bin/pip install --no-deps
torchtitan==0.3.0 spmd_types==0.2.3 && V/bin/pip install torchdata torch_checkpointing
'datasets<4.8' tyro tensorboard einops``.  Ours runs with this interpreter and each
``--ours-src`` checkout first on PYTHONPATH (default: this checkout; give two to compare a
before and an after in the same alternation).  Prints each run, the table, and the ratio last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_TT = ROOT.parent / "shared" / "torchtitan"
LAYOUTS = {"fsdp2": (2, 1), "tp2": (1, 2)}         # (dp_shard, tp), 2 ranks each
LOCAL_BATCH, SEQ = 2, 512
TT_BACKENDS = {"spmd_types": "spmd_types", "dtensor": "partial_dtensor"}
STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+).*?tps:\s*([\d,]+)")

# Installed (as sitecustomize.py, on PYTHONPATH) in the worker processes of a --profile run: the
# profiler starts after optimizer step START and stops after step START+N; each rank writes its events.
PROFILE_HOOK = textwrap.dedent('''
    import os
    _out = os.environ.get("BVT_HOOK_OUT")
    if _out and os.environ.get("LOCAL_RANK") is not None:
        import json
        import time
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _prof_spec = os.environ.get("BVT_PROFILE")
        _start, _n = (int(x) for x in _prof_spec.split(":")) if _prof_spec else (-1, 0)
        _state = {"steps": 0, "prof": None, "opt": None, "times": []}

        def _dump(prof):
            rows = []
            for e in prof.events():
                parent = e.cpu_parent
                rows.append([e.name, e.self_cpu_time_total, e.cpu_time_total,
                             parent.name if parent is not None else None,
                             [list(s) for s in (e.input_shapes or []) if isinstance(s, (list, tuple))]])
            with open(os.path.join(_out, "profile_rank%s.json" % os.environ["RANK"]), "w") as f:
                json.dump({"steps": _n, "events": rows}, f)

        def _hook(opt, args, kwargs):
            # one count per training step: TorchTitan's OptimizersContainer is an Optimizer that steps
            # its inner AdamW, so the global hook fires twice a step there; count the first optimizer only
            if _state["opt"] is None:
                _state["opt"] = id(opt)
            if id(opt) != _state["opt"]:
                return
            _state["steps"] += 1
            s = _state["steps"]
            # this process's CPU seconds (all its threads) and wall seconds at the end of each optimizer step
            _state["times"].append((s, time.process_time(), time.perf_counter()))
            with open(os.path.join(_out, "steps_rank%s.json" % os.environ["RANK"]), "w") as f:
                json.dump(_state["times"], f)
            if s == _start:
                _state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                        record_shapes=True)
                _state["prof"].__enter__()
            elif s == _start + _n and _state["prof"] is not None:
                prof, _state["prof"] = _state["prof"], None
                prof.__exit__(None, None, None)
                _dump(prof)

        register_optimizer_step_post_hook(_hook)
''')


# --------------------------------------------------------------------------- machine load
def _busy_jiffies() -> tuple[int, int]:
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    v = [int(x) for x in f]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def run_measured(cmd: list[str], env: dict, cwd: Path, log: Path, timeout: int) -> dict:
    """Run `cmd`; wall seconds, load average at the start, and cores the rest of the machine used meanwhile."""
    load0 = os.getloadavg()[0]
    busy0, _ = _busy_jiffies()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    wall = time.perf_counter() - t0
    busy1, _ = _busy_jiffies()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    hz = os.sysconf("SC_CLK_TCK")
    own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    other = max(0.0, (busy1 - busy0) / hz - own)
    return {"rc": rc, "wall_s": wall, "load1": load0, "other_cores": other / wall if wall > 0 else None}


# --------------------------------------------------------------------------- the two sides
def tt_cmd(a, cfg: str, out: Path) -> tuple[list[str], dict]:
    dp, tp = LAYOUTS[cfg]
    data = a.work / "data"
    cmd = [a.tt_python, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint=localhost:0", "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
           str(a.shim), "--module", "llama3", "--config", "llama3_debugmodel",
           "--hf-assets-path", str(data / "tokenizer"), "--dataloader.dataset", "c4_test",
           "--dataloader.dataset-path", str(data / "corpus"), "--training.steps", str(a.steps),
           "--training.local-batch-size", str(LOCAL_BATCH), "--training.seq-len", str(SEQ),
           "--training.mixed-precision-param", "float32", "--parallelism.spmd-backend", TT_BACKENDS[a.tt],
           "--parallelism.data-parallel-shard-degree", str(dp), "--parallelism.tensor-parallel-degree", str(tp),
           "--debug.seed", "0", "--validator.no-enable", "--checkpoint.no-enable",
           "--metrics.disable-color-printing", "--dump-folder", str(out / "out"), "activation-checkpoint:none"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SHIM_SDPA_CAUSAL="1", SHIM_GLOO_SUM="1", OMP_NUM_THREADS="1")
    return cmd, env


def write_plan(a, cfg: str) -> Path:
    dp, tp = LAYOUTS[cfg]
    data = a.work / "data"
    path = a.work / "plans" / f"{cfg}_{a.ours}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(f"""\
        model: {SHARED_TT / 'llama3-tt-debugmodel.yaml'}
        workload: {{seq_len: {SEQ}, global_batch: {LOCAL_BATCH * dp}}}
        plan: {{dp_replicate: 1, dp_shard: {dp}, pp: 1, tp: {tp}, cp: 1, ep: 1, microbatch: {LOCAL_BATCH},
               n_microbatches: 1, ac: none, reshard_after_forward: true, compile: false, float8: false,
               backend: {a.ours}}}
        train: {{lr: 8.0e-4, warmup: 2, min_lr_ratio: 0.0, weight_decay: 0.1, beta1: 0.9, beta2: 0.95,
                eps: 1.0e-8, grad_clip: 1.0, seed: 0, dtype: fp32, profile_step: 0, tensorboard: false,
                data: {data / 'corpus' / 'data.jsonl'}, tokenizer: {data / 'tokenizer' / 'tokenizer.json'}}}
        """))
    return path


def ours_cmd(a, cfg: str, src: Path, out: Path) -> tuple[list[str], dict]:
    cmd = [a.ours_python, "-m", "executor.cli", "--plan", str(write_plan(a, cfg)), "--nproc-per-node", "2",
           "--steps", str(a.steps), "--run-dir", str(out / "run")]
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    return cmd, env


def parse_tt(out: Path, lo: int) -> tuple[float | None, int]:
    steps = {}
    for line in (out / "log.txt").read_text(errors="replace").splitlines():
        m = STEP_RE.search(line)
        if m and "[rank1]" not in line and int(m.group(1)) not in steps:
            steps[int(m.group(1))] = float(m.group(3).replace(",", ""))
    tps = [v for k, v in steps.items() if k >= lo]
    return (statistics.median(tps) if tps else None), len(steps)


def parse_ours(out: Path, lo: int) -> tuple[float | None, int]:
    path = out / "run" / "metrics.jsonl"
    if not path.exists():
        return None, 0
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    tps, prev = [], None
    for r in recs:
        if prev is not None and r["step"] >= lo:
            tps.append(r["tokens_per_s"] * r["step_time_s"] / (r["time"] - prev) / 2)
        prev = r["time"]
    return (statistics.median(tps) if tps else None), len(recs)


def cpu_ms_per_step(out: Path, lo: int) -> float | None:
    """Median over steps lo..N of the CPU milliseconds the rank processes spent per step (mean over ranks):
    the work a step costs, which other jobs on the machine do not inflate (wall time they do)."""
    per_rank = []
    for f in sorted(out.glob("steps_rank*.json")):
        t = json.loads(f.read_text())
        d = [(b[1] - a_[1]) * 1e3 for a_, b in zip(t, t[1:]) if b[0] >= lo]
        if d:
            per_rank.append(statistics.median(d))
    return statistics.mean(per_rank) if per_rank else None


def fast_quartile_tps(out: Path, lo: int, cfg: str) -> float | None:
    """Tokens/s per rank at the lower quartile of rank 0's step wall times (steps lo..N, timed between
    optimizer steps by the hook, the same definition on both sides).  Other jobs only ever add time to a
    step, so on a shared machine the fast steps are the closest to what the trainer itself costs."""
    f = out / "steps_rank0.json"
    if not f.exists():
        return None
    t = json.loads(f.read_text())
    d = sorted(b[2] - a_[2] for a_, b in zip(t, t[1:]) if b[0] >= lo)
    if len(d) < 4:
        return None
    dp, _ = LAYOUTS[cfg]
    return LOCAL_BATCH * SEQ * dp / 2 / statistics.quantiles(d, n=4)[0]


def one_run(a, side: str, cfg: str, label: str, src: Path | None, tag: str, profile: bool = False):
    out = a.runs / f"{cfg}.{label}.{tag}"
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = tt_cmd(a, cfg, out) if side == "tt" else ours_cmd(a, cfg, src, out)
    hook_dir = a.work / "step_hook"
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(PROFILE_HOOK)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir), env.get("PYTHONPATH")) if p)
    env["BVT_HOOK_OUT"] = str(out)
    if profile:
        env["BVT_PROFILE"] = f"{a.profile_start}:{a.profile_steps}"
    if a.nice:
        cmd = ["nice", "-n", str(a.nice), *cmd]
    m = run_measured(cmd, env, out, out / "log.txt", a.timeout)
    tps, n = parse_tt(out, a.from_step) if side == "tt" else parse_ours(out, a.from_step)
    m.update(cfg=cfg, label=label, tps=tps, steps=n, dir=str(out), cpu_ms=cpu_ms_per_step(out, a.from_step),
             fast=fast_quartile_tps(out, a.from_step, cfg))
    ok = m["rc"] == 0 and tps is not None and m["fast"] is not None and m["cpu_ms"] is not None
    print(f"  {cfg:6s} {label:22s} {tag:>4s}: "
          + (f"{tps:8,.0f} tok/s/rank (fast quartile {m['fast']:6,.0f}), {m['cpu_ms']:6.0f} CPU ms/step" if ok
             else f"FAILED (rc {m['rc']}, {out / 'log.txt'})")
          + f"   ({n} steps, {m['wall_s']:.0f} s, load1 {m['load1']:.2f}, "
          f"other cores {m['other_cores']:.2f})", flush=True)
    return m if ok else None


# --------------------------------------------------------------------------- the profile
COLLECTIVE = re.compile(r"^(c10d::|c10d_functional::|_c10d_functional::)")
COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to", "aten::cat",
            "aten::_foreach_copy_", "aten::split_with_sizes_copy", "aten::chunk_cat")
ALLOC_OPS = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zeros_like",
             "aten::new_empty", "aten::new_zeros", "aten::new_empty_strided", "aten::full", "aten::ones_like")


def summarize_profile(path: Path) -> dict:
    d = json.loads(path.read_text())
    n = d["steps"]
    ops: dict[str, list] = {}      # name -> [count, self_us, total_us]
    coll: dict[str, list] = {}     # name -> [count, elements]
    aten_all = aten_outer = 0
    step_us = 0.0
    for name, self_us, total_us, parent, shapes in d["events"]:
        o = ops.setdefault(name, [0, 0.0, 0.0])
        o[0] += 1
        o[1] += self_us
        o[2] += total_us
        step_us += self_us
        if name.startswith("aten::"):
            aten_all += 1
            if parent is None or not parent.startswith("aten::"):
                aten_outer += 1
        if COLLECTIVE.match(name) and not (parent and COLLECTIVE.match(parent)):
            c = coll.setdefault(name, [0, 0])
            c[0] += 1
            numels = [eval_numel(s) for s in shapes]
            c[1] += max(numels, default=0)
    per = lambda x: x / n       # noqa: E731
    return {"steps": n, "self_ms": per(step_us) / 1e3, "aten_all": per(aten_all), "aten_outer": per(aten_outer),
            "ops": {k: (per(c), per(s) / 1e3, per(t) / 1e3) for k, (c, s, t) in ops.items()},
            "coll": {k: (per(c), per(e)) for k, (c, e) in coll.items()},
            "copies": (sum(per(ops[k][0]) for k in COPY_OPS if k in ops),
                       sum(per(ops[k][1]) / 1e3 for k in COPY_OPS if k in ops)),
            "allocs": (sum(per(ops[k][0]) for k in ALLOC_OPS if k in ops),
                       sum(per(ops[k][1]) / 1e3 for k in ALLOC_OPS if k in ops))}


def eval_numel(shape) -> int:
    n = 1
    for s in shape:
        if not isinstance(s, int):
            return 0
        n *= s
    return n


def print_profile(cfg: str, sides: dict[str, dict], top: int) -> None:
    labels = list(sides)
    print(f"\n== profile {cfg} (rank 0, per step, {sides[labels[0]]['steps']} steps under torch.profiler) ==")
    for lab in labels:
        s = sides[lab]
        print(f"{lab:22s}: self CPU {s['self_ms']:8.1f} ms/step | aten ops {s['aten_all']:7.0f} "
              f"(outermost {s['aten_outer']:6.0f}) | copies/casts {s['copies'][0]:5.0f} ({s['copies'][1]:6.1f} ms) | "
              f"allocations {s['allocs'][0]:5.0f} ({s['allocs'][1]:5.1f} ms)")
        for k, (c, e) in sorted(s["coll"].items()):
            print(f"{'':24s}{k:45s} x{c:5.1f}/step  {e / 1e6:7.3f} M elements/step")
    names = sorted({k for s in sides.values() for k in s["ops"]},
                   key=lambda k: -max(s["ops"].get(k, (0, 0, 0))[1] for s in sides.values()))[:top]
    head = "".join(f" | {lab[:20]:>20s} ms   n" for lab in labels)
    print(f"{'op (self CPU per step)':48s}{head}")
    for k in names:
        row = "".join(f" | {s['ops'].get(k, (0, 0, 0))[1]:23.2f} {s['ops'].get(k, (0, 0, 0))[0]:4.0f}"
                      for s in sides.values())
        print(f"{k[:48]:48s}{row}")


# --------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tt-python", required=True, help="interpreter with torchtitan 0.3.0 and spmd_types 0.2.3")
    ap.add_argument("--ours-python", default=sys.executable)
    ap.add_argument("--ours-src", type=Path, action="append",
                    help="checkout(s) of this project to run (default: this one)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_vs_torchtitan")
    ap.add_argument("--shim", type=Path, default=SHARED_TT / "torchtitan_cpu_shim.py")
    ap.add_argument("--configs", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--ours", default="spmd_types", choices=("spmd_types", "dtensor"))
    ap.add_argument("--tt", default="spmd_types", choices=list(TT_BACKENDS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--from", dest="from_step", type=int, default=4, help="first step in a run's median")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--nice", type=int, default=0,
                    help="run both sides at this niceness (negative: ahead of other jobs, needs root) so that a "
                         "shared machine's scheduler weighs less in the figures; the same for every run")
    ap.add_argument("--profile", action="store_true", help="also one profiled run per side and layout")
    ap.add_argument("--profile-only", action="store_true")
    ap.add_argument("--profile-start", type=int, default=4)
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    srcs = [p.resolve() for p in (a.ours_src or [ROOT])]
    a.work = a.work.resolve()
    a.runs = a.work / "runs" / time.strftime("%Y%m%d-%H%M%S")
    a.runs.mkdir(parents=True, exist_ok=True)
    if not (a.work / "data" / "tokenizer" / "tokenizer.json").exists():
        subprocess.run([a.tt_python, str(SHARED_TT / "make_data.py"), str(a.work / "data")], check=True)
    labels = {f"ours {a.ours}" + (f" [{p.name}]" if len(srcs) > 1 else ""): p for p in srcs}
    tt_label = f"TT {a.tt}"
    print(f"bench_vs_torchtitan: runs in {a.runs}; uptime: {Path('/proc/loadavg').read_text().strip()}; "
          f"{os.cpu_count()} cores; niceness of every run {a.nice}", flush=True)

    results: list[dict] = []
    rounds: dict[str, list[dict]] = {c: [] for c in a.configs}
    for rep in range(1, 0 if a.profile_only else a.reps + 1):
        for cfg in a.configs:
            order = [(tt_label, "tt", None)] + [(lab, "ours", src) for lab, src in labels.items()]
            if rep % 2 == 0:
                order.reverse()
            rnd = {}
            for lab, side, src in order:
                m = one_run(a, side, cfg, lab.replace(" ", "_").replace("[", "").replace("]", ""), src, str(rep))
                if m is not None:
                    m["label"] = lab
                    results.append(m)
                    rnd[lab] = m
            rounds[cfg].append(rnd)

    if a.profile or a.profile_only:
        for cfg in a.configs:
            sides = {}
            for lab, side, src in [(tt_label, "tt", None)] + [(lab, "ours", src) for lab, src in labels.items()]:
                name = lab.replace(" ", "_").replace("[", "").replace("]", "")
                one_run(a, side, cfg, name, src, "prof", profile=True)
                pfile = a.runs / f"{cfg}.{name}.prof" / "profile_rank0.json"
                if pfile.exists():
                    sides[lab] = summarize_profile(pfile)
            if sides:
                print_profile(cfg, sides, a.top)

    if not results:
        return
    print(f"\n== tokens/s per rank (median over steps {a.from_step}..{a.steps}, then over runs) ==")
    loads = [m["other_cores"] for m in results if m["other_cores"] is not None]
    print(f"machine: {os.cpu_count()} cores; the rest of the machine used {statistics.median(loads):.2f} cores "
          f"(median over runs, max {max(loads):.2f}); "
          f"load1 median {statistics.median(m['load1'] for m in results):.2f}")
    for cfg in a.configs:
        for lab in [tt_label, *labels]:
            ms = [m for m in results if m["cfg"] == cfg and m["label"] == lab]
            if ms:
                cpu = [m["cpu_ms"] for m in ms if m["cpu_ms"] is not None]
                print(f"  {cfg:6s} {lab:28s} {statistics.median(m['tps'] for m in ms):8,.0f} tok/s/rank   "
                      f"fast quartile {statistics.median(m['fast'] for m in ms):6,.0f}   "
                      f"{statistics.median(cpu) if cpu else float('nan'):6.0f} CPU ms/step   runs: "
                      + ", ".join(f"{m['tps']:,.0f}" for m in ms))
    print()
    for cfg in a.configs:
        for lab in labels:
            both = [r for r in rounds[cfg] if lab in r and tt_label in r]
            cpu = [r[tt_label]["cpu_ms"] / r[lab]["cpu_ms"] for r in both
                   if r[lab]["cpu_ms"] and r[tt_label]["cpu_ms"]]
            if cpu:
                print(f"CPU work {cfg} {tt_label} / {lab} = {statistics.median(cpu):.3f}   (CPU ms per step, "
                      f"median of {len(cpu)} rounds; > 1: ours does less work per step)")
    for cfg in a.configs:
        for lab in labels:
            pairs = [r[lab]["tps"] / r[tt_label]["tps"] for r in rounds[cfg] if lab in r and tt_label in r]
            if pairs:
                print(f"ratio {cfg} {lab} / {tt_label} = {statistics.median(pairs):.3f}   "
                      f"(tokens/s, median of {len(pairs)} alternating rounds: "
                      + ", ".join(f"{p:.3f}" for p in pairs) + ")")
    for cfg in a.configs:      # last: the figure other jobs distort least
        for lab in labels:
            pairs = [r[lab]["fast"] / r[tt_label]["fast"] for r in rounds[cfg] if lab in r and tt_label in r]
            if pairs:
                print(f"ratio {cfg} {lab} / {tt_label} at the fast-quartile steps = {statistics.median(pairs):.3f}"
                      f"   (median of {len(pairs)} alternating rounds: " + ", ".join(f"{p:.3f}" for p in pairs) + ")")


if __name__ == "__main__":
    main()
