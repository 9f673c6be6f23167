"""Expert parallelism: routed experts split over an ``ep`` group, tokens moved by all-to-all.

The ``ep`` ranks are carved out of ``dp_shard * cp`` (see `search_spaces.plan`).
`apply_ep` replaces each MoE block's ``feed_forward.experts`` (a
`GroupedExperts` holding all E experts) by an `ExpertParallelExperts` that
holds the E/ep experts of this rank as a DTensor ``Shard(0)`` over the ep
mesh, so checkpoints see full expert tensors and FSDP can shard them further
over the remaining data-parallel ranks.

Dispatch (Lepikhin et al. 2020, GShard Sec. 3.2; dropless as in MegaBlocks):
the MoE layer hands over its tokens sorted by global expert id and the count
per expert. Ranks first exchange those counts (one small all-to-all), then
the tokens (``all_to_all_single`` with uneven splits, differentiable), run
their local experts on the received tokens regrouped by local expert, and
send the results back by the inverse all-to-all (combine). The autograd of
the functional all-to-all sends the gradients along the reverse routes.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from ..models.layers import rebuilds
from ..models.moe import GroupedExperts, grouped_swiglu, in_backward


class ExpertParallelExperts(nn.Module):
    """This rank's share of the routed experts plus the all-to-all around them."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh):
        super().__init__()
        self.ep_mesh = ep_mesh
        self.ep = ep_mesh.size()
        self.n_experts = experts.n_experts
        if self.n_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide the number of experts ({self.n_experts})")
        self.n_local = self.n_experts // self.ep
        self.rebuild_product = experts.rebuild_product     # (layers.rebuilt_input; the executor sets it)
        # the same parameter names as GroupedExperts, so checkpoints do not depend on ep
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            self.register_parameter(name, nn.Parameter(self.shard_weight(full.detach()),
                                                       requires_grad=full.requires_grad))
        self.last_all_to_all_s = 0.0   # wall time of this layer's all-to-alls in the last forward
        self.last_all_to_all_bytes = 0
        # per training step (the loop resets them): forward all-to-all seconds, and bytes this rank
        # sent in dispatch + combine, forward and backward (the backward all-to-alls take the
        # reverse routes, so they send what the forward received: counted equal to the forward's)
        self.step_all_to_all_s = 0.0
        self.step_all_to_all_bytes = 0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] sorted by global expert; counts: [E] tokens per global expert."""
        t0 = time.perf_counter()
        send = counts.to(torch.int64).view(self.ep, self.n_local)          # [dest rank, local expert]
        recv = self.exchange_counts(send)                                  # [src rank, local expert]
        in_splits = send.sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        x_recv = self.dispatch(x.contiguous(), out_splits, in_splits)
        a2a_s = time.perf_counter() - t0

        # received rows are ordered (src rank, local expert); experts want (local expert, src rank)
        perm = _regroup_index(recv)
        y = grouped_swiglu(x_recv[perm], recv.sum(0), *self.local_weights(),
                           rebuild=rebuilds(self, x_recv))
        y_back = torch.empty_like(y).index_copy_(0, perm, y) if y.shape[0] else y

        t1 = time.perf_counter()
        out = self.combine(y_back.contiguous(), in_splits, out_splits)
        a2a_s += time.perf_counter() - t1
        self.last_all_to_all_s = a2a_s
        self.last_all_to_all_bytes = (sum(in_splits) + sum(out_splits)) * x.shape[-1] * x.element_size()
        self.step_all_to_all_s += a2a_s
        # a recompute (activation checkpointing) moves the forward bytes again; its backward is
        # the original forward's, already counted
        self.step_all_to_all_bytes += self.last_all_to_all_bytes * (1 if in_backward() else 2)
        return out

    # the pieces a backend provides (DTensor here; spmd_types in spmd_expert_parallel.py)
    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a grouped weight [E, ...]: a DTensor Shard(0) over ep."""
        return distribute_tensor(full, self.ep_mesh, [Shard(0)])

    def exchange_counts(self, send: torch.Tensor) -> torch.Tensor:
        """[ep, n_local] tokens this rank sends to each rank's local experts -> what it receives."""
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.ep_mesh.get_group())
        return recv

    def dispatch(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """Rows of `x` in `in_splits` blocks to the ep ranks; `out_splits` rows from each (differentiable)."""
        return _wait(all_to_all_single_autograd(x, out_splits, in_splits, self.ep_mesh.get_group()))

    def combine(self, y: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """The experts' outputs back along the reverse routes (the inverse of :meth:`dispatch`)."""
        return self.dispatch(y, out_splits, in_splits)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) of this rank's n_local experts, plain tensors."""
        return self.w1.to_local(), self.w2.to_local(), self.w3.to_local()


def _wait(t: torch.Tensor) -> torch.Tensor:
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


def _regroup_index(recv: torch.Tensor) -> torch.Tensor:
    """Row order that turns (src rank, local expert) blocks into (local expert, src rank) blocks."""
    ep, n_local = recv.shape
    flat = recv.flatten()
    starts = torch.cumsum(flat, 0) - flat                           # start of each (src, e) block
    block_order = torch.arange(ep * n_local, device=recv.device).view(ep, n_local).t().flatten()
    lengths = flat[block_order]
    block_starts = starts[block_order]
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=recv.device)
    offs = torch.arange(total, device=recv.device) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths,
                                                                            lengths)
    return torch.repeat_interleave(block_starts, lengths) + offs


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Swap every MoE block's experts for their expert-parallel version; returns how many."""
    n = 0
    for block in model.layers.values():
        if getattr(block, "moe_enabled", False):
            block.feed_forward.experts = ExpertParallelExperts(block.feed_forward.experts, ep_mesh)
            n += 1
    return n
