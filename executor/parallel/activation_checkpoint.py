"""Activation checkpointing per transformer block.

* ``full``: the whole block is recomputed in backward (only its input is saved).
* ``selective``: op-level selective checkpointing (Korthikanti et al. 2022)
  that saves the output of *every* matmul, of the attention kernel and of the
  collectives (``_SAVE_NAMES``); everything else (norms, RoPE, SiLU, residual
  adds and other elementwise ops) is recomputed.  No matmul and no collective
  is recomputed, and the many cheap, memory-heavy elementwise activations are
  dropped.  This is the cost model's ``workload.selective_ac: matmul`` (the
  default, ``cost_models/memory.py``); it is not TorchTitan's "op" policy,
  which also recomputes every second ``mm`` (``selective_ac: op``).
  tests/test_selective_ac.py counts the bytes it keeps against the cost model.
* ``none``: nothing.

Wrapping uses ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``);
the wrapper adds ``_checkpoint_wrapped_module.`` to parameter names, and
removes it again in ``state_dict()``.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_SAVE_NAMES = (
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.linear.default",
    "aten._scaled_mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.all_to_all_single.default",
)


def _save_list() -> set:
    ops = set()
    for name in _SAVE_NAMES:
        ns, op, overload = name.split(".")
        try:
            ops.add(getattr(getattr(getattr(torch.ops, ns), op), overload))
        except (AttributeError, RuntimeError):
            pass   # op not present in this torch build
    return ops


def _policy(save: set, ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE


def wrap_block(block: nn.Module, mode: str) -> nn.Module:
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if mode == "selective":
        save = _save_list()
        return checkpoint_wrapper(block, preserve_rng_state=False,
                                  context_fn=partial(create_selective_checkpoint_contexts,
                                                     partial(_policy, save)))
    raise ValueError(f"plan key 'ac' must be one of none, selective, full; got {mode!r}")


def apply_ac(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, wrap_block(block, mode))
