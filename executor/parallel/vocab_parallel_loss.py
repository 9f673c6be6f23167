"""The vocab-parallel cross-entropy as one autograd Function, for erasure mode (the checker off).

``spmd_tensor_parallel.vocab_parallel_cross_entropy`` writes the loss of vocab-sharded logits as
typed ops (max, shift, exp-sum and the label's logit, each partial sum all-reduced P -> I), and
autograd then back-propagates through each: the gather of the label logits makes a zero
``[tokens, V/tp]`` tensor, scatters into it and adds it to the exp path's gradient.  Here the
same forward runs under ``no_grad`` (the two per-token sums go in ONE all-reduce) and backward
is the closed form ``softmax * g/N`` minus ``g/N`` at each token's label, computed with the
same operations in the same order as autograd's chain (mean -> log -> sum -> exp, and the
label's scatter-add), so the gradient is bitwise the typed version's; one [tokens, V/tp]
temporary instead of three.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy of vocab-sharded fp32 logits ``[N, V/tp]`` (this rank: rows rank*V/tp ...)."""

    @staticmethod
    def forward(ctx, logits, labels, group, rank):
        rows = logits.shape[-1]
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - m.unsqueeze(-1)
        e = shifted.exp()
        local = labels - rank * rows
        outside = (local < 0) | (local >= rows)
        idx = local.clamp(0, rows - 1).unsqueeze(-1)
        sums = torch.stack([e.sum(dim=-1), shifted.gather(-1, idx).squeeze(-1).masked_fill(outside, 0.0)])
        dist.all_reduce(sums, group=group)       # [sum of exp, the label's shifted logit] per token, summed over tp
        sum_exp, picked = sums[0], sums[1]
        ctx.save_for_backward(e, sum_exp, idx, outside)
        return (sum_exp.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        e, sum_exp, idx, outside = ctx.saved_tensors
        n = sum_exp.numel()
        g_tok = grad.expand(n) / n                          # MeanBackward
        grad_logits = e * (g_tok / sum_exp).unsqueeze(-1)   # LogBackward, SumBackward, ExpBackward
        grad_logits.scatter_add_(-1, idx, (-g_tok).masked_fill(outside, 0.0).unsqueeze(-1))   # the label's logit
        return grad_logits, None, None, None


__all__ = ["VocabParallelCrossEntropy"]
