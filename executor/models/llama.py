"""A Llama-3-style decoder in plain PyTorch (RoPE, GQA, SwiGLU, RMSNorm, SDPA).

No parallel code lives here: the parallelisms in `executor/parallel/` act on
this module from outside.  The contract they rely on:

* ``model.tok_embeddings``, ``model.layers`` (an ``nn.ModuleDict`` keyed
  ``"0".."L-1"``, so a pipeline stage can delete layers and keep the others'
  names), ``model.norm``, ``model.output``; any of tok_embeddings / norm /
  output may be set to ``None`` (a pipeline stage), and then the input or
  output is the hidden state.
* ``forward(tokens, positions=None)``: ``positions`` (1-D, the sequence
  positions of this rank's tokens) default to ``arange(tokens.shape[1])``;
  context parallel and pipeline stages pass them explicitly.
* Each attention module's core is ``block.attention.sdpa``, a parameter-free
  module ``(q, k, v) -> out`` on ``[batch, heads, seq, head_dim]`` tensors
  (k, v with the kv heads); context parallel swaps it for ring attention.
* Head counts are read from tensor shapes, so column-sharded projections
  (tensor parallel) work unchanged.
* No buffers: RoPE tables are computed from ``positions`` on the fly (with
  ``rope_scaling: llama3``, Llama 3.1's frequency scaling, `layers.llama3_inv_freq`).
* ``tie_embeddings``: ``output.weight`` *is* ``tok_embeddings.weight`` (one
  parameter, named ``tok_embeddings.weight`` by ``named_parameters``; the state
  dict names it twice).  Layouts that would put the two on different ranks or
  shard them apart (pp > 1, tp > 1) are refused by ``executor/config.py``.
* ``attention: mla`` specs get `mla.MLAttention` (DeepSeek multi-head latent
  attention) as ``block.attention``; RoPE tables then cover qk_rope_head_dim.
* Mixture-of-experts specs get `moe.MoEFeedForward` as ``block.feed_forward``
  in the layers after the first ``n_dense_layers`` (``block.moe_enabled``).
* ``init_rule(fqn)`` gives each parameter's initialization; the executor's
  initializer applies it to full-size tensors from a per-parameter seed, so
  the weights do not depend on the layout.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from cost_models.specs import ModelSpec

from .layers import CoreAttention, FeedForward, apply_rope, make_norm, rope_cos_sin
from .mla import MLAttention
from .moe import MoEFeedForward


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.head_dim = spec.head_dim
        self.wq = nn.Linear(spec.dim, spec.n_heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=False)
        self.wv = nn.Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=False)
        self.wo = nn.Linear(spec.n_heads * spec.head_dim, spec.dim, bias=False)
        self.sdpa = CoreAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, spec: ModelSpec):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = make_norm(spec)
        if spec.attention == "mla":
            self.attention = MLAttention(spec)
        else:
            self.attention = Attention(spec)
        self.ffn_norm = make_norm(spec)
        self.moe_enabled = spec.is_moe and layer_id >= spec.n_dense_layers
        if self.moe_enabled:
            self.feed_forward = MoEFeedForward(spec)
        else:
            self.feed_forward = FeedForward(spec.dim, spec.ffn_hidden, spec.mlp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.attention not in ("gqa", "mla"):
            raise ValueError(f"model '{spec.name}': attention '{spec.attention}' is not supported by the "
                             "executor's Transformer (gqa | mla)")
        self.spec = spec
        # RoPE width: the whole head (GQA) or only the decoupled rotary part (MLA)
        self.rope_dim = spec.qk_rope_head_dim if spec.attention == "mla" else spec.head_dim
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, spec) for i in range(spec.n_layers)})
        self.norm = make_norm(spec)
        self.output = nn.Linear(spec.dim, spec.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """``tie_embeddings``: the head's weight is the embedding's (one parameter, as the cost model counts it)."""
        if self.spec.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # to_empty() / .to() replace each module's parameters one by one, which would untie them; FSDP2
        # resets a shared parameter from its first module (tok_embeddings), so re-tying keeps it consistent
        out = super()._apply(fn, recurse)
        self.tie_weights()
        return out

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_cos_sin(positions, self.rope_dim, self.spec.rope_theta,
                                h.dtype if h.is_floating_point() else torch.float32, self.spec)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_fqn(self, fqn: str) -> str:
        """The parameter whose values `fqn` takes at initialization: a tied head without its embedding (the last
        of several pipeline stages holds a copy of the embedding, kept equal by summing the two gradients,
        ``parallel/pipeline.py: TiedEmbedding``) starts as the embedding does."""
        if self.spec.tie_embeddings and fqn == "output.weight" and self.tok_embeddings is None:
            return "tok_embeddings.weight"
        return fqn

    def init_rule(self, fqn: str) -> tuple[str, float]:
        """('normal', std) | ('trunc_normal', std) | ('ones', 0) | ('zeros', 0) for a parameter name.

        Embeddings N(0, 1); projections truncated N(0, 0.02); output
        projections of each block (wo, w2) scaled by 1/sqrt(2*(layer+1))
        (depth-scaled init as in TorchTitan); the LM head N(0, dim^-1/2);
        norms ones; a tied embedding (also the head) N(0, dim^-1/2) truncated.
        """
        if fqn.endswith("norm.weight"):
            return ("ones", 0.0)
        if fqn.endswith("router.expert_bias"):
            return ("zeros", 0.0)
        if fqn.startswith("tok_embeddings"):   # tied: the weight is the LM head too, so the head's scale
            return ("trunc_normal", self.spec.dim ** -0.5) if self.spec.tie_embeddings else ("normal", 1.0)
        if fqn.startswith("output"):
            return ("trunc_normal", self.spec.dim ** -0.5)
        if fqn.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2",
                         "shared_experts.w2.weight")):
            layer = int(fqn.split(".")[1])
            return ("trunc_normal", 0.02 / math.sqrt(2 * (layer + 1)))
        return ("trunc_normal", 0.02)


__all__ = ["Attention", "CoreAttention", "FeedForward", "Transformer", "TransformerBlock", "apply_rope",
           "make_norm", "rope_cos_sin"]
