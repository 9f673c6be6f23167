"""Expert parallelism on the ``spmd_types`` backend: local expert weights, typed all-to-all, typed mesh switch.

The same dispatch / combine as ``expert_parallel.py`` (its forward is shared: counts
exchange, uneven all-to-all, local grouped SwiGLU, inverse all-to-all), with the
backend pieces typed instead of DTensor:

* the expert weights are plain local tensors, this rank's E/ep experts, typed on the
  experts' mesh ``(dp_replicate,) efsdp, ep (, tp)`` (``Meshes.expert_spmd``): S(0) on ``ep``
  (each ep rank holds other experts, so their gradients are never summed over ep) and
  R on the FSDP axes and on ``tp`` (under TP the MoE layers run on the sequence-parallel
  local tokens; their tp gradients are pending sums, reduced like the norms').  FSDP2
  stores them over that mesh (``fsdp.apply_fsdp_spmd(expert_mesh=...)``: shard ``efsdp``, replicate
  ``dp_replicate``); R forward means a pending-sum (P) gradient there, which FSDP
  reduces with the divide factor of all data-parallel ranks (the all-to-all backward
  has already summed each expert's gradient over the ep ranks' tokens);
* the tokens and their counts cross from the dense mesh (``dp_replicate, dp_shard, cp``,
  Varying) to the experts' mesh at the dispatch, and the experts' outputs cross back at
  the combine: ``spmd.reinterpret_mesh``, a relabelling with no data movement that the
  checker verifies (``dp_shard x cp`` spans the same ranks as ``efsdp x ep``; ``tp``, when
  there, is kept on both sides).  Tokens that
  skipped the dispatch are still on the dense mesh, and the checker rejects them where
  they meet the experts' data;
* the counts exchange is ``spmd.all_to_all`` V -> V (stack semantics: row r of the
  [ep, n_local] counts goes to ep rank r), without gradient;
* dispatch and combine are :class:`AllToAllRows`, an uneven all-to-all typed V -> V on
  ``ep``; its backward is the reverse all-to-all, typed the same way.

The router, its auxiliary loss and the shared experts stay in the dense block: dense
parameters, R on the dp axes, reduced by the block's FSDP like the others; the aux-loss
gradient hook (``moe.AuxLossGrad``) is declared a local autograd function, so the routed
output keeps its type through it.  Under the
checker the whole step is typed; in erasure mode (checker off) the relabelling is
skipped and only the collectives run.  Model code is untouched: :func:`apply_spmd_ep`
swaps ``feed_forward.experts`` from outside, as ``apply_ep`` does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import spmd_types as spmd
from spmd_types import rules

from ..models.moe import AuxLossGrad, GroupedExperts
from .expert_parallel import ExpertParallelExperts

# The MoE layer's aux-loss gradient hook (moe.AuxLossGrad: the identity on the routed output, a constant
# gradient for the router's aux loss in backward) is local, no collective: declared so, the checker carries
# the routed output's type through it (an unregistered autograd Function leaves its output untyped).
spmd.register_local_autograd_function(AuxLossGrad)


def _axis(mesh: DeviceMesh, name: str) -> spmd.MeshAxis:
    return spmd.MeshAxis.of(mesh.get_group(name))


class AllToAllRows(torch.autograd.Function):
    """Uneven all-to-all of rows over `group`, typed V -> V; backward: the reverse routes, V -> V.

    ``spmd.all_to_all(S(0) -> S(0), output_split_sizes=...)`` is the same typed collective, but it
    runs on the list ``all_to_all``, which gloo supports for equal sizes only; this one runs on
    ``all_to_all_single`` (every backend) and declares its type rule to the checker."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return AllToAllRows.apply(grad.contiguous(), ctx.group, in_splits, out_splits), None, None, None

    @staticmethod
    def spmd_typecheck(*, x, group):
        return rules.all_to_all(x, group, src=spmd.V, dst=spmd.V)


class SpmdExpertParallelExperts(ExpertParallelExperts):
    """This rank's E/ep experts as plain typed tensors, with typed all-to-alls around them."""

    def __init__(self, experts: GroupedExperts, expert_mesh: DeviceMesh, dense_mesh: DeviceMesh,
                 ep_mesh: DeviceMesh | None = None):
        names = expert_mesh.mesh_dim_names
        ep_mesh = expert_mesh["ep"] if ep_mesh is None else ep_mesh
        self.ep_group = ep_mesh.get_group()
        super().__init__(experts, ep_mesh)
        self.param_types = {_axis(expert_mesh, n): spmd.S(0) if n == "ep" else spmd.R for n in names}
        for p in (self.w1, self.w2, self.w3):
            spmd.assert_type(p, self.param_types)
        # mesh switch: the dense data-parallel axes <-> the experts' axes (other axes, tp, are kept)
        self.dense_axes = frozenset(_axis(dense_mesh, n) for n in dense_mesh.mesh_dim_names)
        self.expert_axes = frozenset(_axis(expert_mesh, n) for n in names if n != "tp")

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        """Rows [r*E/ep, (r+1)*E/ep) of a grouped weight [E, ...], a plain tensor (typed once a parameter)."""
        lo = self.ep_mesh.get_local_rank() * self.n_local
        return full[lo:lo + self.n_local].clone()

    # the dense mesh <-> the experts' mesh, at the all-to-alls: tokens and counts cross over on the way in
    # (dispatch), the experts' outputs come back on the way out (combine)
    def exchange_counts(self, send: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return spmd.all_to_all(self._remesh(send, to_experts=True), self.ep_group, src=spmd.V, dst=spmd.V)

    def dispatch(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        return AllToAllRows.apply(self._remesh(x, to_experts=True), self.ep_group, out_splits, in_splits)

    def combine(self, y: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        # in place: the result is a fresh tensor (and FSDP warns about a module returning a view)
        return self._remesh(AllToAllRows.apply(y, self.ep_group, out_splits, in_splits), to_experts=False,
                            inplace=True)

    def _remesh(self, t: torch.Tensor, *, to_experts: bool, inplace: bool = False) -> torch.Tensor:
        """Relabel `t` from the dense data-parallel axes onto the experts' axes (or back), its other axes
        kept: no data moves, the checker verifies that both span the same ranks.  Erasure mode: `t`."""
        if not spmd.is_type_checking():
            return t
        src, dst = (self.dense_axes, self.expert_axes) if to_experts else (self.expert_axes, self.dense_axes)
        return spmd.reinterpret_mesh(t, (frozenset(spmd.get_local_type(t)) - src) | dst, inplace=inplace)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w1, self.w2, self.w3


def apply_spmd_ep(model: nn.Module, expert_mesh: DeviceMesh, dense_mesh: DeviceMesh, *,
                  ep_mesh: DeviceMesh | None = None) -> int:
    """Swap every MoE block's experts for their typed expert-parallel version; returns how many.

    `expert_mesh`: ``(dp_replicate,) efsdp, ep (, tp)`` (``Meshes.expert_spmd``); `dense_mesh`: the
    dense data-parallel axes the tokens come from; `ep_mesh`: the ep group the all-to-alls run on
    (``Meshes.ep``, the same ranks as `expert_mesh`'s ep; default: that one)."""
    n = 0
    for block in model.layers.values():
        if getattr(block, "moe_enabled", False):
            block.feed_forward.experts = SpmdExpertParallelExperts(block.feed_forward.experts, expert_mesh,
                                                                   dense_mesh, ep_mesh)
            n += 1
    return n


__all__ = ["AllToAllRows", "SpmdExpertParallelExperts", "apply_spmd_ep"]
