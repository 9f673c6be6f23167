"""Mixture-of-experts feed-forward (DeepSeek-V3 / Qwen3-MoE style), plain PyTorch.

* `Router`: scores = softmax or sigmoid(x W_g); top-k experts per token chosen
  on the scores (plus, with the auxiliary-loss-free option, a per-expert bias
  that only affects the choice — DeepSeek-V3, arXiv:2412.19437 Sec. 2.1.2);
  the gate weights are the chosen scores, optionally renormalized and scaled.
  The switch-style auxiliary load-balancing loss ``E * sum_i f_i * P_i``
  (Fedus et al. 2021, Eq. 4) is kept in ``router.aux_loss``; each forward's
  counts and aux loss are appended to ``router.step_history`` for the logs.
* `AuxLossGrad`: how the auxiliary loss trains, as Megatron-LM's
  ``MoEAuxLossAutoScaler`` does: the identity on the MoE layer's output in
  forward; in backward it also hands ``aux_loss`` the gradient
  ``aux_loss_grad_scale`` (the loop sets ``coef / n_moe_layers`` and its
  micro-batch / tp scaling on each `MoEFeedForward`; 0 = off).  So the aux loss
  never passes through the loss function, which is what makes it work under
  pipeline parallel (the schedule owns the loss and only the last stage has one).
* `GroupedExperts`: the routed experts' SwiGLU weights stored as grouped
  tensors ``w1, w3: [E, dim, hidden]``, ``w2: [E, hidden, dim]``, applied to
  tokens sorted by expert with one grouped matmul (``torch._grouped_mm`` on
  GPUs that have it, else a padded batched matmul) — no Python loop over
  experts. Dropless: every token reaches its experts.
* `MoEFeedForward`: router -> sort tokens by expert -> ``self.experts`` ->
  weighted combine, plus always-active shared experts.

Expert parallelism (executor/parallel/) wraps ``moe.experts`` from outside:
it receives tokens sorted by global expert id with the per-expert counts,
exchanges them with all-to-all so each rank runs its local experts, and sends
the results back. No parallel code here.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.specs import ModelSpec

from .layers import FeedForward, silu_product, rebuilds, rebuilt_input, swiglu


class Router(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n_experts, self.top_k = spec.n_experts, spec.top_k
        self.score_func, self.route_norm, self.route_scale = spec.score_func, spec.route_norm, spec.route_scale
        self.gate = nn.Linear(spec.dim, spec.n_experts, bias=False)
        self.use_bias = spec.load_balance_bias
        # expert_bias is adjusted outside autograd (aux-loss-free balancing); it is a
        # non-trainable parameter so that it is checkpointed and sharded like one.
        self.expert_bias = nn.Parameter(torch.zeros(spec.n_experts), requires_grad=False) if self.use_bias else None
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        # (tokens per expert, aux loss) of each forward since the training loop last cleared it;
        # forwards recomputed by activation checkpointing inside backward are not recorded twice
        # (the loop reads the last n_microbatches entries: torch's pipeline stages run extra
        # shape-inference forwards, on uninitialized buffers, in their first step)
        self.step_history: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, dim] -> (weights [tokens, k], expert ids [tokens, k])."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choose = scores + self.expert_bias if self.expert_bias is not None else scores
        _, idx = choose.topk(self.top_k, dim=-1)
        w = scores.gather(-1, idx)
        if self.route_norm and self.top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.route_scale
        counts = tokens_per_expert(idx.flatten(), self.n_experts)
        self.tokens_per_expert = counts.detach()
        # Switch-Transformer load-balancing loss: E * sum_i f_i * P_i
        f = counts.to(scores.dtype) / idx.numel()
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        self.aux_loss = self.n_experts * (f.detach() * p).sum()
        if not in_backward():
            self.step_history.append((self.tokens_per_expert, self.aux_loss.detach()))
        return w.to(x.dtype), idx


class AuxLossGrad(torch.autograd.Function):
    """Identity on `out`; backward also gives `aux_loss` the gradient `scale` (d(scale*aux)/d aux)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_out, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def tokens_per_expert(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[E] int64 tokens routed to each expert, from the flat expert ids: a scatter-add of ones, whose
    output shape is [E] whatever the ids (``bincount``'s depends on their values: FakeTensor refuses it)."""
    return torch.zeros(n_experts, dtype=torch.int64, device=expert_ids.device).scatter_add_(
        0, expert_ids, torch.ones_like(expert_ids))


def in_backward() -> bool:
    """True inside autograd's backward (an activation-checkpointing recompute of the forward)."""
    return torch._C._current_graph_task_id() != -1


def _grouped_mm_available(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


class GroupedExperts(nn.Module):
    """E SwiGLU experts as grouped weights; forward on tokens sorted by expert."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.rebuild_product = False      # the down projection's input rebuilt in backward (layers.rebuilt_input)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] sorted by expert; counts: [E] tokens per expert."""
        return grouped_swiglu(x, counts, self.w1, self.w2, self.w3, rebuild=rebuilds(self, x))


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor, rebuild: bool = False) -> torch.Tensor:
    """SwiGLU of each expert on its contiguous run of `x` (runs given by `counts`); `rebuild`: the down
    projection saves its input as a recipe (`layers.rebuilt_input`)."""
    if x.shape[0] == 0:  # keep the weights *and x* in the graph so every rank's backward matches
        # (under expert parallel x comes from an all-to-all: if no gradient path led back to it,
        # a rank that received no tokens would skip that all-to-all's backward and its peers hang)
        return x.new_zeros(0, w2.shape[-1]) + 0 * (w1.sum() + w2.sum() + w3.sum() + x.sum())
    if _grouped_mm_available(x):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate, up = torch._grouped_mm(x, w1, offs=offs), torch._grouped_mm(x, w3, offs=offs)
        h = swiglu(gate, up)
        with rebuilt_input(h, silu_product, gate, up) if rebuild else contextlib.nullcontext():
            return torch._grouped_mm(h, w2, offs=offs)
    return _padded_bmm_swiglu(x, counts, w1, w2, w3, rebuild)


def _padded_bmm_swiglu(x, counts, w1, w2, w3, rebuild: bool = False):
    """Scatter tokens into [E, max_count, dim], one bmm per matrix, gather back."""
    e = counts.shape[0]
    counts = counts.to(torch.int64)
    cap = int(counts.max())
    expert_of = torch.repeat_interleave(torch.arange(e, device=x.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert_of]
    padded = x.new_zeros(e, cap, x.shape[-1])
    padded[expert_of, slot] = x
    gate, up = torch.bmm(padded, w1), torch.bmm(padded, w3)
    h = swiglu(gate, up)
    with rebuilt_input(h, silu_product, gate, up) if rebuild else contextlib.nullcontext():
        out = torch.bmm(h, w2)
    return out[expert_of, slot]


class MoEFeedForward(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.router = Router(spec)
        self.experts = GroupedExperts(spec.n_experts, spec.dim, spec.moe_ffn_hidden)
        self.shared_experts = (FeedForward(spec.dim, spec.moe_ffn_hidden * spec.n_shared_experts)
                               if spec.n_shared_experts else None)
        # gradient scale of the auxiliary loss (set by the training loop, moe_step.set_aux_loss_scale)
        self.aux_loss_grad_scale = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        out = self.routed(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)

    @torch.compiler.disable
    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """Router -> sort by expert -> experts -> weighted combine (+ the aux-loss gradient hook).

        Kept out of torch.compile regions: its shapes depend on the routing (tokens per
        expert), and the expert-parallel all-to-all needs the split sizes on the host, so a
        compiled block would graph-break here and recompile for new counts every step
        (measured: moe-debug FSDPxEP 2 with per-block compile, 7 s/step vs 0.2 s eager).
        """
        weights, idx = self.router(x)                           # [T, k]
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)                # sort (token, slot) pairs by expert
        token_of = order // idx.shape[1]
        counts = tokens_per_expert(flat, self.router.n_experts)
        routed = self.experts(x[token_of], counts)              # [T*k, dim], sorted by expert
        routed = routed * weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, token_of, routed.to(x.dtype))
        if self.aux_loss_grad_scale > 0 and torch.is_grad_enabled() and self.router.aux_loss.requires_grad:
            out = AuxLossGrad.apply(out, self.router.aux_loss, self.aux_loss_grad_scale)
        return out
