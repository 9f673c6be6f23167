"""Causal ring attention over a context-parallel process group (gloo or NCCL).

Layout (head-tail load balancing, as in TorchTitan / zigzag ring attention):
the global sequence of length ``S`` is cut into ``2*cp`` chunks of ``c =
S/(2cp)`` tokens; CP rank ``r`` holds chunks ``r`` and ``2cp-1-r``
concatenated, so its local q/k/v are ``[b, heads, 2c, head_dim]``.

Forward: K/V travel around the ring (rank r sends to r+1, receives from r-1)
with ``batch_isend_irecv``; the transfer for step i+1 overlaps the compute of
step i.  At step ``i`` rank ``r`` holds the K/V of rank ``src = (r-i) mod cp``.
For a pair (q chunk a, kv chunk b) the causal mask is full when a > b,
causal-diagonal when a == b and empty when a < b, which for this layout gives
three cases with equal work:

* ``i == 0`` (own K/V): plain causal attention over the local 2c tokens
  (chunk r precedes chunk 2cp-1-r, so the local order is the global order);
* ``src < r``: all local q attend, unmasked, to the *first* kv chunk only;
* ``src > r``: only the *second* q chunk attends, unmasked, to both kv chunks.

Each block returns its output and log-sum-exp; blocks are merged with the
online-softmax rule (``lse = logaddexp(lse, lse_b)``, ``out = out*e^(lse_old-lse)
+ out_b*e^(lse_b-lse)``) in fp32, so bf16 inputs lose nothing in the merge.

Backward: per block, the kernel's backward is called with the *global* output
and log-sum-exp (standard flash-attention trick: P = exp(S - lse_global) is the
block's slice of the global softmax), which gives that block's exact dQ, dK,
dV.  dQ accumulates locally; K/V circulate again, and the dK/dV accumulators
(fp32) travel with them one hop behind: the partial dK/dV of block ``src`` is
at rank ``src+i`` after step ``i``, and the last hop brings the complete
gradient back to its owner.

MLA (value width != query/key width): the ring and the ``math`` kernel take
any widths; the flash kernels get zero-padded copies (``_pad_heads``, exact).

GQA: k/v keep their ``kv_heads`` everywhere: on the wire (less traffic), in
what the autograd function saves, and in every block kernel -- the flash
kernels take fewer K/V heads natively (the aten CPU flash op and its backward,
as SDPA's ``enable_gqa`` runs them: dK/dV come back at ``kv_heads``, summed
over each group inside the kernel; the CUDA one is FlashAttention-2's
``num_heads_k``, which SDPA's flash check admits for GQA), and ``math``
broadcasts over the group.  No ``n_heads``-wide copy of K/V is made.

Per-block kernels (``TITAN_RING_KERNEL`` env var overrides the choice):

* ``cpu_flash`` (default on CPU): ``aten._scaled_dot_product_flash_attention_for_cpu``
  and its ``_backward``; they return/accept the log-sum-exp.
* ``cuda_flash`` (default on CUDA for fp16/bf16, head_dim <= 256):
  ``aten._scaled_dot_product_flash_attention`` / ``_backward``.
* ``math`` (fallback, and CUDA fp32): plain matmul-softmax in fp32 that
  returns the log-sum-exp; O(seq^2) memory per block, exact.

The ring is excluded from torch.compile regions (``torch.compiler.disable``):
a ring inside a compiled region deadlocked (ranks waiting in different
collectives).  On meta / fake tensors no communication happens (the local
K/V stand in for the remote ones), so shape inference and memory dry runs
work.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

aten = torch.ops.aten

KERNELS = ("cpu_flash", "cuda_flash", "math")


# --------------------------------------------------------------------------- kernels
class _BlockKernel:
    """fwd(q, k, v, causal) -> (out, lse fp32, aux); bwd(...) -> dq, dk, dv (kv heads)."""

    name = "base"

    def __init__(self, scale: float):
        self.scale = scale

    @staticmethod
    def _pad_heads(q, k, v, *vlike):
        """Zero-pad q/k and v (and `vlike`: dout, out) to one head width, for flash kernels that need
        equal q/k/v widths (MLA: v_head_dim != qk_nope + qk_rope).  Exact: zero q/k columns leave
        the scores unchanged (the scale is explicit), zero v columns give zero output columns that
        are cut off again; in backward, rowsum(dout * out) is unchanged."""
        dqk, dv = q.shape[-1], v.shape[-1]
        if dqk == dv:
            return (q, k, v, *vlike)
        d = max(dqk, dv)
        pad = lambda t: torch.nn.functional.pad(t, (0, d - t.shape[-1])) if t.shape[-1] < d else t  # noqa: E731
        return (pad(q), pad(k), pad(v), *(pad(t) for t in vlike))


class _MathKernel(_BlockKernel):
    """Matmul-softmax in fp32; GQA by broadcasting, no copies of k/v."""

    name = "math"

    def _scores(self, q, k, causal):
        b, h, sq, d = q.shape
        hk, sk = k.shape[1], k.shape[2]
        qf = q.float().reshape(b, hk, h // hk, sq, d)
        kf = k.float().unsqueeze(2)
        s = torch.matmul(qf, kf.transpose(-1, -2)) * self.scale
        if causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril_()
            s = s.masked_fill(~mask, float("-inf"))
        return qf, kf, s

    def fwd(self, q, k, v, causal):
        b, h, sq, _ = q.shape
        _, _, s = self._scores(q, k, causal)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.matmul(p, v.float().unsqueeze(2))
        return out.reshape(b, h, sq, -1), lse.reshape(b, h, sq), None

    def bwd(self, dout, q, k, v, out, lse, causal, aux):
        b, h, sq, d = q.shape
        hk = k.shape[1]
        qf, kf, s = self._scores(q, k, causal)
        p = torch.exp(s - lse.float().reshape(b, hk, h // hk, sq, 1))
        dof = dout.float().reshape(b, hk, h // hk, sq, -1)
        of = out.float().reshape(b, hk, h // hk, sq, -1)
        vf = v.float().unsqueeze(2)
        dv = torch.matmul(p.transpose(-1, -2), dof).sum(2)
        dp = torch.matmul(dof, vf.transpose(-1, -2))
        ds = p * (dp - (dof * of).sum(-1, keepdim=True))
        dq = torch.matmul(ds, kf) * self.scale
        dk = torch.matmul(ds.transpose(-1, -2), qf).sum(2) * self.scale
        return dq.reshape(b, h, sq, d), dk, dv


class _CpuFlashKernel(_BlockKernel):
    """The CPU flash kernel via aten; GQA K/V at kv heads (dK/dV returned so)."""

    name = "cpu_flash"

    def fwd(self, q, k, v, causal):
        dv = v.shape[-1]
        q, k, v = self._pad_heads(q, k, v)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=self.scale)
        return out[..., :dv], lse, None

    def bwd(self, dout, q, k, v, out, lse, causal, aux):
        dqk, dvw = q.shape[-1], v.shape[-1]
        q, k, v, dout, out = self._pad_heads(q, k, v, dout, out)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal,
            scale=self.scale)
        return dq[..., :dqk], dk[..., :dqk], dv[..., :dvw]


class _CudaFlashKernel(_BlockKernel):
    """FlashAttention-2 via aten (fp16/bf16 only); GQA K/V at kv heads.  Not run in CI (no GPU)."""

    name = "cuda_flash"

    def fwd(self, q, k, v, causal):
        dv = v.shape[-1]
        q, k, v = self._pad_heads(q, k, v)
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=self.scale)
        out, lse = res[0], res[1]
        # cum_seq_q, cum_seq_k, max_q, max_k, philox seed/offset (rng_state, unused)
        return out[..., :dv], lse, tuple(res[2:8])

    def bwd(self, dout, q, k, v, out, lse, causal, aux):
        dqk, dvw = q.shape[-1], v.shape[-1]
        q, k, v, dout, out = self._pad_heads(q, k, v, dout, out)
        cum_q, cum_k, _, _, seed, offset = aux
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), cum_q, cum_k,
            q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=self.scale)
        return dq[..., :dqk], dk[..., :dqk], dv[..., :dvw]


def choose_kernel(q: torch.Tensor, name: str | None = None) -> str:
    """Kernel name for these inputs: explicit name > TITAN_RING_KERNEL > device default."""
    name = name or os.environ.get("TITAN_RING_KERNEL") or None
    if name is not None:
        if name not in KERNELS:
            raise ValueError(f"ring attention kernel must be one of {', '.join(KERNELS)}; got {name!r}")
        return name
    if q.device.type == "cpu":
        return "cpu_flash"
    if (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0):
        return "cuda_flash"
    return "math"


def make_kernel(name: str, scale: float) -> _BlockKernel:
    return {"cpu_flash": _CpuFlashKernel, "cuda_flash": _CudaFlashKernel,
            "math": _MathKernel}[name](scale)


# --------------------------------------------------------------------------- ring P2P
def _is_fake(t: torch.Tensor) -> bool:
    if t.is_meta:
        return True
    return bool(is_fake(t))


class _Ring:
    """Send to the next rank and receive from the previous one, asynchronously."""

    def __init__(self, group: dist.ProcessGroup, fake: bool = False):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.fake = fake or self.size == 1
        if not self.fake:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: torch.Tensor):
        """Returns (works, recv_buffer); call wait() on the result before using the buffer."""
        recv = torch.empty_like(send)
        if self.fake:
            return [], recv
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return dist.batch_isend_irecv(ops), recv

    @staticmethod
    def wait(handle):
        works, recv = handle
        for w in works:
            w.wait()
        return recv


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, *likes: torch.Tensor):
    out, i = [], 0
    for t in likes:
        out.append(buf[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return out


# --------------------------------------------------------------------------- forward / backward
def _merge(out, lse, rows, o_b, lse_b):
    """Online-softmax merge of a block (o_b, lse_b) into out/lse rows (fp32, in place)."""
    lse_old = lse[:, :, rows]
    new = torch.logaddexp(lse_old, lse_b.float())
    out[:, :, rows] = (out[:, :, rows] * torch.exp(lse_old - new).unsqueeze(-1)
                       + o_b.float() * torch.exp(lse_b.float() - new).unsqueeze(-1))
    lse[:, :, rows] = new


def ring_forward(q, k, v, group, kernel: _BlockKernel, ring=None):
    """(out in q's dtype, lse fp32 [b, h, s], aux of the last kernel call); ``ring`` defaults to P2P over ``group``."""
    ring = ring or _Ring(group, fake=_is_fake(q))
    size, rank = ring.size, ring.rank
    b, h, s, d = q.shape
    if s % 2:
        raise ValueError(f"ring attention: local sequence length {s} must be even (two load-balanced chunks)")
    c = s // 2
    first, second = slice(0, c), slice(c, s)
    out = torch.zeros(b, h, s, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    k, v = k.contiguous(), v.contiguous()
    kv = _pack(k, v)
    aux = None
    for i in range(size):
        handle = ring.start(kv) if i < size - 1 else None
        src = (rank - i) % size
        kb, vb = _unpack(kv, k, v)
        if i == 0:
            o_b, lse_b, aux = kernel.fwd(q, kb, vb, True)
            out.copy_(o_b)
            lse.copy_(lse_b)
        elif src < rank:
            o_b, lse_b, aux = kernel.fwd(q, kb[:, :, first], vb[:, :, first], False)
            _merge(out, lse, slice(None), o_b, lse_b)
        else:
            o_b, lse_b, aux = kernel.fwd(q[:, :, second], kb, vb, False)
            _merge(out, lse, second, o_b, lse_b)
        if handle is not None:
            kv = ring.wait(handle)
    return out.to(q.dtype), lse, aux


def ring_backward(dout, q, k, v, out, lse, group, kernel: _BlockKernel, aux, ring=None):
    """(dq, dk, dv) for this rank's q/k/v; dK/dV travel the ring back to their owner."""
    ring = ring or _Ring(group, fake=_is_fake(q))
    size, rank = ring.size, ring.rank
    s = q.shape[2]
    c = s // 2
    first, second = slice(0, c), slice(c, s)
    dq = torch.zeros_like(q, dtype=torch.float32)
    k, v = k.contiguous(), v.contiguous()
    kv = _pack(k, v)
    dk_like = torch.empty_like(k, dtype=torch.float32)
    dv_like = torch.empty_like(v, dtype=torch.float32)
    dkv_handle = None
    for i in range(size):
        handle = ring.start(kv) if i < size - 1 else None
        src = (rank - i) % size
        kb, vb = _unpack(kv, k, v)
        dk_b = torch.zeros_like(dk_like)
        dv_b = torch.zeros_like(dv_like)
        if i == 0:
            gq, gk, gv = kernel.bwd(dout, q, kb, vb, out, lse, True, aux)
            dq += gq
            dk_b += gk
            dv_b += gv
        elif src < rank:
            gq, gk, gv = kernel.bwd(dout, q, kb[:, :, first], vb[:, :, first], out, lse, False, aux)
            dq += gq
            dk_b[:, :, first] += gk
            dv_b[:, :, first] += gv
        else:
            gq, gk, gv = kernel.bwd(dout[:, :, second], q[:, :, second], kb, vb,
                                    out[:, :, second], lse[:, :, second].contiguous(), False, aux)
            dq[:, :, second] += gq
            dk_b += gk
            dv_b += gv
        dkv = _pack(dk_b, dv_b)
        if dkv_handle is not None:  # partial dK/dV of this block from the previous rank
            dkv += ring.wait(dkv_handle)
        dkv_handle = ring.start(dkv)
        if handle is not None:
            kv = ring.wait(handle)
    dkv = ring.wait(dkv_handle) if size > 1 else dkv
    if ring.fake and size > 1:
        dkv = _pack(dk_b, dv_b)  # shapes only
    dk, dv = _unpack(dkv, dk_like, dv_like)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, kernel_name):
        kernel = make_kernel(kernel_name, 1.0 / math.sqrt(q.shape[-1]))
        out, lse, aux = ring_forward(q, k, v, group, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel, ctx.aux = group, kernel, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.kernel, ctx.aux)
        return dq, dk, dv, None, None


@torch.compiler.disable
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   kernel: str | None = None, function: type[_RingAttentionFn] = _RingAttentionFn) -> torch.Tensor:
    """Causal attention of the head-tail-sharded local q [b, h, s, d] against the
    whole (ring-distributed) sequence; k/v [b, kv_heads, s, d].  Returns [b, h, s, d].
    `function` is the autograd function that runs the ring (the spmd_types backend passes
    its typed subclass, ``spmd_context_parallel.TypedRingAttentionFn``)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: kv heads ({k.shape[1]}) must divide q heads ({q.shape[1]})")
    return function.apply(q, k, v, group, choose_kernel(q, kernel))
