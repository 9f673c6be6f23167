"""Pipeline parallel on the ``spmd_types`` backend: typed stages, a typed micro-batch loss, untyped P2P.

The stages are the same cut as on the DTensor backend (``pipeline.pipeline_split``),
each parallelized by ``parallelize(..., backend="spmd_types")``: spmd TP/SP inside a
stage (``spmd_tensor_parallel.py``, plain local parameters typed on ``tp``) and FSDP2
over the typed parameters (``fsdp.apply_fsdp_spmd``).  The schedule, its stages and
its FSDP handling are ``pipeline.build_schedule``'s; what is typed here:

* the loss of a micro-batch (:class:`TypedMicroBatchLoss`, the schedule's
  ``loss_fn``): the mean token cross-entropy, vocab-parallel under TP
  (``vocab_parallel_cross_entropy``: the logits are never gathered, the loss is
  Invariant on tp), declared a pending sum (V -> P) over the data-parallel axes
  (``fsdp.spmd_loss``), exactly as in the non-pipelined step (``spmd_step.py``).
  The schedule divides the accumulated gradients by ``n_microbatches``
  (``scale_grads=True``), so they are those of the mean loss of the local batch;
* the batch the runner hands the schedule (:class:`TypedPipelineRunner`): tokens
  and labels Varying on the dp axes, Replicate on tp; under CP this rank's head-tail
  share of each sequence, Varying on cp, and so are the RoPE positions every stage
  gets (:func:`typed_cp_shard_batch`).  With cp in the SPMD mesh, the loss is a
  pending sum over cp as well and hidden states are V on it.

Pipeline P2P stays outside the type system: ``PipelineStage`` sends and receives
plain tensors (``dist.batch_isend_irecv``) between pipeline ranks, which are not an
axis of any typed tensor (a stage's parameters live on one pipeline rank).  A
received activation is therefore a fresh buffer of no meaningful type; with the
checker on (``train.spmd_typecheck``) a forward pre-hook re-declares it with the
type the sending stage produced (:func:`hidden_types`: V on dp, S(1) on tp under TP+SP),
so the checker still follows every collective inside the stage.  The stages'
backward calls (``torch.autograd.backward`` / ``torch.autograd.grad`` on stage
outputs with received output gradients) run outside the checker: spmd_types 0.3
types ``torch.autograd.grad`` as a tensor op (it refused the P loss as "non-linear"),
and backward types are tied to the checked forward types by construction.

``torch.autograd.backward`` (what the schedule calls on the loss) is not the
``Tensor.backward`` the checker intercepts, so under the checker the loss
function itself refuses a loss that is not Invariant or Partial on every axis
(:func:`check_loss_type`): the missing-dp-reduction bug is found on the first
step with a pipeline too.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

import spmd_types as spmd

from .fsdp import spmd_loss, spmd_typecheck
from .pipeline import PipelineRunner, build_schedule
from .spmd_context_parallel import spmd_cp_shard_batch
from .spmd_step import _types, loss_dp_mesh, spmd_mesh
from .spmd_tensor_parallel import SEQ_DIM, vocab_parallel_cross_entropy
from .tensor_parallel import cross_entropy


def batch_types(meshes, plan) -> dict:
    """Types of tokens and labels: V on the data-parallel axes, R on tp."""
    return _types(spmd_mesh(meshes, plan), dp=spmd.V, tp=spmd.R)


def hidden_types(meshes, plan) -> dict:
    """Type of the hidden state a stage sends to the next: V on dp; under TP+SP sequence-sharded, S(1) on tp."""
    return _types(spmd_mesh(meshes, plan), dp=spmd.V, tp=spmd.S(SEQ_DIM))


def typed_cp_shard_batch(tokens: torch.Tensor, labels: torch.Tensor, meshes, plan
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PP x CP: this cp rank's head-tail share of the local batch, as the non-pipelined step takes it
    (``spmd_context_parallel.spmd_cp_shard_batch``): positions V on cp and R elsewhere; tokens and labels
    are typed by the runner (V on dp and cp, R on tp).  Every stage gets the positions (``pipeline.py``)."""
    return spmd_cp_shard_batch(tokens, labels, meshes.cp, spmd_mesh(meshes, plan))


def check_loss_type(loss: torch.Tensor) -> None:
    """Under the checker: the loss must be Invariant or Partial on every axis before backward (the rule
    ``Tensor.backward`` is checked by; the schedule calls ``torch.autograd.backward``, which is not)."""
    if not spmd.is_type_checking():
        return
    if not spmd.has_local_type(loss):
        raise spmd.SpmdTypeError("pipeline loss: backward on a loss with no SPMD type (the loss function must "
                                 "return a typed loss)")
    for axis, typ in spmd.get_local_type(loss).items():
        if typ is not spmd.I and typ is not spmd.P:
            raise spmd.SpmdTypeError(
                f"pipeline loss: backward on a {typ!r} loss on axis {axis} would produce incorrect gradients: "
                f"only Invariant or Partial losses are valid (declare the pending reduction: "
                f"reinterpret(loss, axis, src=V, dst=P))")


class TypedMicroBatchLoss:
    """The schedule's ``loss_fn(logits, labels)``: mean token cross-entropy of one micro-batch, a pending sum
    over the dp axes (vocab-parallel and Invariant on tp under TP)."""

    def __init__(self, meshes, plan):
        self.dp_mesh = loss_dp_mesh(meshes, plan)
        self.tp_mesh = meshes.tp if plan.tp > 1 else None
        self.batch_types = _types(self.dp_mesh, dp=spmd.V)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is not None:
            loss = vocab_parallel_cross_entropy(logits, labels, self.tp_mesh, self.batch_types)
        else:
            loss = cross_entropy(logits, labels)
        # reinterpret returns a view; the split-backward schedules detach their stage outputs in place
        # (stage_backward_input: t.detach_()), which a view refuses
        loss = spmd_loss(loss, self.dp_mesh).clone()
        check_loss_type(loss)
        return loss


class TypedPipelineRunner(PipelineRunner):
    """:class:`PipelineRunner` whose batch is typed (V on dp, R on tp) before the schedule splits it."""

    def __init__(self, *args, batch_types: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self._batch_types = batch_types

    def step(self, tokens, labels, positions):
        for t in (tokens, labels):
            if t is not None:
                spmd.assert_type(t, self._batch_types)
        return super().step(tokens, labels, positions)


def _retype_received(types: dict):
    """Forward pre-hook of a stage > 0: under the checker, its input (a P2P receive buffer, which the
    checker may have typed as a fresh factory tensor) is re-declared as what the previous stage sent."""
    def hook(module, args):
        if not (spmd.is_type_checking() and args and isinstance(args[0], torch.Tensor)):
            return None
        with spmd.no_typecheck():
            x = args[0].view_as(args[0])      # a fresh, untyped alias in the autograd graph
        return (spmd.assert_type(x, types), *args[1:])
    return hook


def build_typed_schedule(stages: list[tuple[int, nn.Module]], plan, meshes, device, *,
                         typecheck: bool = False, grad_sync: str = "last_microbatch") -> TypedPipelineRunner:
    """The plan's schedule over typed stages (already parallelized on ``spmd_types`` and materialized), with
    :class:`TypedMicroBatchLoss`; with `typecheck` every step runs under the spmd_types checker; `grad_sync` is
    the workload's ``pp_grad_sync`` (``pipeline.build_schedule``)."""
    hidden = hidden_types(meshes, plan)
    for idx, module in stages:
        if idx > 0:
            module.register_forward_pre_hook(_retype_received(hidden))
    return build_schedule(stages, plan, meshes.pp, TypedMicroBatchLoss(meshes, plan), device,
                          step_context=spmd_typecheck if typecheck else None,
                          backward_context=spmd.no_typecheck if typecheck else None,
                          runner_cls=functools.partial(TypedPipelineRunner, batch_types=batch_types(meshes, plan)),
                          grad_sync=grad_sync)


__all__ = ["TypedMicroBatchLoss", "TypedPipelineRunner", "batch_types", "build_typed_schedule", "check_loss_type",
           "hidden_types", "typed_cp_shard_batch"]
