"""RoPE (``executor/models/layers.py``: ``apply_rope`` -> ``Rotary``, one complex multiply per direction).

It must equal the textbook real form bit for bit in fp32 (forward and input gradient), keep for
backward nothing but the forward's shared cos / sin tables (the saved-bytes tests and the cost model
count no per-block RoPE tensor), round a bf16 input once, and keep its input's SPMD type under the
``spmd_types`` checker (``spmd_step`` registers it as a local function).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from executor.models.layers import apply_rope, rope_cos_sin
from tests.distributed.harness import in_fresh_process

B, S, H, D = 2, 48, 3, 16


def _real_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The real form: interleaved pairs (x0, x1) -> (x0 c - x1 s, x0 s + x1 c)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H, D, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(B, S, H, D, generator=g).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(S) + 7, D, 10000.0, dtype)
    return x, grad, cos, sin


def test_equals_the_real_form_bit_for_bit_in_fp32():
    x, grad, cos, sin = _inputs()
    ours, ref = apply_rope(x, cos, sin), _real_rope(x, cos, sin)
    assert ours.shape == ref.shape and ours.is_contiguous()
    assert torch.equal(ours, ref)
    (g_ours,) = torch.autograd.grad(ours, x, grad)
    (g_ref,) = torch.autograd.grad(ref, x, grad)
    assert torch.equal(g_ours, g_ref)
    # a non-contiguous input (MLA's rotary slice of q): the same values
    wide = torch.randn(B, S, H, D + 6, generator=torch.Generator().manual_seed(1))
    part = wide[..., 6:]
    assert torch.equal(apply_rope(part, cos, sin), _real_rope(part, cos, sin))


def test_keeps_only_the_shared_tables_for_backward():
    x, grad, cos, sin = _inputs()
    q = x * 1.0                                    # an activation, as the wq output is
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = apply_rope(q, cos, sin)
    assert {t.untyped_storage().data_ptr() for t in saved} == {cos.untyped_storage().data_ptr(),
                                                               sin.untyped_storage().data_ptr()}
    out.backward(grad)
    assert x.grad is not None


def test_bf16_rotates_in_fp32_and_rounds_once():
    x, grad, cos, sin = _inputs(torch.bfloat16)
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16
    # the fp32 real form on the upcast input and tables, rounded to bf16 once at the end
    assert torch.equal(out, _real_rope(x.detach().float(), cos.float(), sin.float()).to(torch.bfloat16))
    out.backward(grad)
    assert x.grad.dtype == torch.bfloat16


def _typed_case() -> dict:
    """Under the spmd_types checker (fake process group, rank 0 of 2): the type of RoPE's output and of the
    input gradient, for an input Varying on the axis."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    import spmd_types as spmd
    from executor.parallel import spmd_step  # noqa: F401 (registers RoPE as a local function)
    from executor.parallel.fsdp import spmd_typecheck
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    axis = spmd.MeshAxis.of(dist.group.WORLD)
    x, grad, cos, sin = _inputs()
    with spmd_typecheck():
        spmd.assert_type(x, {axis: spmd.V})
        out = apply_rope(x, cos, sin)
        typed = {str(k): "V" if v is spmd.V else str(v) for k, v in spmd.get_local_type(out).items()}
    dist.destroy_process_group()
    return typed


@pytest.mark.skipif(not hasattr(dist, "_is_spmd_types_available") or not dist._is_spmd_types_available(),
                    reason="spmd_types needs torch >= 2.14")
def test_the_checker_carries_the_input_type_through():
    typed = in_fresh_process(_typed_case)
    assert len(typed) == 1 and list(typed.values())[0] == "V", typed


def test_compiled_rope_takes_the_real_form_without_warnings():
    """Inductor has no complex code generation (it warns, "Performance may be worse than eager"): under
    torch.compile the same rotation runs in real form, fused, with no warning, and equals eager within
    float rounding (fp32; the compiled kernel may contract multiply-adds)."""
    import warnings
    x, grad, cos, sin = _inputs()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(lambda t: apply_rope(t, cos, sin))(x)
        out.backward(grad)
    assert not [w for w in caught if "complex" in str(w.message).lower()], [str(w.message) for w in caught]
    g_compiled = x.grad.clone()
    x.grad = None
    ref = apply_rope(x, cos, sin)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_compiled, x.grad, rtol=1e-6, atol=1e-6)
