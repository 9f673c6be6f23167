"""Multi-head latent attention (DeepSeek-V2 arXiv:2405.04434 Sec. 2.1; DeepSeek-V3), plain PyTorch.

Per token ``x`` (dim ``D``), with ``H`` heads, ``d_n = qk_nope_head_dim``,
``d_r = qk_rope_head_dim``, ``d_v = v_head_dim``, ``r_kv = kv_lora_rank``:

* queries: ``q = wq(x)`` when ``q_lora_rank == 0``, else the low-rank path
  ``q = wq_b(q_norm(wq_a(x)))`` (``wq_a: D -> q_lora_rank``, RMSNorm on the
  compressed query); ``q`` is ``[H, d_n + d_r]`` per token, split into a
  "nope" part and a rotary part;
* keys/values: ``wkv_a(x)`` gives the compressed latent ``c`` (``r_kv``) and
  one rotary key ``k_r`` (``d_r``) shared by all heads; ``c`` is normalized
  (``kv_norm``, RMSNorm) and up-projected by ``wkv_b`` to per-head ``k_nope``
  (``d_n``) and ``v`` (``d_v``);
* RoPE is applied to ``q_r`` and ``k_r`` only (decoupled RoPE, Sec. 2.1.3);
  ``k = [k_nope, k_r]`` per head; causal SDPA with query/key width
  ``d_n + d_r`` and value width ``d_v`` (scale ``1/sqrt(d_n + d_r)``, the
  SDPA default for that query width); ``wo: H*d_v -> D``.

Training materializes the up-projected K and V (no weight absorption), as
TorchTitan does.  DeepSeek's YaRN rope scaling is not modelled (plain RoPE
with ``rope_theta``).

Executor contract as for ``llama.Attention``: ``self.sdpa`` is the swappable
core ``(q, k, v) -> out`` on ``[b, heads, s, d]`` (here v's width differs from
q/k's); head counts are read from shapes, so tensor parallel can column-shard
``wq``/``wq_b``/``wkv_b`` by heads and row-shard ``wo`` from outside.  The
parameter names (``wq`` | ``wq_a``/``q_norm``/``wq_b``, ``wkv_a``, ``kv_norm``,
``wkv_b``, ``wo``) are the ones `cost_models.flops.attention_matmuls` counts.
"""
from __future__ import annotations

import torch
from torch import nn

from cost_models.specs import ModelSpec

from .layers import CoreAttention, RMSNorm, apply_rope


class MLAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.q_lora_rank = spec.q_lora_rank
        self.kv_lora_rank = spec.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        h = spec.n_heads
        if self.q_lora_rank:
            self.wq_a = nn.Linear(spec.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=spec.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, h * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(spec.dim, h * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(spec.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=spec.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, spec.dim, bias=False)
        self.sdpa = CoreAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, s, dim]; cos/sin [s, rope_dim/2] (RoPE tables of this rank's positions)."""
        b, s, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank else self.wq(x)
        q = q.view(b, s, -1, self.qk_dim)                                   # [b, s, heads, d_n + d_r]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)

        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin)                  # [b, s, 1, d_r], shared by heads
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)

        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))   # [b, heads, s, d_v]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))
