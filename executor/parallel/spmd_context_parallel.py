"""Context parallel on the ``spmd_types`` backend: the ring-attention region typed, the batch typed over cp.

Applied from outside the plain-PyTorch model, like the DTensor path (``context_parallel.py``):
:func:`apply_spmd_cp` swaps every ``block.attention.sdpa`` for ring attention whose autograd
function declares its SPMD types (:class:`TypedRingAttentionFn`).  What each tensor is on the
``cp`` axis (R replicate, V varying, P pending sum):

* the batch (tokens, labels) and the RoPE positions: this rank's load-balanced head-tail share
  of every sequence (``context_parallel.cp_shard_batch``, the dtensor path's sharding), V.  Not
  ``S(1)``: the two chunks a rank holds are not one contiguous slice, so an all-gather over cp
  would not give the sequence back in order.  Positions are R on the other axes (every dp and
  tp rank has the same ones), the batch V on the dp axes and R on tp (``spmd_step.py``);
* the parameters: R on cp (every cp rank holds the same weights); R's backward type is P, and
  FSDP2 reduces those gradients over ``dp_shard x cp`` (``fsdp.apply_fsdp_spmd``, the cp axis is
  part of the SPMD mesh ``spmd_step.spmd_mesh`` and of its shard dims);
* hidden states, q / k / v and the attention output: V (this rank's tokens);
* the ring-attention region (:data:`RING_REGION`): q, k and v must be V on cp (the sequence
  is cp-sharded: an input typed R there, the whole sequence on every cp rank, is refused) and
  have one type on every other axis (under TP: V on tp, this rank's heads); the output has q's
  types.  The ring's P2P sends and receives stay inside the region, outside the type system,
  as the pipeline's P2P does: the declaration is the region's contract, checked by
  ``spmd_types`` at its boundary (``spmd_typecheck``), and under the checker the region runs
  in strict mode (:class:`TypedRingAttention`), so a ring function without one is named;
* the loss: the mean over this rank's tokens, V; every cp rank has the same token count, so
  the global mean is the average over (dp, cp) ranks: it is declared a pending sum (V -> P) over
  cp as over the dp axes before ``backward()`` (``fsdp.spmd_loss``).  Without that declaration
  the checker refuses ``backward()`` on a loss Varying over cp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import spmd_types as spmd
import spmd_types.checker  # noqa: F401 (the strict region: spmd.checker.typecheck)

from .context_parallel import RingAttention, apply_cp, cp_shard_batch
from .ring_attention import _RingAttentionFn


@dataclass(frozen=True)
class RegionTypes:
    """The declared cp-axis types of a typed region: each input's (by forward argument name) and the output's.

    Inputs are checked at the region's entry (refinement: other axes keep what they have, and
    every input must carry the same type as the first on every other axis); the output gets the
    first input's types with ``output`` on cp."""
    inputs: dict
    output: object


# ring attention: q, k, v and the output are this rank's share of the sequence
RING_REGION = RegionTypes(inputs={"q": spmd.V, "k": spmd.V, "v": spmd.V}, output=spmd.V)


def _check_region(region: RegionTypes, out: torch.Tensor, cp_axis, args: dict) -> None:
    first = None
    for name, typ in region.inputs.items():
        t = args[name]
        spmd.assert_type(t, {cp_axis: typ})
        types = {a: x for a, x in spmd.get_local_type(t).items() if a != cp_axis}
        if first is None:
            first = (name, t, types)
        elif types != first[2]:
            raise spmd.SpmdTypeError(f"ring attention: {name} has types {types} off the cp axis, "
                                     f"{first[0]} has {first[2]} (they must agree)")
    spmd.assert_type_like(out, first[1], {cp_axis: region.output})


class TypedRingAttentionFn(_RingAttentionFn):
    """Ring attention (``ring_attention._RingAttentionFn``) with its declared SPMD types: under the checker,
    ``spmd_typecheck`` runs after forward and checks / stamps the boundary (:data:`RING_REGION`).
    Backward types follow (V forward, V gradient)."""

    @staticmethod
    def spmd_typecheck(out, *, q, k, v, group):
        _check_region(RING_REGION, out, spmd.MeshAxis.of(group), {"q": q, "k": k, "v": v})


class TypedRingAttention(RingAttention):
    """``RingAttention`` as a typed region: its autograd function declares the types
    (:class:`TypedRingAttentionFn`), and under the checker the call runs in strict mode, so a ring
    function without a declaration is an error naming it (the permissive step mode would leave its
    output silently untyped)."""

    function = TypedRingAttentionFn

    @torch.compiler.disable     # as the ring itself (ring_attention.py): the checker's state is read outside graphs
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not spmd.is_type_checking():
            return super().forward(q, k, v)
        with spmd.checker.typecheck(strict_mode="strict"):
            return super().forward(q, k, v)


def apply_spmd_cp(model: nn.Module, cp_mesh: DeviceMesh, kernel: str | None = None,
                  attention: type[TypedRingAttention] = TypedRingAttention) -> None:
    """Swap every ``block.attention.sdpa`` for the typed ring-attention region over ``cp_mesh`` (`attention`:
    a test passes a subclass with the untyped function to show the checker names it)."""
    apply_cp(model, cp_mesh, kernel, attention)


def spmd_cp_shard_batch(tokens: torch.Tensor, labels: torch.Tensor, cp_mesh: DeviceMesh, spmd_mesh: DeviceMesh
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's head-tail share (``cp_shard_batch``) of tokens and labels, and its positions typed:
    V on cp, R on the other axes of `spmd_mesh` (every dp / tp rank has the same positions).
    Tokens and labels are typed by the caller with the rest of the batch."""
    tok, lab, pos = cp_shard_batch(tokens, labels, cp_mesh)
    spmd.assert_type(pos, {spmd.MeshAxis.of(spmd_mesh.get_group(n)): spmd.V if n == "cp" else spmd.R
                           for n in spmd_mesh.mesh_dim_names})
    return tok, lab, pos


__all__ = ["RING_REGION", "RegionTypes", "TypedRingAttentionFn", "apply_spmd_cp", "spmd_cp_shard_batch"]
