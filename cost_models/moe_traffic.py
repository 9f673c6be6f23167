"""Expert-parallel all-to-all traffic per optimizer step, as the step-time model counts it.

`step_time.stage_times` charges each MoE block, per micro-batch and direction,
one dispatch and one combine all-to-all (Lepikhin et al. 2020, GShard,
arXiv:2006.16668 Sec. 3.2) in which every EP rank sends

    a2a_bytes = tokens / sp * top_k * dim * elt * ep_imbalance

(tokens = microbatch * seq_len / cp; sp = tp under sequence parallel; the
self-addressed 1/ep share is included, as in `comm.all_to_all_time`): 2 such
all-to-alls forward, 2 backward, and 2 more under full activation
checkpointing (the recomputed forward).  This module exposes that volume so a
measured run (the executor's ``summary.json`` ``moe.all_to_all_bytes_per_step``:
bytes one rank sends in dispatch + combine, forward and backward) can be
checked against it; `step_time.py` itself stays the one place the *time* is
computed.
"""
from __future__ import annotations

import numpy as np

from .memory import layer_mix


def ep_all_to_all_bytes(table, model, workload, coeffs) -> np.ndarray:
    """[n] bytes one EP rank of the most MoE-heavy pipeline rank sends in all-to-alls per optimizer step."""
    if not model.is_moe:
        return np.zeros(len(table))
    elt = 4.0 if workload.dtype == "fp32" else 2.0
    tokens = table.microbatch * float(workload.seq_len) / table.cp
    sp = table.tp if workload.sequence_parallel else np.ones(len(table))
    one = tokens / sp * model.top_k * model.dim * elt * coeffs.ep_imbalance   # one all-to-all, one block
    _, n_moe = layer_mix(table, model, first=False)
    passes = 4.0 + 2.0 * table.is_ac("full")          # dispatch + combine: forward, backward, recompute
    return np.where(table.ep > 1, n_moe * table.n_microbatches * passes * one, 0.0)


__all__ = ["ep_all_to_all_bytes"]
