"""Pipeline memory per micro-batch: titan-run's measured peak against the cost model, per schedule and rank.

For each schedule (1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV; pp 2, two stages per rank where the
schedule has several) real 2-process `titan-run` runs (gloo, llama3-debug, fp32, seq 256, micro-batch 1)
at two micro-batch counts measure each rank's peak (CPU: the profiled step's allocations, see
executor/cpu_memory.py).  The peak's growth per micro-batch, in residual-width tensors ([seq, dim] of the
micro-batch), is what the pipeline keeps per micro-batch beyond the bounded in-flight set: the sends a
multi-stage schedule's runtime holds to the end of the step and, with ``pp_recv_buffers: persistent``,
torch's receive buffers.  The same growth from `cost_models.memory` (titan-run's workload, ``auto``) is
printed next to it, and last the largest difference over schedules and ranks.

    python bench/bench_pp_recv_memory.py [--n-mb 8,16] [--profile-step 2]

Measured 2026-12-03 (profile step 1, 8 and 16 micro-batches; the same slopes at step 2): growth per
micro-batch 1F1B 0 / 0, Interleaved1F1B 3 / 3, ZBVZeroBubble and DualPipeV 2 / 2 (rank 0 / rank 1),
equal to the model's on every row; before titan-run dropped its receive buffers (torch's persistent
ones), the same runs with the buffers inside the profiled step grew 1 / 1, 6 / 6, 4 / 6 and 4 / 6, and
the Interleaved1F1B peak at 16 micro-batches was 61.5 / 52.4 MiB against 50.2 / 41.4 MiB now.

Measured 2026-12-06 after titan-run lets a sent stage output go once its gradient is back (``pp_sent_tensors:
outputs_released``, executor/parallel/pipeline.py; profile step 2, 8 and 16 micro-batches): growth per micro-batch
1F1B 0 / 0, Interleaved1F1B 1 / 2 (was 3 / 3), ZBVZeroBubble 1 / 1 and DualPipeV 1 / 1 (were 2 / 2), equal to the
model's on every row ("largest |measured - model| growth per micro-batch: 0.00 residual tensors"); peaks at 16
micro-batches, ranks 0 / 1, MiB: Interleaved1F1B 56.47 / 50.39 -> 49.97 / 46.89, ZBVZeroBubble 54.44 / 52.14 ->
51.19 / 48.39, DualPipeV 55.48 / 50.47 -> 52.48 / 46.97.

Measured 2026-12-07 after titan-run also lets a sent input gradient go at the point of the schedule's program where
the peer's next message shows the peer has used it (``pp_sent_tensors: released``, executor/parallel/
pipeline_sends.py; profile step 2, 8 and 16 micro-batches): growth per micro-batch 0 / 0 on every schedule (was
Interleaved1F1B 1 / 2, ZBVZeroBubble 1 / 1, DualPipeV 1 / 1), equal to the model's; peaks at 16 micro-batches,
ranks 0 / 1, MiB, measured (model): 1F1B 42.37 / 35.82 (42.30 / 35.29), Interleaved1F1B 46.72 / 40.39 (46.81 /
39.42; was 49.97 / 46.89 measured), ZBVZeroBubble 47.94 / 44.89 (47.56 / 44.05; was 51.19 / 48.39), DualPipeV
49.23 / 43.97 (48.19 / 44.81; was 52.48 / 46.97).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models.coefficients import Coefficients  # noqa: E402
from cost_models.memory import memory_by_rank  # noqa: E402
from cost_models.specs import load_model  # noqa: E402
from cost_models.workload import Workload  # noqa: E402
from search_spaces.plan import Plan  # noqa: E402
from search_spaces.table import CandidateTable  # noqa: E402
from tests.distributed.harness import run_titan  # noqa: E402

SEQ = 256
RESID = 4.0 * 256 * SEQ            # fp32 [seq, dim] of llama3-debug (dim 256), micro-batch 1
SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2))


def _plan(schedule: str, v: int, n_mb: int) -> Plan:
    return Plan(pp=2, schedule=schedule, stages_per_rank=v, microbatch=1, n_microbatches=n_mb)


def measured(schedule: str, v: int, n_mb: int, profile_step: int) -> list[float]:
    """Each rank's profiled peak (bytes) of a real titan-run run."""
    run = run_titan(_plan(schedule, v, n_mb), nproc=2, seq_len=SEQ, steps=profile_step + 1,
                    train={"profile_step": profile_step})
    return [float(p) for p in run.metrics[profile_step - 1]["peak_memory_bytes"]]


def modelled(schedule: str, v: int, n_mb: int, total: bool = False, **keys) -> list[float]:
    """The cost model's activation bytes (`total`: every term's) of pipeline ranks 0 and 1 (first, last) for the
    same run (further workload `keys`, e.g. ``pp_recv_buffers="persistent"``)."""
    table = CandidateTable.from_plans([_plan(schedule, v, n_mb)])
    wl = Workload(seq_len=SEQ, global_batch=n_mb, dtype="fp32", **keys)
    per_rank = memory_by_rank(table, load_model("llama3-debug"), wl, Coefficients(), caching_allocator=False)
    if total:
        return [sum(float(t[0]) for t in per_rank[r].values()) for r in ("first", "last")]
    return [float(per_rank["first"]["activations"][0]), float(per_rank["last"]["activations"][0])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-mb", default="8,16", help="two micro-batch counts (default 8,16)")
    ap.add_argument("--profile-step", type=int, default=2, help="the profiled step (default 2)")
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.n_mb.split(","))
    worst = 0.0
    worst_pct = 0.0
    print(f"{'schedule':16s} {'rank':>4s} {'peak lo':>9s} {'peak hi':>9s} {'model hi':>9s} {'measured/mb':>12s} "
          f"{'model/mb':>9s}")
    for schedule, v in SCHEDULES:
        m_lo, m_hi = measured(schedule, v, lo, a.profile_step), measured(schedule, v, hi, a.profile_step)
        c_lo, c_hi = modelled(schedule, v, lo), modelled(schedule, v, hi)
        peak_hi = modelled(schedule, v, hi, total=True)
        for r in range(2):
            got = (m_hi[r] - m_lo[r]) / (hi - lo) / RESID
            want = (c_hi[r] - c_lo[r]) / (hi - lo) / RESID
            worst = max(worst, abs(got - want))
            worst_pct = max(worst_pct, abs(peak_hi[r] - m_hi[r]) / m_hi[r] * 100)
            print(f"{schedule:16s} {r:4d} {m_lo[r] / 2**20:8.2f}M {m_hi[r] / 2**20:8.2f}M {peak_hi[r] / 2**20:8.2f}M "
                  f"{got:12.2f} {want:9.2f}", flush=True)
    print(f"largest |model - measured| peak at {hi} micro-batches: {worst_pct:.1f}%")
    print(f"largest |measured - model| growth per micro-batch: {worst:.2f} residual tensors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
