"""Tensor parallel with sequence parallel (Megatron-LM style, via DTensor).

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
blocks + FSDP trains silently wrong on torch 2.13/2.14 (TORCH_ON_CPU.md item 9c).

Mixture-of-experts blocks (``block.moe_enabled``): only attention is
TP-sharded.  The MoE layer is token-wise, so it runs on the sequence-parallel
local tokens (``ffn_norm`` hands over a plain local tensor) with router,
routed and shared experts replicated over tp -- no TP communication.  Each tp
rank then holds gradients for different tokens: ``moe_grads.py`` sums them
over tp after backward.

Head counts are read from shapes by the model, so local (column-sharded)
projections need no model change.  Works on a pipeline stage: modules set to
``None`` are skipped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)


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
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
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


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; `logits` may be a vocab-sharded DTensor (call inside `loss_parallel()`).

    Logits are upcast to fp32 first (bf16 training keeps an fp32 loss).
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a loss that may be a replicated DTensor."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


__all__ = ["apply_tp", "cross_entropy", "loss_parallel", "loss_value"]
