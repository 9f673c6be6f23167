"""Activation checkpointing per transformer block.

* ``full``: the whole block is recomputed in backward (only its input is saved).
* ``selective``: op-level selective checkpointing (Korthikanti et al. 2022), by
  the workload's ``selective_ac`` policy:

  - ``matmul`` (titan-run's default): saves the output of *every* matmul, of the
    attention kernel and of the collectives (``_SAVE_NAMES``); everything else
    (norms, RoPE, SiLU, residual adds and other elementwise ops) is recomputed.
    No matmul and no collective is recomputed, and the many cheap, memory-heavy
    elementwise activations are dropped.
  - ``op`` (TorchTitan's per-op policy): as ``matmul``, but the 2nd, 4th, ...
    matmul of the block's forward (in this model: wk, wo, w3) is recomputed too,
    and of the collectives only the reduce-scatters are kept (an all-gathered
    input is gathered again when a matmul that needs it is recomputed).  Each
    checkpointed call counts its matmuls afresh, its forward and its recompute
    separately, so both make the same decisions.  About half the matmul outputs
    less for one recomputed matmul in two.

  tests/test_selective_ac.py counts the bytes each keeps against the cost model
  (``cost_models/activations.py``, ``workload.selective_ac``).
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
    return _ops(_SAVE_NAMES)


# the matmuls the 'op' policy counts (its every-second rule) and the collectives it keeps
_MATMUL_NAMES = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._scaled_mm.default")
_OP_DROPPED_COLLECTIVES = ("_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.all_reduce.default",
                           "_c10d_functional.all_to_all_single.default")
POLICIES = ("matmul", "op")


def _ops(names) -> set:
    ops = set()
    for name in names:
        ns, op, overload = name.split(".")
        try:
            ops.add(getattr(getattr(getattr(torch.ops, ns), op), overload))
        except (AttributeError, RuntimeError):
            pass   # op not present in this torch build
    return ops


def _policy(save: set, ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE


def _op_policy(save: set, matmuls: set, counts: dict, ctx, func, *args, **kwargs):
    """TorchTitan's per-op rule: of the saved ops, the 2nd, 4th, ... matmul of the call is recomputed.
    `counts` is this checkpointed call's own (forward and recompute counted apart)."""
    if func in matmuls:
        key = ctx.is_recompute
        counts[key] = counts.get(key, 0) + 1
        if counts[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE


def _op_contexts(save: set, matmuls: set):
    """A fresh pair of selective-checkpoint contexts per checkpointed call, with its own matmul count."""
    return create_selective_checkpoint_contexts(partial(_op_policy, save, matmuls, {}))


def wrap_block(block: nn.Module, mode: str, policy: str = "matmul") -> nn.Module:
    """`block` checkpointed by `mode` (``full`` or ``selective``; ``selective`` keeps what `policy` saves)."""
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if mode == "selective":
        if policy == "matmul":
            context_fn = partial(create_selective_checkpoint_contexts, partial(_policy, _save_list()))
        elif policy == "op":
            context_fn = partial(_op_contexts, _save_list() - _ops(_OP_DROPPED_COLLECTIVES), _ops(_MATMUL_NAMES))
        else:
            raise ValueError(f"workload key 'selective_ac' must be one of {', '.join(POLICIES)} for titan-run; "
                             f"got {policy!r}")
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)
    raise ValueError(f"plan key 'ac' must be one of none, selective, full; got {mode!r}")


def apply_ac(model: nn.Module, mode: str, policy: str = "matmul") -> None:
    """Checkpoint every block of `model.layers` by `mode` (and, for ``selective``, the saving `policy`)."""
    if mode == "none":
        return
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, wrap_block(block, mode, policy))
