"""The training loop's mixture-of-experts duties (called from ``train.py``; no-ops for dense models).

* :func:`aux_loss_term` -- ``aux_loss_coef * mean over MoE layers of router.aux_loss``
  (Switch-style load-balancing loss, Fedus et al. 2021 Eq. 4) on this rank's
  micro-batch, as Megatron-LM does.  It is computed per rank over the rank's own
  tokens, so the value (and its gradient) depends on the layout: a token's
  share of ``f_i * P_i`` differs with how the batch is split.  Parity tests
  therefore use a copy of the spec with ``aux_loss_coef: 0``.  Under tensor
  parallel each tp rank's term covers its sequence chunk and the MoE gradients
  are summed over tp, so the term is divided by tp (the mean over the chunks).
  Under pipeline parallel the term is skipped (one warning line): the schedule
  owns the loss and only the last stage has one.
* :func:`sum_moe_grads_over_tp` -- MoE layers are not TP-sharded: each tp rank
  runs router, routed and shared experts on its own sequence-parallel tokens,
  so after backward (and after FSDP's reduce-scatter) their gradients are
  summed over the tp group, before clipping and the optimizer step.
* :func:`collect_step_stats` -- after the optimizer step: tokens routed per
  expert per MoE layer (summed over the step's micro-batches and all ranks),
  router imbalance (max/mean tokens per expert, and per EP rank), all-to-all
  seconds (forward dispatch + combine, max over ranks) and bytes sent per rank
  (dispatch + combine, forward and backward; mean and max over the ranks that
  hold MoE layers), and the mean auxiliary loss.
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
def aux_loss_term(layers, spec) -> torch.Tensor | None:
    """``aux_loss_coef * sum(router.aux_loss) / n_moe_layers`` of the last forward; None when off."""
    coef = float(getattr(spec, "aux_loss_coef", 0.0) or 0.0)
    if coef <= 0 or not layers:
        return None
    return coef * torch.stack([ff.router.aux_loss for _, ff in layers]).sum() / spec.n_moe_layers


# --------------------------------------------------------------------------- gradients
@torch.no_grad()
def sum_moe_grads_over_tp(params: list[nn.Parameter], tp_mesh) -> None:
    """Sum the (local shards of the) MoE gradients over the tp group, in one flat all-reduce."""
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(g.to_local() if isinstance(g, DTensor) else g)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_mesh.get_group())
    torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])


# --------------------------------------------------------------------------- per-step figures
def collect_step_stats(layers, spec, device, ep: int, aux_sum: float) -> dict:
    """Everyone's figures of the step just taken (two small all-reduces over the world); resets counters."""
    n_layers, n_exp = spec.n_layers, spec.n_experts
    counts = torch.zeros(n_layers, n_exp, dtype=torch.float64, device=device)
    a2a_s, a2a_bytes = 0.0, 0.0
    for lid, ff in layers:
        c = ff.router.step_tokens_per_expert
        if c is not None:
            counts[lid] = c.to(torch.float64)
        ff.router.step_tokens_per_expert = None
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
        "aux_loss_term": aux_total / holders,                   # coef * mean aux loss, mean over ranks
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
