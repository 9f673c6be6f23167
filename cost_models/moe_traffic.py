"""Expert-parallel all-to-all traffic per optimizer step, as the step-time model counts it.

`step_time.stage_times` charges each MoE block, per micro-batch and direction,
one dispatch and one combine all-to-all (Lepikhin et al. 2020, GShard,
arXiv:2006.16668 Sec. 3.2) in which every EP rank sends

    a2a_bytes = tokens / sp * top_k * dim * elt * ep_imbalance    (time; bytes sent: below)

(tokens = microbatch * seq_len / cp; sp = tp under sequence parallel; the
self-addressed 1/ep share is included, as in `comm.all_to_all_time`): 2 such
all-to-alls forward, 2 backward, and 2 more under full activation
checkpointing (the recomputed forward).  Charging the imbalance to every
all-to-all is right for the *time*: with full-duplex links an all-to-all
lasts as long as the busiest rank's larger direction, and the busiest rank
(its experts get ``ep_imbalance`` x the mean tokens) receives that much in
dispatch and sends it in combine.

What one rank *sends* is another matter (this module's figure): with
``base = tokens / sp * top_k * dim * elt``, the busiest rank sends

* dispatch: its own routed tokens, ``base`` -- every rank sends exactly its
  tokens x top_k rows, however they are routed;
* combine: the results of the rows it received, ``ep_imbalance * base``;
* backward: the reverse routes (dispatch-backward sends what dispatch
  received, ``ep_imbalance * base``; combine-backward what combine received,
  ``base``);

so ``(1 + ep_imbalance) / 2 * base`` per all-to-all on average, not
``ep_imbalance * base`` (measured with bench/bench_moe.py: the busiest rank
sent 6.72 MiB per step where ``ep_imbalance * base`` predicted 8.50 MiB).  This module exposes that volume so a
measured run (the executor's ``summary.json`` ``moe.all_to_all_bytes_per_step``:
bytes one rank sends in dispatch + combine, forward and backward) can be
checked against it; `step_time.py` itself stays the one place the *time* is
computed.
"""
from __future__ import annotations

import numpy as np

from .layout import layer_mix


def ep_all_to_all_bytes(table, model, workload, coeffs) -> np.ndarray:
    """[n] bytes the busiest EP rank (of the most MoE-heavy pipeline rank) sends in all-to-alls per
    optimizer step; with ``coeffs.ep_imbalance == 1`` every EP rank sends that much."""
    if not model.is_moe:
        return np.zeros(len(table))
    elt = 4.0 if workload.dtype == "fp32" else 2.0
    tokens = table.microbatch * float(workload.seq_len) / table.cp
    sp = table.tp if workload.sequence_parallel else np.ones(len(table))
    # one all-to-all of one block, averaged over dispatch/combine (see above): own tokens out in
    # dispatch, ep_imbalance x as many back in combine
    one = tokens / sp * model.top_k * model.dim * elt * (1.0 + coeffs.ep_imbalance) / 2.0
    _, n_moe = layer_mix(table, model, first=False)
    passes = 4.0 + 2.0 * table.is_ac("full")          # dispatch + combine: forward, backward, recompute
    return np.where(table.ep > 1, n_moe * table.n_microbatches * passes * one, 0.0)


__all__ = ["ep_all_to_all_bytes"]
