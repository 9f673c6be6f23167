"""FakeTensor memory estimate of one training step of one rank, for ``titan-run --dry-run --memory``.

Runs inside the dry run's fake process group (one process, no communication):
the rank's (already split and parallelized, still meta) stage modules are
materialized as FakeTensors and one optimizer step is executed under torch's
FSDP-aware memory tracker (``torch.distributed._tools.fsdp2_mem_tracker``).
The second of two steps is measured (AdamW states exist by then).

The step is the one of the backend the stages were built for (``dry_run.py`` resolves it as a
real run does): under spmd_types TP the loss is the vocab-parallel cross-entropy of the local
logits, under dtensor TP DTensor's loss parallel.

What is modelled, by layout:

* ``pp == 1``: the executor's gradient accumulation -- ``n_microbatches``
  times forward then backward of one micro-batch ``[microbatch, seq/cp]``.
* ``pp > 1``: a real schedule needs send/recv between ranks, which the fake
  process group cannot carry, so the step is *replayed* locally: the schedule
  object the executor builds (``parallel.pipeline.build_schedule``, the same
  torch class, stages and FSDP settings) gives this rank's own action order
  (``schedule.pipeline_order[pp_rank]``: F, B, I, W, OVERLAP_F_B, REDUCE_GRAD),
  and each action runs on this rank's stage module: F on FakeTensor inputs
  (tokens for stage 0, hidden states ``[microbatch, seq/cp/tp, dim]`` in the
  compute dtype for the others; the last stage also computes the loss), B as a
  full backward with a FakeTensor output gradient, I as the gradient of the
  stage input only with the graph retained (torch's ``stage_backward_input``)
  and W as the rest of the backward, which releases the graph.  So exactly as many micro-batches' activations are
  alive at each moment as the torch schedule keeps on this rank.  FSDP runs
  as under the schedule: no gradient sync or reshard-after-backward until
  REDUCE_GRAD, and the V schedules' reshard_after_forward=False.  Each
  received tensor is allocated per micro-batch and dropped after its use, as
  titan-run's stages receive (executor/parallel/pipeline.py).  Not
  modelled: the time order across ranks (a rank never waits with extra
  activations alive beyond its own schedule).
* ``cp > 1``: the ring attention (``parallel/ring_attention.py``) sees
  FakeTensors and skips the p2p exchange (the local K/V stand in for the remote
  ones) but still allocates every receive buffer and the fp32 out/LSE/dK/dV
  accumulators, so the estimate covers the ring's buffers with the local shard
  shapes (sequence ``seq/cp``, head-tail positions of this CP rank).
* MoE: the routing is balanced (each expert gets ``tokens * top_k / E``, the
  analytic model's assumption) and the integers that size the experts' buffers
  and the expert-parallel all-to-all carry real values through the fake step
  (``dry_run_routing.py``); the rest of the MoE code runs as in a real step.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import _sharding_prop
from torch.distributed.fsdp import FSDPModule, fully_shard

import spmd_types as spmd

from cost_models.memory import in_flight_microbatches
from search_spaces.table import CandidateTable

from .dry_run_routing import balanced_routing
from .parallel.context_parallel import head_tail_indices
from .parallel.pipeline import build_schedule, fsdp_microbatch_backward_settings
from .parallel.spmd_step import spmd_mesh
from .parallel.spmd_tensor_parallel import vocab_parallel_cross_entropy
from .parallel.tensor_parallel import cross_entropy, loss_kind, loss_parallel, set_loss
from .train import build_optimizer

__all__ = ["fake_step_peak", "rank_actions"]


def rank_actions(plan, stages, schedule=None, pp_rank: int = 0) -> list[tuple[str, int, int | None]]:
    """This rank's compute actions as (kind, stage_idx, microbatch): the torch schedule's own order when
    pipelining, else gradient accumulation (F then B per micro-batch)."""
    if plan.pp == 1:
        out = []
        for mb in range(plan.n_microbatches):
            out += [("F", 0, mb), ("B", 0, mb)]
        return out
    if plan.schedule == "1F1B":
        # torch 2.14's Schedule1F1B executes its own loop (_step_microbatches), and its pipeline_order IR is
        # off by one on the last rank (F1 B0 ... F4); the loop: min(n_mb, n_stages - stage) warm-up
        # forwards, then backward/forward pairs, then the remaining backwards.
        n, s = plan.n_microbatches, stages[0][0]
        warm = min(n, plan.n_stages - s)
        acts = [("F", s, mb) for mb in range(warm)]
        for b in range(n):
            acts.append(("B", s, b))
            if warm + b < n:
                acts.append(("F", s, warm + b))
        return acts + [("REDUCE_GRAD", s, None)]
    order = schedule.pipeline_order[pp_rank]
    acts = []
    for a in order:
        if a is None:
            continue
        for x in (a.sub_actions or (a,)):
            kind = x.computation_type.value
            if kind in ("F", "B", "I", "W", "REDUCE_GRAD"):
                acts.append((kind, x.stage_index, x.microbatch_index))
    held = {s for s, _ in stages}
    bad = {s for _, s, _ in acts} - held
    assert not bad, f"schedule order for pp rank {pp_rank} names stages {sorted(bad)} not held ({sorted(held)})"
    seen: set[tuple[int, int | None]] = set()
    for kind, s, mb in acts:     # the replay needs each backward after its forward
        if kind == "F":
            seen.add((s, mb))
        elif kind != "REDUCE_GRAD":
            assert (s, mb) in seen, f"{plan.schedule} order for pp rank {pp_rank}: {kind}{mb} of stage {s} before its F"
    reduced = {s for k, s, _ in acts if k == "REDUCE_GRAD"}
    acts += [("REDUCE_GRAD", s, None) for s in sorted(held - reduced)]
    return acts


def _fsdp_no_sync(module: nn.Module, every_microbatch: bool = False) -> None:
    """What the pipeline stage does before each backward (stage.backward_maybe_with_nosync); with
    `every_microbatch` (workload ``pp_grad_sync``) the stage keeps the sync and the resharding on
    (``pipeline._stage_class``): the one helper both use."""
    if isinstance(module, FSDPModule):
        fsdp_microbatch_backward_settings(module, every_microbatch)


def _fsdp_reduce_grad(module: nn.Module) -> None:
    """What the pipeline stage does after the stage's last backward (stage.perform_reduce_grad)."""
    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for st in state._state_ctx.all_states:
        for group in st._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def _tracker(stages, optimizer):
    """FSDPMemTracker over all of the rank's stage modules (plain MemTracker when FSDP is not applied)."""
    mods = [m for _, m in stages]
    fsdp = [m for m in mods if isinstance(m, FSDPModule)]
    if not fsdp:
        t = MemTracker()
        t.track_external(*mods, optimizer)
        return t
    t = FSDPMemTracker(fsdp[0], optimizer)
    if len(mods) > 1:
        # FSDPMemTracker takes one root and only walks root.modules()/.buffers(): hand it every stage
        t._root_mod = nn.ModuleList(mods)
    return t


class _Replay(nn.Module):
    """Calls a stage module from a fresh parent: the memory trackers refuse a second forward of a *root*
    module in one iteration, and the micro-batches call each stage several times."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args, **kwargs):
        return self.stage(*args, **kwargs)


def _in_flight_cost_model(plan, pp_rank: int) -> float | None:
    """The analytic model's in-flight micro-batches for the first / last pipeline rank (None in between)."""
    first, last = in_flight_microbatches(CandidateTable.from_plans([plan]))
    if pp_rank == 0:
        return float(first[0])
    if pp_rank == plan.pp - 1:
        return float(last[0])
    return None


def _replay(actions, mods: dict[int, nn.Module], plan, *, tokens, labels, positions, hidden, loss_fn,
            grad_sync: str = "last_microbatch") -> int:
    """Run this rank's compute actions on its stage modules (FakeTensors); returns the most
    (stage, micro-batch) activation sets alive at once.  ``hidden``: (shape, dtype) of a stage input;
    `grad_sync`: the workload's ``pp_grad_sync``."""
    every = grad_sync == "every_microbatch"
    last_stage = plan.n_stages - 1 if plan.pp > 1 else 0
    live: dict[tuple[int, int | None], tuple] = {}
    max_live = 0
    for kind, s, mb in actions:
        if kind == "F":
            if s == 0:
                inp = tokens
            else:
                # the received hidden states, as a view of a leaf: the tracker's gradient hooks on a
                # leaf input do not work with autograd.grad (the I step below)
                shape, dtype = hidden
                inp = torch.empty(shape, dtype=dtype).requires_grad_().view(shape)
            out = _Replay(mods[s])(inp, positions=positions)
            if s == last_stage:
                out, grad = loss_fn(out, labels), None
            else:
                grad = torch.empty_like(out)     # the gradient the next stage sends back
            live[(s, mb)] = (out, grad, inp)
            max_live = max(max_live, len(live))
        elif kind == "B":
            out, grad, _ = live.pop((s, mb))
            if plan.pp > 1:
                _fsdp_no_sync(mods[s], every)
            torch.autograd.backward(out, grad)
        elif kind == "I":
            # torch's stage_backward_input: the gradient of the stage input only (sent to the previous
            # stage), with the graph retained for the W step
            out, grad, inp = live[(s, mb)]
            _fsdp_no_sync(mods[s], every)
            if inp.requires_grad:
                torch.autograd.grad(out, inp, grad, retain_graph=True)
        elif kind == "W":
            # stage_backward_weight: the weight gradients, then the graph is released (this also
            # re-derives the input gradient, one hidden-state tensor)
            out, grad, inp = live.pop((s, mb))
            torch.autograd.backward(out, grad)
            out = grad = inp = None
            gc.collect()    # the retained graph can sit in reference cycles (autograd/FSDP hooks)
        elif kind == "REDUCE_GRAD":
            _fsdp_reduce_grad(mods[s])
    assert not live, f"micro-batches left without backward: {sorted(live)}"
    return max_live


@contextlib.contextmanager
def _own_propagation_mode():
    """DTensor's sharding propagation computes each op's *global* output metadata on fake tensors of the
    global shape, in the ambient FakeTensorMode when there is one (torch 2.14 _sharding_prop:
    ``detect_fake_mode() or FakeTensorMode()``); the memory tracker counts every tensor made in the mode
    it was entered in, so those global-size tensors counted as live memory (a DTensor ``exp`` backward over
    4 ranks: 3.0 GiB of temporaries tracked where the same run on real tensors allocates 0.5).  Give the
    propagation a fake mode of its own, which the tracker skips as it does outside FakeTensorMode."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    detect = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: mode
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect


def _step_loss(plan, meshes, backend: str):
    """(loss function of (logits, labels), context of the step) as the real step on `backend` has them:
    DTensor loss parallel under dtensor TP; the vocab-parallel cross-entropy of the local logits under
    spmd_types TP (``spmd_step.py``); a plain cross-entropy otherwise."""
    if backend == "spmd_types" and plan.tp > 1:
        mesh = spmd_mesh(meshes, plan)
        batch_types = {spmd.MeshAxis.of(mesh.get_group(n)): spmd.V for n in mesh.mesh_dim_names if n != "tp"}
        return (lambda logits, labels: vocab_parallel_cross_entropy(logits, labels, meshes.tp, batch_types),
                contextlib.nullcontext)
    if backend == "dtensor" and plan.tp > 1:
        return cross_entropy, loss_parallel
    return cross_entropy, contextlib.nullcontext


def fake_step_peak(stages, cfg, meshes, precision, *, backend: str = "dtensor"
                   ) -> tuple[dict[str, float], dict[str, Any]]:
    """(peak bytes by tracker category incl. 'total', what was modelled) for one step of this rank, whose
    `stages` were parallelized on `backend`."""
    plan = cfg.plan
    seq_local = cfg.seq_len // plan.cp
    if plan.cp > 1:
        positions = head_tail_indices(cfg.seq_len, plan.cp, meshes.cp.get_local_rank())
    else:
        positions = torch.arange(cfg.seq_len)
    pp_rank = meshes.pp.get_local_rank() if plan.pp > 1 else 0
    loss_fn, loss_ctx = _step_loss(plan, meshes, backend)
    kind = loss_kind(plan, cfg.workload)      # a compiled loss keeps what the fused Function keeps: run that
    set_loss("fused" if kind == "compiled" else kind)
    hidden_shape = (plan.microbatch, seq_local // plan.tp if plan.tp > 1 else seq_local, cfg.spec.dim)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode, _own_propagation_mode(), balanced_routing(stages, fake_mode):
        for _, m in stages:
            m.to_empty(device="cpu")
        schedule = None
        if plan.pp > 1:
            runner = build_schedule(stages, plan, meshes.pp, loss_fn, "cpu", step_context=loss_ctx)
            schedule = runner.schedule
        actions = rank_actions(plan, stages, schedule, pp_rank)
        optimizer = build_optimizer(stages, cfg, torch.device("cpu"))
        for group in optimizer.param_groups:
            # per-parameter AdamW: with foreach over DTensors the tracker also counts the sharding
            # propagation's full-size FakeTensors (about 3x the unsharded model), which no real run allocates
            group["foreach"], group["fused"] = False, False
        tokens = torch.randint(0, cfg.spec.vocab_size, (plan.microbatch, seq_local))
        labels = torch.randint(0, cfg.spec.vocab_size, (plan.microbatch, seq_local))
        positions = positions.clone()
        # AdamW states exist from the second step on (the steady peak): create them with one step on zero
        # gradients instead of a whole untracked training step
        for _, m in stages:
            for p in m.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
        tracker = _tracker(stages, optimizer)
        if hasattr(tracker, "track_inputs"):
            tracker.track_inputs((tokens, labels, positions))
        with tracker:
            with loss_ctx():
                max_live = _replay(actions, dict(stages), plan, tokens=tokens, labels=labels, positions=positions,
                                   hidden=(hidden_shape, precision.param_dtype), loss_fn=loss_fn,
                                   grad_sync=cfg.workload.pp_grad_sync_mode)
            optimizer.step()
            optimizer.zero_grad()
        snap = tracker.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    est = {(k.name if hasattr(k, "name") else str(k)).lower(): float(v) for k, v in snap[dev].items()}
    per_rank_stages = len(stages)
    modelled: dict[str, Any] = {
        "micro_batches": plan.n_microbatches, "microbatch": plan.microbatch, "local_seq": seq_local,
        "in_flight_max": max_live / per_rank_stages,    # in rank-micro-batches (all of the rank's layers)
    }
    if plan.pp > 1:
        modelled["how"] = (f"torch {plan.schedule} order of pp rank {pp_rank} replayed locally "
                           f"(stages {[s for s, _ in stages]}); each received tensor allocated per micro-batch, "
                           "as titan-run's stages receive")
        modelled["in_flight_cost_model"] = _in_flight_cost_model(plan, pp_rank)
    else:
        modelled["how"] = "gradient accumulation: forward+backward per micro-batch"
    if plan.cp > 1:
        modelled["how"] += (f"; cp {plan.cp}: ring attention on the local shard (seq {seq_local}), p2p skipped "
                            "under FakeTensor, ring receive buffers and fp32 accumulators counted")
    return est, modelled
