"""Context parallel: split each sequence over the ``cp`` mesh axis, ring attention.

Applied from outside the model (DESIGN.md: PP split, TP/SP, **CP**, EP, AC,
compile, FSDP):

* :func:`apply_cp` swaps every ``block.attention.sdpa`` for
  :class:`RingAttention` over the CP group (see ``ring_attention.py`` for the
  algorithm, masks, GQA and backward).  The ring is excluded from compiled
  regions (``torch.compiler.disable``), so per-block compile graph-breaks
  around it instead of deadlocking.
* :func:`cp_shard_batch` gives each CP rank its load-balanced share of every
  sequence: the sequence is cut into ``2*cp`` chunks and rank ``r`` takes
  chunks ``r`` and ``2cp-1-r`` (head-tail), so every rank does the same amount
  of causal-attention work.  The returned positions go to
  ``model(tokens, positions)`` for RoPE.

Why not ``torch.distributed.tensor.experimental.context_parallel``: on CPU it
fails (no sharding strategy for ``aten._scaled_dot_product_flash_attention_for_cpu``;
see docs/torch_on_cpu.md §5), and its buffer-swapping context manager is
hard to combine with pipeline parallel.  Our ring is a plain autograd
function over P2P sends, identical on gloo and NCCL.

On the ``spmd_types`` backend the same ring runs as a typed region
(``spmd_context_parallel.py``: :class:`RingAttention`'s ``function`` is then the
typed autograd function, and the batch and positions are typed V over cp).

Loss/gradients: each CP rank's loss is the mean over its local tokens, which
all have the same count, so averaging gradients over the CP ranks (FSDP over
the flattened dp*cp mesh does this) gives the gradient of the global mean.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from executor.parallel.ring_attention import _RingAttentionFn, ring_attention


class RingAttention(nn.Module):
    """Drop-in for ``CoreAttention``: causal attention over the CP ring."""

    function = _RingAttentionFn     # the ring's autograd function (the spmd_types backend's subclass: typed)

    def __init__(self, cp_mesh: DeviceMesh, kernel: str | None = None):
        super().__init__()
        self.cp_mesh = cp_mesh
        self.kernel = kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.cp_mesh.get_group(), self.kernel, self.function)

    def extra_repr(self) -> str:
        return f"cp={self.cp_mesh.size()}, kernel={self.kernel or 'auto'}"


def _blocks(model: nn.Module):
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("apply_cp: model has no 'layers' (expected the executor's Transformer contract)")
    return layers.values() if isinstance(layers, nn.ModuleDict) else layers


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, kernel: str | None = None,
             attention: type[RingAttention] = RingAttention) -> None:
    """Swap every ``block.attention.sdpa`` for ring attention (`attention`, a ``RingAttention`` class) over
    ``cp_mesh``'s group."""
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_cp: cp_mesh must be 1-D, got {cp_mesh.ndim} dims")
    for block in _blocks(model):
        attn = getattr(block, "attention", None)
        if attn is None or not hasattr(attn, "sdpa"):
            raise ValueError(f"apply_cp: block {type(block).__name__} has no attention.sdpa to swap")
        attn.sdpa = attention(cp_mesh, kernel)


def head_tail_indices(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions held by ``cp_rank``: chunks r and 2cp-1-r of 2cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallel needs seq_len divisible by 2*cp = {2 * cp}; got seq_len "
                         f"{seq_len} (workload key 'seq_len' or plan key 'cp')")
    c = seq_len // (2 * cp)
    a, b = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device),
                      torch.arange(b * c, (b + 1) * c, device=device)])


def cp_shard_batch(tokens: torch.Tensor, labels: torch.Tensor, cp_mesh: DeviceMesh
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local_tokens, local_labels, local_positions): this CP rank's head-tail share along dim 1."""
    cp, r = cp_mesh.size(), cp_mesh.get_local_rank()
    if tokens.shape[:2] != labels.shape[:2]:
        raise ValueError(f"cp_shard_batch: tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} differ")
    pos = head_tail_indices(tokens.shape[1], cp, r, device=tokens.device)
    return (tokens.index_select(1, pos).contiguous(), labels.index_select(1, pos).contiguous(),
            pos.to(torch.int64))
