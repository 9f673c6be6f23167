"""One forward/backward on the ``spmd_types`` backend: typed batch, typed loss, optional checker.

The batch is Varying (V) on the data-parallel axes and Replicate (R) on ``tp``; under
context parallel each micro-batch is first cut to this rank's head-tail share of every
sequence (``spmd_context_parallel.spmd_cp_shard_batch``), V on ``cp`` as well, with its
RoPE positions (V on cp, R elsewhere).  The loss is the mean token cross-entropy
(vocab-parallel under TP, ``spmd_tensor_parallel.vocab_parallel_cross_entropy``),
Invariant on tp, and is declared a pending sum (V -> P) on the dp axes and cp before
``backward()``.

``train.spmd_typecheck=true`` runs each micro-batch under the ``spmd_types`` checker
(``spmd_types.checker.typecheck``, permissive: tensors made inside the model from
``arange`` are inferred R): a missing or wrong collective raises ``SpmdTypeError``
naming the op and the axis, on the first step.  Off by default (the checker is a
TorchFunctionMode: it costs dispatch time), the same code runs in erasure mode.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import spmd_types as spmd

from ..models.layers import RMSNormFunction, Rotary
from .fsdp import DP_AXES, reduce_deferred_tp_grads, spmd_loss, spmd_typecheck
from .spmd_context_parallel import spmd_cp_shard_batch
from .spmd_tensor_parallel import vocab_parallel_cross_entropy
from .tensor_parallel import cross_entropy

# RoPE (layers.Rotary, an autograd Function: a pairwise rotation, no collective) is local: declared so, the
# checker carries q's and k's types through it (an unregistered Function leaves its output untyped)
spmd.register_local_autograd_function(Rotary)
# so is the eager RMSNorm (layers.RMSNormFunction: per-token statistics over the unsharded last dimension): its
# output is V where the tokens are (R weight x V input), R where they are R (MLA's latent norms under TP)
spmd.register_local_autograd_function(RMSNormFunction)


def spmd_mesh(meshes, plan) -> DeviceMesh | None:
    """The SPMD mesh FSDP stores typed parameters on: the dp axes of size > 1, plus ``cp`` when cp > 1
    (parameters R there, gradients reduced over dp_shard x cp) and ``tp`` when tp > 1 (then with a
    one-rank ``dp_shard`` if there is no dp or cp axis, so FSDP has an axis to shard on)."""
    if plan.tp == 1 and plan.cp == 1:
        return meshes.spmd_dp
    names = [a for a in DP_AXES if getattr(plan, a) > 1] + (["cp"] if plan.cp > 1 else [])
    return _submesh(meshes.world, (*(names or ["dp_shard"]), *(["tp"] if plan.tp > 1 else [])))


_SUBMESHES: dict = {}      # (id(world), axis names) -> (world, submesh)


def _submesh(world: DeviceMesh, names: tuple) -> DeviceMesh:
    """``world[names]``, the same object on every call: ``world[...]`` makes a new (equal) DeviceMesh each time,
    and FSDP's spmd path refuses a second stage module of the same rank (PP) on an equal but other mesh."""
    hit = _SUBMESHES.get((id(world), names))
    if hit is None or hit[0] is not world:
        hit = _SUBMESHES[(id(world), names)] = (world, world[names])
    return hit[1]


def _types(mesh: DeviceMesh, **by_axis) -> dict:
    """{MeshAxis: type} for the named axes of `mesh` (dp axes -> by_axis['dp'], tp -> by_axis['tp'])."""
    return {spmd.MeshAxis.of(mesh.get_group(n)): by_axis["tp" if n == "tp" else "dp"] for n in mesh.mesh_dim_names}


def loss_dp_mesh(meshes, plan) -> DeviceMesh:
    """The axes the loss is a pending sum over (the SPMD mesh without ``tp``); the batch is V on them
    (also the pipeline schedule's loss, ``spmd_pipeline.py``)."""
    mesh = spmd_mesh(meshes, plan)
    return meshes.world[tuple(n for n in mesh.mesh_dim_names if n != "tp")]


_STEP_TYPES: dict = {}     # (id(meshes), plan) -> (meshes, mesh, dp_mesh, batch types, token types)


def _step_types(meshes, plan) -> tuple:
    """(SPMD mesh, loss dp mesh, batch types on the dp mesh, token types on the SPMD mesh), built once per
    meshes and plan: ``world[...]`` makes a new DeviceMesh on every call and each type dict looks up process
    groups (together ~1 ms of Python a step, measured on 2 gloo ranks)."""
    hit = _STEP_TYPES.get((id(meshes), plan))
    if hit is None or hit[0] is not meshes:
        mesh, dp_mesh = spmd_mesh(meshes, plan), loss_dp_mesh(meshes, plan)
        hit = _STEP_TYPES[(id(meshes), plan)] = (meshes, mesh, dp_mesh, _types(dp_mesh, dp=spmd.V),
                                                 _types(mesh, dp=spmd.V, tp=spmd.R))
    return hit[1:]


def forward_backward(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, meshes, plan, *,
                     typecheck: bool) -> torch.Tensor:
    """Gradients of the mean loss of this rank's batch (gradient accumulation over
    ``plan.n_microbatches``); returns that loss, a plain tensor."""
    mesh, dp_mesh, batch_types, token_types = _step_types(meshes, plan)
    n = plan.n_microbatches
    total = torch.zeros((), device=tokens.device)
    for tok, lab in zip(tokens.chunk(n), labels.chunk(n)):
        with spmd_typecheck() if typecheck else contextlib.nullcontext():
            positions = None
            if plan.cp > 1:       # this rank's head-tail share of each sequence, V on cp (spmd_context_parallel.py)
                tok, lab, positions = spmd_cp_shard_batch(tok, lab, meshes.cp, mesh)
            for t in (tok, lab):
                spmd.assert_type(t, token_types)
            logits = model(tok, positions)
            if plan.tp > 1:
                loss = vocab_parallel_cross_entropy(logits, lab, meshes.tp, batch_types) / n
            else:
                loss = cross_entropy(logits, lab) / n
            spmd_loss(loss, dp_mesh).backward()
        total += loss.detach().float()
    deferred = getattr(model, "_deferred_tp_grads", None)
    if deferred is not None:        # the tp-pending grads, summed in one all-reduce (fsdp.defer_tp_grad_reduction)
        reduce_deferred_tp_grads(*deferred)
    return total


__all__ = ["forward_backward", "loss_dp_mesh", "spmd_mesh"]
