"""Layers shared by the model files (``llama.py``, ``mla.py``, ``moe.py``): RoPE, the causal SDPA core,
the dense feed-forward and the norm.  Plain PyTorch; it imports no other model file."""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.specs import ModelSpec

try:                      # the checker's mode (train.spmd_typecheck) types each op: it must see the plain ops
    from spmd_types import is_type_checking
except ImportError:       # pragma: no cover - spmd_types is a core dependency; older torch runs dtensor
    def is_type_checking() -> bool:
        return False


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 spec: ModelSpec | None = None):
    """cos/sin tables [seq, head_dim/2] for rotary embeddings (Su et al. 2021); `spec` with
    ``rope_scaling: llama3`` rescales the frequencies as Llama 3.1 does (`llama3_inv_freq`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    if spec is not None and spec.rope_scaling == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, spec)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Llama 3.1 RoPE scaling (Meta's reference ``apply_scaling``; HF rope_type "llama3"): wavelengths
    longer than original/low_freq_factor are divided by `factor`, shorter than original/high_freq_factor
    kept, and the band between blended linearly in original/wavelength."""
    factor, low, high = spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    old = spec.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; rotate interleaved pairs (x0, x1) by the angles of `cos`/`sin`
    ([seq, head_dim/2], shared by every block of a forward): :class:`Rotary`."""
    return Rotary.apply(x, cos, sin)


class Rotary(torch.autograd.Function):
    """RoPE as one complex multiply per direction: the pairs (x0, x1) as complex numbers times
    cos + i sin in forward, times cos - i sin (the inverse rotation, RoPE being linear in x) in backward.

    It saves only `cos` and `sin`, the forward's shared tables, nothing per block (an autograd complex
    multiply would save a complex table per call); in fp32 it is bit-identical to the real form
    ``(x0 c - x1 s, x0 s + x1 c)`` forward and backward, ~13x faster on CPU (measured: the real form's
    strided halves and stack).  Low-precision inputs rotate in fp32 (complex bf16 does not exist) and
    are rounded once, as TorchTitan's ``apply_rotary_emb`` does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, h, d] rotated pairwise by the angles whose cosines / sines are cos, sin [s, d/2]."""
    work = torch.promote_types(x.dtype, torch.float32)           # complex32 / complex-bf16: none usable
    if torch.compiler.is_compiling():
        # Inductor has no code generation for complex operators (it warns and runs them unfused): the
        # same arithmetic in real form, which it fuses into one kernel
        xw = x.to(work)
        x0, x1 = xw[..., 0::2], xw[..., 1::2]
        c, s = cos.to(work)[None, :, None, :], sin.to(work)[None, :, None, :]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)
    table = torch.complex(cos.to(work), sin.to(work))[None, :, None, :]
    pairs = torch.view_as_complex(x.to(work).contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * table).flatten(-2).to(x.dtype)


class CoreAttention(nn.Module):
    """Causal scaled-dot-product attention; k/v may have fewer (kv) heads (GQA).

    Grouped-query K/V go to SDPA as they are (``enable_gqa``, torch >= 2.5): the flash kernels (CPU and
    CUDA) and cuDNN read the kv heads natively, so autograd keeps K and V at ``n_kv_heads`` width, not
    the ``repeat_interleave`` copies at ``n_heads`` width an explicit expansion would save (the cost
    model's ``Workload.gqa_kv``: ``native``).  Output equals the expanded path's bit for bit on the CPU
    flash kernel; dK/dV differ in the last bits (the group's sum is taken in another order)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` keeping gate and up only: backward recomputes ``silu(gate)``.

    Autograd of the plain code keeps gate (for silu), silu(gate) and up (for the product): one ffn-width
    tensor more than the fused activation kernels of Megatron-core (``bias_swiglu_impl``), Transformer Engine
    and Liger keep; the down projection keeps the product either way.  The backward runs the ops autograd's
    would (MulBackward's two products, SiluBackward's ``silu_backward``) on the recomputed ``silu(gate)``,
    so the gradients are bitwise the plain code's (tests/test_swiglu.py); the price is one elementwise silu
    more per FFN in backward.  Backward holds four ffn-width tensors at once (gate, up, a temporary and a
    gradient) where the plain code's holds five."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)     # (the product's temporary freed here)
        return grad_gate, F.silu(gate).mul_(grad)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (its backward keeps gate and up, not ``silu(gate)``: `_SwiGLU`); under the spmd_types
    checker the plain ops, which it types one by one."""
    if is_type_checking():
        return F.silu(gate) * up
    return _SwiGLU.apply(gate, up)


class _Rebuilt:
    """What :func:`rebuilt_input` saves in place of a view of the activation's output: its inputs (which the
    activation keeps for its own backward anyway), the view's geometry and, for a DTensor wrapping that view
    (torch's RowwiseParallel input), the DTensor's mesh, placements and global geometry."""
    __slots__ = ("fn", "inputs", "size", "stride", "offset", "dtensor")

    def __init__(self, fn, inputs, t: torch.Tensor, dtensor=None):
        self.fn, self.inputs = fn, inputs
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.dtensor = (None if dtensor is None else
                        (dtensor.device_mesh, dtensor.placements, dtensor.size(), dtensor.stride()))

    def tensor(self) -> torch.Tensor:
        with torch.no_grad():
            local = self.fn(*self.inputs).as_strided(self.size, self.stride, self.offset)
            if self.dtensor is None:
                return local
            from torch.distributed.tensor import DTensor
            mesh, placements, shape, stride = self.dtensor
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` views `b`'s storage: DTensor's view ops hand back local tensors that alias the input's
    storage without recording it as their ``_base``.  Compared by storage object (``_cdata``, the same for
    every alias, real or fake), not by address (fake tensors have none)."""
    try:
        return a.device == b.device and a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return False


def rebuilt_input(out: torch.Tensor, fn, *inputs: torch.Tensor):
    """A context under which autograd saves ``out`` (the output of the elementwise ``fn(*inputs)``, e.g. the
    SwiGLU product, and any view of it) as a recipe: the down projection run inside it keeps no copy of its
    input for its weight gradient, which is rebuilt from `inputs` when backward needs it.  `inputs` are
    what the activation's own backward keeps (gate and up; the GELU input), so the FFN keeps one ffn-width
    tensor less per token and the price is the elementwise `fn` once more in backward.  The rebuilt tensor is
    bitwise the forward's (the same ops on the same inputs), so gradients do not change.  Saved tensors
    that are not `out` or a view of it (the weights, a float8 copy, a DTensor) are kept as they are.  Only
    where nothing else intercepts saved tensors: not inside activation checkpointing (which would then keep
    `inputs` alive), not under torch.compile (whose partitioner decides what to keep): the caller decides."""
    ref = weakref.ref(out)        # (autograd keeps the hooks with what they saved: no strong reference to `out`)

    def pack(t: torch.Tensor):
        o = ref()
        if o is None:
            return t
        local = getattr(t, "_local_tensor", None)       # a DTensor over the output (DTensor TP's row-wise input)
        if local is None:
            return _Rebuilt(fn, inputs, t) if (t is o or t._base is o) else t
        if local is o or local._base is o or _same_storage(local, o):
            return _Rebuilt(fn, inputs, local, dtensor=t)
        return t

    def unpack(obj):
        return obj.tensor() if isinstance(obj, _Rebuilt) else obj
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def silu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _gelu(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


def rebuilds(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module`'s down projection saves its input as a recipe (`rebuilt_input`): the module's
    ``rebuild_product`` (set by the executor where its blocks are neither checkpointed nor compiled,
    ``executor/parallel/parallelize.py``), in an eager forward that records a graph, outside the spmd_types
    checker."""
    return (getattr(module, "rebuild_product", False) and torch.is_grad_enabled() and x.requires_grad
            and not torch.compiler.is_compiling() and not is_type_checking())


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) or a GELU MLP (w2(gelu(w1 x))).  With ``rebuild_product`` the down
    projection's saved input is rebuilt in backward from what the activation keeps (`rebuilt_input`)."""

    def __init__(self, dim: int, hidden: int, kind: str = "swiglu"):
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False) if kind == "swiglu" else None
        self.rebuild_product = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            gate, up = self.w1(x), self.w3(x)
            h = swiglu(gate, up)
            if rebuilds(self, h):
                with rebuilt_input(h, silu_product, gate, up):
                    return self.w2(h)
            return self.w2(h)
        pre = self.w1(x)
        h = _gelu(pre)
        if rebuilds(self, h):
            with rebuilt_input(h, _gelu, pre):
                return self.w2(h)
        return self.w2(h)


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.dim, eps=spec.norm_eps)
    return nn.LayerNorm(spec.dim, eps=spec.norm_eps, bias=False)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dimension (same parameter, same state-dict key ``weight``) whose eager
    forward and backward are :class:`RMSNormFunction`; under torch.compile ``F.rms_norm``, which Inductor
    decomposes and fuses with its backward (the partitioner then picks what to keep)."""

    def __init__(self, dim: int, eps: float | None = None):
        super().__init__(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        eps = torch.finfo(torch.float32).eps if self.eps is None else self.eps     # F.rms_norm's default
        return RMSNormFunction.apply(x, self.weight, eps)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm ``x * rsqrt(mean(x^2) + eps) * weight`` with a hand-written backward.

    It keeps for backward only its input and the per-token ``rstd`` (fp32, one value per token), nothing
    of the width of the normalized output: autograd through ``F.rms_norm``'s eager composite keeps the
    (upcast) input, the normalized output and rstd.  The backward is autograd's own chain rule for that
    composite, op for op (mul, rsqrt, mean and pow backward, with the small per-token factors folded
    first: multiplying by 2 is exact), so the output and both gradients of one norm equal ``F.rms_norm``'s
    bit for bit (fp32 and bf16), in ~3/4 of the CPU time (fewer and smaller elementwise passes).  Inside a
    model the forward stays bit-identical; the input gradient reaches the residual stream as one sum, where
    autograd adds the composite's two terms to the residual's gradient one at a time, so a block's
    gradients differ in the last bits (~1e-7 relative in fp32).  Low-precision inputs are normalized in
    fp32 and rounded once at the end, forward and backward, as ``F.rms_norm`` does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xw = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xw * rstd * weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xw, g = x.to(rstd.dtype), grad.to(rstd.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_norm = g * weight                                        # d out / d (x * rstd)
            g_rstd = (g_norm * xw).sum(-1, keepdim=True)
            # rsqrt' = -rstd^3 / 2, mean' = 1 / n, (x^2)' = 2x: one per-token factor times x
            factor = g_rstd * -0.5 * rstd.pow(3) / x.shape[-1] * 2
            grad_x = g_norm * rstd
            grad_x += factor * xw
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g * (xw * rstd)).sum(tuple(range(x.dim() - 1))).to(weight.dtype)
        return grad_x, grad_w, None
