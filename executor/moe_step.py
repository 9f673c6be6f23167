"""The training loop's mixture-of-experts duties (called from ``train.py``; no-ops for dense models).

* :func:`set_aux_loss_scale` -- the auxiliary load-balancing loss
  ``aux_loss_coef * mean over MoE layers of router.aux_loss`` (Switch-style,
  Fedus et al. 2021 Eq. 4) trains through ``moe.AuxLossGrad`` (Megatron-LM's
  ``MoEAuxLossAutoScaler``): each MoE layer's backward adds the gradient of
  ``coef * aux_loss / n_moe_layers`` times the same scaling the main loss gets
  -- ``1/n_microbatches`` under gradient accumulation (the pipeline schedule
  divides all gradients by ``n_microbatches`` itself, ``scale_grads=True``) and
  ``1/tp`` under tensor parallel (each tp rank's term covers its sequence
  chunk and the MoE gradients are summed over tp: the mean over the chunks).
  One code path for every layout, pipeline parallel included.  The term is
  per rank's micro-batch, so its value (and gradient) depends on the layout:
  a token's share of ``f_i * P_i`` differs with how the batch is split.
  Parity tests therefore use a copy of the spec with ``aux_loss_coef: 0``, or
  compare layouts that split the batch alike (pipeline parallel).
* :func:`sum_moe_grads_over_tp` -- MoE layers are not TP-sharded: each tp rank
  runs router, routed and shared experts on its own sequence-parallel tokens,
  so after backward (and after FSDP's reduce-scatter) their gradients are
  summed over the tp group, before clipping and the optimizer step (dtensor
  backend; on spmd_types those parameters are typed R on tp, their gradients
  pending sums that the grad-norm clip reduces with the norms').
* :func:`collect_step_stats` -- after the optimizer step: tokens routed per
  expert per MoE layer (summed over the step's micro-batches and all ranks),
  router imbalance (max/mean tokens per expert, and per EP rank), all-to-all
  seconds (forward dispatch + combine, max over ranks) and bytes sent per rank
  (dispatch + combine, forward and backward; mean and max over the ranks that
  hold MoE layers), and the auxiliary-loss term (coef * mean over MoE layers and
  micro-batches of the aux loss, mean over the data/context/tensor-parallel copies).
* :func:`update_expert_bias` -- DeepSeek-V3's auxiliary-loss-free balancing
  (arXiv:2412.19437 Sec. 2.1.2): after each optimizer step
  ``expert_bias += gamma * sign(mean_load - load)`` with the loads of the whole
  step (all-reduced over every rank, so all ranks apply the same update).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from cost_models.data_parallel import MOE_TP_BUCKET_BYTES

from .init import local_shard


def moe_layers(stages) -> list[tuple[int, nn.Module]]:
    """[(layer id, MoEFeedForward)] of the MoE blocks held by this rank."""
    out = []
    for _, module in stages:
        for key, block in module.layers.items():
            inner = getattr(block, "_checkpoint_wrapped_module", block)
            if getattr(inner, "moe_enabled", False):
                out.append((int(key), inner.feed_forward))
    return out


def moe_params(stages) -> list[nn.Parameter]:
    """Trainable parameters of the MoE layers (router, routed and shared experts)."""
    return [p for _, ff in moe_layers(stages) for p in ff.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- loss
def set_aux_loss_scale(layers, spec, plan) -> float:
    """Set every held MoE layer's aux-loss gradient scale; returns it (0.0 when the aux loss is off)."""
    coef = float(getattr(spec, "aux_loss_coef", 0.0) or 0.0)
    scale = 0.0
    if coef > 0 and spec.n_moe_layers:
        accumulation = 1 if plan.pp > 1 else plan.n_microbatches   # the schedule scales PP grads itself
        scale = coef / spec.n_moe_layers / (accumulation * plan.tp)
    for _, ff in layers:
        ff.aux_loss_grad_scale = scale
    return scale


# --------------------------------------------------------------------------- gradients
def grad_buckets(grads: list[torch.Tensor], cap_bytes: int = MOE_TP_BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """`grads` in order, cut into consecutive buckets of at most `cap_bytes` each (a larger tensor alone)."""
    buckets, cur, size = [], [], 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if cur and size + nbytes > cap_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(g)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


@torch.no_grad()
def sum_moe_grads_over_tp(params: list[nn.Parameter], tp_mesh, cap_bytes: int = MOE_TP_BUCKET_BYTES) -> None:
    """Sum the (local shards of the) MoE gradients over the tp group: one all-reduce per bucket of at most
    `cap_bytes` (a contiguous gradient alone in its bucket is reduced in place)."""
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(g.to_local() if isinstance(g, DTensor) else g)
    group = tp_mesh.get_group()
    for bucket in grad_buckets(grads, cap_bytes):
        if len(bucket) == 1 and bucket[0].is_contiguous():
            dist.all_reduce(bucket[0], group=group)
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(bucket, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in bucket]), bucket)])


# --------------------------------------------------------------------------- per-step figures
def collect_step_stats(layers, spec, device, ep: int, copies: int, forwards: int | None = None) -> dict:
    """Everyone's figures of the step just taken (two small all-reduces over the world); resets counters.

    ``copies``: how many ranks hold each MoE layer (dp * cp * tp): the aux-loss term is summed over
    all ranks (pipeline ranks hold different layers) and divided by it.  ``forwards``: the step's
    forwards per layer (n_microbatches); only the last that many recorded forwards count (a
    pipeline stage's first step also runs shape-inference forwards on uninitialized buffers).
    """
    n_layers, n_exp = spec.n_layers, spec.n_experts
    counts = torch.zeros(n_layers, n_exp, dtype=torch.float64, device=device)
    a2a_s, a2a_bytes = 0.0, 0.0
    coef = float(getattr(spec, "aux_loss_coef", 0.0) or 0.0)
    aux_sum = 0.0
    for lid, ff in layers:
        hist = ff.router.step_history[-forwards:] if forwards else ff.router.step_history
        ff.router.step_history = []
        if hist:
            counts[lid] = torch.stack([c for c, _ in hist]).sum(0).to(torch.float64)
            aux_sum += coef * float(torch.stack([a for _, a in hist]).mean()) / max(spec.n_moe_layers, 1)
        experts = ff.experts
        if hasattr(experts, "step_all_to_all_s"):
            a2a_s += experts.step_all_to_all_s
            a2a_bytes += experts.step_all_to_all_bytes
            experts.step_all_to_all_s, experts.step_all_to_all_bytes = 0.0, 0
    holds = 1.0 if layers else 0.0
    sums = torch.cat([counts.flatten(), torch.tensor([a2a_bytes, aux_sum, holds], dtype=torch.float64,
                                                     device=device)])
    maxes = torch.tensor([a2a_s, a2a_bytes], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    counts = sums[:-3].view(n_layers, n_exp).cpu()
    bytes_sum, aux_total, holders = sums[-3:].tolist()
    holders = max(holders, 1.0)
    moe_ids = [i for i in range(spec.n_dense_layers, n_layers)]
    per_layer = {str(i): [int(v) for v in counts[i].tolist()] for i in moe_ids}
    imb = [_max_over_mean(counts[i]) for i in moe_ids]
    rank_imb = [_max_over_mean(counts[i].view(ep, -1).sum(1)) for i in moe_ids] if ep > 1 else []
    return {
        "tokens_per_expert": per_layer,
        "router_imbalance": max(imb) if imb else None,           # max over layers of max/mean per expert
        "router_imbalance_mean": sum(imb) / len(imb) if imb else None,
        "ep_rank_imbalance": max(rank_imb) if rank_imb else None,  # max/mean tokens per EP rank
        "all_to_all_s": float(maxes[0]),
        "all_to_all_bytes": bytes_sum / holders,                 # mean over ranks holding MoE layers
        "all_to_all_bytes_max": float(maxes[1]),
        "aux_loss_term": aux_total / max(copies, 1),            # coef * mean aux loss, mean over copies
        "_counts": counts,
    }


def _max_over_mean(c: torch.Tensor) -> float:
    m = float(c.mean())
    return float(c.max()) / m if m > 0 else 1.0


@torch.no_grad()
def update_expert_bias(layers, counts: torch.Tensor, gamma: float) -> None:
    """expert_bias += gamma * sign(mean load - load), per MoE layer, from the step's global loads."""
    for lid, ff in layers:
        bias = ff.router.expert_bias
        if bias is None:
            continue
        load = counts[lid].to(torch.float32)
        upd = (gamma * torch.sign(load.mean() - load)).to(device=bias.device, dtype=bias.dtype)
        dst = bias.to_local() if isinstance(bias, DTensor) else bias
        dst.add_(local_shard(upd, bias))
