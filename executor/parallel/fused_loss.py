"""Mean token cross-entropy of plain-tensor logits as one autograd Function: titan-run's eager loss.

``F.cross_entropy(logits.float())`` keeps the fp32 log-softmax output for backward (4 bytes per logit,
whatever the logits' dtype), and its backward holds two more fp32 logit-sized tensors (the log-softmax
gradient and the upcast's input gradient) before the cast back: 12 bytes per logit at the turn for a
bf16 run.  This Function keeps the logits themselves (the LM head's output, which the loss would
otherwise free: e bytes per logit) and the labels; forward takes each token's fp32 log-softmax a block
of tokens at a time, backward rebuilds the block's fp32 softmax and writes the gradient in the logits'
dtype (in place when that is fp32), so the turn adds e bytes per logit plus, below fp32, one block's fp32
temporary.  What the cost model charges for a fused loss (``cost_models/memory.py`` ``logit_bytes``);
measured in tests/test_compiled_loss.py.

Forward computes the same fp32 log-softmax as the upcast path, and backward its gradient (softmax minus
the label's one-hot, times g / N), so loss and gradient equal the upcast path's to fp32 rounding; on
this machine's CPU it is within noise of it on small vocabularies and faster on large ones
(docs/memory_audit.md).  Labels equal to ``IGNORE_INDEX`` count neither in the sum nor in the mean, as
with ``F.cross_entropy``.
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100

# tokens per block: a block's fp32 temporaries stay under BLOCK_ELEMENTS logits (64 MiB)
BLOCK_ELEMENTS = 1 << 24


def _blocks(n_tokens: int, vocab: int):
    step = max(1, BLOCK_ELEMENTS // max(vocab, 1))
    for start in range(0, n_tokens, step):
        yield start, min(start + step, n_tokens)


class FusedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits ``[N, V]`` (any float dtype) against labels ``[N]``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n, vocab = logits.shape
        keep = labels != IGNORE_INDEX
        safe = torch.where(keep, labels, torch.zeros_like(labels))
        token_logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        for a, b in _blocks(n, vocab):     # the label's fp32 log-probability, one block's log-softmax at a time
            logp = torch.log_softmax(logits[a:b], dim=-1, dtype=torch.float32)
            token_logp[a:b] = logp.gather(1, safe[a:b].unsqueeze(1)).squeeze(1)
        count = keep.sum()
        ctx.save_for_backward(logits, safe, keep, count)
        return -(token_logp * keep).sum() / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, safe, keep, count = ctx.saved_tensors
        n, vocab = logits.shape
        scale = (grad.float() / count) * keep                    # d loss / d token loss, 0 where ignored
        out = torch.empty_like(logits)
        in_place = logits.dtype == torch.float32                  # fp32: computed in the gradient itself
        for a, b in _blocks(n, vocab):
            p = out[a:b] if in_place else torch.empty(b - a, vocab, dtype=torch.float32, device=logits.device)
            torch.softmax(logits[a:b], dim=-1, dtype=torch.float32, out=p)
            p.mul_(scale[a:b].unsqueeze(-1))                     # softmax * g / N
            p.scatter_add_(1, safe[a:b].unsqueeze(1), -scale[a:b].unsqueeze(1))   # minus g / N at the label
            if not in_place:
                out[a:b] = p
        return out, None


def fused_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of plain-tensor logits ``[..., V]`` and labels ``[...]`` (FusedCrossEntropy)."""
    return FusedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


__all__ = ["FusedCrossEntropy", "IGNORE_INDEX", "fused_cross_entropy"]
