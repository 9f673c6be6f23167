"""Tensor parallel with sequence parallel (Megatron-LM style, via DTensor): the ``dtensor`` backend.

The ``spmd_types`` backend (the default) shards the same modules the same way with plain
local tensors and typed collectives instead (``spmd_tensor_parallel.py``).

Inside each block the attention projections wq/wk/wv and FFN w1/w3 are
column-sharded and wo/w2 row-sharded over the ``tp`` mesh (Shoeybi et al.
2019); between them the activations are sequence-sharded (``Shard(1)``,
Korthikanti et al. 2022), so norms run on 1/tp of the tokens.  The LM head is
column-sharded over the vocabulary and its logits stay a ``Shard(-1)``
DTensor for ``loss_parallel`` (the loss never gathers the full logits).

The token embedding is vocab-sharded (``RowwiseParallel``) unless
``shard_embedding=False``: then it is replicated over tp and its output is cut
to this rank's sequence chunk (backward all-gathers the gradient).  The
executor uses that when compiling, because a TP-sharded embedding + compiled
blocks + FSDP trains silently wrong on torch 2.13/2.14 (docs/torch_on_cpu.md §8c).

Mixture-of-experts blocks (``block.moe_enabled``): only attention is
TP-sharded.  The MoE layer is token-wise, so it runs on the sequence-parallel
local tokens (``ffn_norm`` hands over a plain local tensor) with router,
routed and shared experts replicated over tp -- no TP communication.  Each tp
rank then holds gradients for different tokens: ``moe_step.py`` sums them
over tp after backward.

Multi-head latent attention (``attention: mla``, ``models/mla.py``) is sharded
by heads: the up-projections ``wq`` / ``wq_b`` and ``wkv_b`` column-wise, ``wo``
row-wise (sequence-parallel output as above).  The down-projections ``wq_a`` and
``wkv_a`` and the latent norms ``q_norm`` / ``kv_norm`` are small and hold no
head dimension: they are replicated (:class:`ReplicatedCompute`) and run on the
full (all-gathered) sequence on every tp rank.  Their gradients are partial --
each tp rank back-propagates through its own heads only -- so they are kept
as ``Partial`` DTensor gradients (reduced by FSDP or the grad-norm clip like
the sequence-parallel norms'), and the rotary key ``wkv_a`` produces (one
plain tensor shared by the local heads) is handed to the model with a
``Partial`` gradient placement.

Head counts are read from shapes by the model, so local (column-sharded)
projections need no model change.  Works on a pipeline stage: modules set to
``None`` are skipped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..models.layers import is_type_checking
from .fused_loss import fused_cross_entropy


class _ReplicateWithPartialGrad(torch.autograd.Function):
    """A plain tensor holding the same value on every tp rank -> ``Replicate`` DTensor, whose
    gradient is handed back as this rank's ``Partial`` share (no all-reduce): the inverse of
    ``DTensor.to_local(grad_placements=(Partial(),))``.  (``from_local(grad_placements=...)``
    does this on torch >= 2.14 only.)"""

    @staticmethod
    def forward(ctx, x, mesh):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            if all(p.is_partial() for p in grad.placements):
                grad = grad.to_local()
            else:   # (seen under torch.compile) a replicated gradient: each rank's share is 1/tp of it
                grad = grad.redistribute(placements=[Replicate()]).to_local() / grad.device_mesh.size()
        return grad, None


class ReplicatedCompute(ParallelStyle):
    """Weights replicated over tp, computed on the full input on every tp rank (MLA's
    down-projections and latent norms).

    Input: a DTensor is redistributed to ``Replicate``; a plain tensor is taken as the
    replicated value whose gradient is per-rank partial.  Output: the ``Replicate``
    DTensor, or (``local_output=True``) the local tensor with a ``Partial`` gradient
    placement, for model code that mixes it with head-sharded local tensors.
    """

    def __init__(self, *, local_output: bool = False):
        self.local_output = local_output

    @staticmethod
    def _replicate_params(name, module, mesh):
        for p_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(p_name, nn.Parameter(
                DTensor.from_local(param, mesh, [Replicate()], run_check=False), requires_grad=param.requires_grad))

    @staticmethod
    def _input_fn(mod, inputs, mesh):
        x = inputs[0]
        if isinstance(x, DTensor):
            if any(not p.is_replicate() for p in x.placements):
                x = x.redistribute(placements=[Replicate()])
        else:
            x = _ReplicateWithPartialGrad.apply(x, mesh)
        return (x, *inputs[1:])

    def _output_fn(self, mod, out, mesh):
        return out.to_local(grad_placements=(Partial(),)) if self.local_output else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._input_fn, self._output_fn)


def attention_plan(attention: nn.Module) -> dict:
    """TP plan entries (relative to the block) of the attention projections: GQA or MLA."""
    if hasattr(attention, "wkv_a"):         # MLA (models/mla.py): shard by heads
        plan = {"attention.wkv_a": ReplicatedCompute(local_output=True),   # latent + shared rotary key
                "attention.kv_norm": ReplicatedCompute(),
                "attention.wkv_b": ColwiseParallel()}
        if getattr(attention, "q_lora_rank", 0):
            plan.update({"attention.wq_a": ReplicatedCompute(), "attention.q_norm": ReplicatedCompute(),
                         "attention.wq_b": ColwiseParallel()})
        else:
            plan["attention.wq"] = ColwiseParallel()
        return plan
    return {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel()}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool = True,
             shard_embedding: bool = True) -> None:
    root_plan = {}
    if getattr(model, "tok_embeddings", None) is not None:
        if shard_embedding:
            root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        else:
            root_plan["tok_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(),
                                                              desired_output_layouts=Shard(1))
    if getattr(model, "norm", None) is not None:
        root_plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        root_plan["output"] = ColwiseParallel(input_layouts=Shard(1),
                                              output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                              use_local_output=not loss_parallel)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)

    for block in model.layers.values():
        moe = getattr(block, "moe_enabled", False)
        block_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            **attention_plan(block.attention),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        if moe:       # token-wise MoE on the local (sequence-sharded) tokens, weights replicated
            for k in ("feed_forward", "feed_forward.w1", "feed_forward.w2"):
                del block_plan[k]
            block_plan["ffn_norm"] = SequenceParallel(use_local_output=True)
        elif getattr(block.feed_forward, "w3", None) is not None:
            block_plan["feed_forward.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, block_plan)


def _eager_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


LOSS_KINDS = ("compiled", "fused", "eager")
_LOSS: dict = {"kind": "fused", "compiled": None}    # this process's loss of plain-tensor logits (one run per process)


def set_loss(kind: str) -> None:
    """How `cross_entropy` computes the loss of plain-tensor logits from now on: ``compiled`` (Inductor fuses
    upcast, log-softmax and NLL, as TorchTitan compiles its loss), ``fused`` (``fused_loss.FusedCrossEntropy``,
    titan-run's eager default: keeps the logits, not an fp32 copy) or ``eager`` (``F.cross_entropy`` on the
    fp32 upcast: keeps the fp32 log-softmax, 4 bytes per logit, and backward adds two more fp32 copies).
    Compiled and fused keep the logits themselves (the dtype's bytes) and write one gradient in that dtype:
    measured in tests/test_compiled_loss.py.  Vocab-sharded DTensor logits (dtensor TP's ``loss_parallel``)
    stay eager whatever the kind."""
    if kind not in LOSS_KINDS:
        raise ValueError(f"set_loss: kind {kind!r} (allowed: {', '.join(LOSS_KINDS)})")
    _LOSS["kind"] = kind
    if kind == "compiled" and _LOSS["compiled"] is None:
        _LOSS["compiled"] = torch.compile(_eager_cross_entropy)


def loss_kind(plan, workload) -> str:
    """The loss titan-run runs for `plan` on plain-tensor logits (`set_loss`): ``compiled`` with compile on at
    tp 1 under ``loss_impl`` auto or compiled (``Workload.compiles_loss``), else ``fused`` under auto, else
    ``eager`` (``loss_impl`` eager or compiled without compile): the rule the cost model charges
    (``cost_models.memory.loss_fused``)."""
    if workload.compiles_loss(plan.compile, plan.tp):
        return "compiled"
    return "fused" if workload.loss_impl == "auto" else "eager"


def loss_compiled(plan, workload) -> bool:
    """Whether titan-run compiles the loss of `plan` (`loss_kind` is ``compiled``)."""
    return loss_kind(plan, workload) == "compiled"


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; `logits` may be a vocab-sharded DTensor (call inside `loss_parallel()`).

    bf16 training keeps an fp32 loss: every kind computes the log-softmax in fp32 (`set_loss`).
    """
    if isinstance(logits, DTensor):
        return _eager_cross_entropy(logits, labels)
    if _LOSS["kind"] == "compiled":
        return _LOSS["compiled"](logits, labels)
    if _LOSS["kind"] == "fused" and not is_type_checking():    # (the checker types the plain ops one by one)
        return fused_cross_entropy(logits, labels)
    return _eager_cross_entropy(logits, labels)


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a loss that may be a replicated DTensor."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


__all__ = ["LOSS_KINDS", "apply_tp", "cross_entropy", "loss_compiled", "loss_kind", "loss_parallel",
           "loss_value", "set_loss"]
