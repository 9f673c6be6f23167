"""RMSNorm (``executor/models/layers.py``: ``RMSNorm`` -> ``RMSNormFunction`` in eager mode, ``F.rms_norm``
under torch.compile).

It must equal ``F.rms_norm`` bit for bit in fp32 and bf16 (output, input and weight gradients), keep for
backward only its input and the per-token fp32 rstd, make a block keep exactly the bytes the cost model
counts for titan-run (``cost_models.activations``, ``norm_impl: auto`` uncompiled), match eager under
torch.compile without a warning, and carry its input's SPMD type under the ``spmd_types`` checker
(``spmd_step`` registers it as a local function).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cost_models.activations import FULL, SCORE, SEQ, SHARD, layer_activation_terms
from cost_models.specs import load_model
from cost_models.workload import Workload
from executor.models.layers import RMSNorm, rope_cos_sin
from executor.parallel.parallelize import set_rebuild_product
from executor.models.llama import TransformerBlock
from tests.distributed.harness import in_fresh_process

B, S, D, EPS = 2, 48, 64, 1e-5


def _inputs(dtype=torch.float32, shape=(B, S, D)):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1], generator=g) + 0.5)
    norm = norm.to(dtype)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()
    grad = torch.randn(*shape, generator=g).to(dtype)
    return norm, x, grad


def _grads(out, x, weight, grad):
    return torch.autograd.grad(out, (x, weight), grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_f_rms_norm_bit_for_bit(dtype):
    norm, x, grad = _inputs(dtype)
    ours = norm(x)
    ref = F.rms_norm(x, [D], norm.weight, EPS)
    assert ours.dtype == dtype and torch.equal(ours, ref)
    for a, b in zip(_grads(ours, x, norm.weight, grad), _grads(ref, x, norm.weight, grad)):
        assert a.dtype == dtype and torch.equal(a, b)
    assert isinstance(norm, nn.RMSNorm) and list(norm.state_dict()) == ["weight"]


def test_a_model_forward_is_unchanged_and_its_gradients_agree_to_rounding():
    """In a model the residual stream's gradient sums the norm's input gradient as one term (the composite
    adds its two terms one at a time): forward and loss bit-identical, gradients within fp32 rounding."""
    import copy
    spec = load_model("llama3-debug")
    torch.manual_seed(0)
    block = TransformerBlock(0, spec)
    set_rebuild_product(block, True)   # as titan-run's parallelize: eager, no recompute
    composite = copy.deepcopy(block)
    for m in composite.modules():
        if isinstance(m, RMSNorm):
            m.forward = (lambda mod: lambda x: F.rms_norm(x, mod.normalized_shape, mod.weight, mod.eps))(m)
    x = torch.randn(2, 32, spec.dim, generator=torch.Generator().manual_seed(3))
    cos, sin = rope_cos_sin(torch.arange(32), spec.head_dim, spec.rope_theta, torch.float32)
    outs = [m(x, cos, sin) for m in (block, composite)]
    assert torch.equal(outs[0], outs[1])
    for out in outs:
        out.square().sum().backward()
    for (name, p), q in zip(block.named_parameters(), composite.parameters()):
        # relative to the largest entry (a rounding of one sum propagates through the block's matmuls)
        assert (p.grad - q.grad).abs().max() <= 1e-6 * q.grad.abs().max(), name


def test_non_contiguous_and_two_dimensional_inputs():
    # MLA's kv_norm normalizes a slice of wkv_a's output; the LM head's norm may see [tokens, dim]
    norm, _, _ = _inputs()
    wide = torch.randn(B, S, D + 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    part = wide[..., :D]
    grad = torch.randn(B, S, D, generator=torch.Generator().manual_seed(2))
    ours, ref = norm(part), F.rms_norm(part, [D], norm.weight, EPS)
    assert torch.equal(ours, ref)
    for a, b in zip(_grads(ours, wide, norm.weight, grad), _grads(ref, wide, norm.weight, grad)):
        assert torch.equal(a, b)
    flat = part.detach().reshape(-1, D).requires_grad_()
    ours, ref = norm(flat), F.rms_norm(flat, [D], norm.weight, EPS)
    assert torch.equal(ours, ref)
    for a, b in zip(_grads(ours, flat, norm.weight, grad.reshape(-1, D)),
                    _grads(ref, flat, norm.weight, grad.reshape(-1, D))):
        assert torch.equal(a, b)


def test_frozen_weight_gives_the_input_gradient_only():
    norm, x, grad = _inputs()
    norm.weight.requires_grad_(False)
    (gx,) = torch.autograd.grad(norm(x), x, grad)
    (ref,) = torch.autograd.grad(F.rms_norm(x, [D], norm.weight, EPS), x, grad)
    assert torch.equal(gx, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_only_the_input_and_the_fp32_rstd(dtype):
    norm, x, grad = _inputs(dtype)
    h = x * 1.0                                    # an activation, as the residual stream is
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = norm(h)
    activations = [t for t in saved if t is not norm.weight]
    assert len(activations) == 2, [(t.shape, t.dtype) for t in activations]
    kept_input, rstd = activations
    assert kept_input.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    assert rstd.shape == (B, S, 1) and rstd.dtype == torch.float32
    out.backward(grad)
    assert x.grad is not None


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_block_keeps_what_the_cost_model_counts(dtype):
    """One llama3-debug block, no checkpointing, eager: the unique storages autograd keeps (parameters and the
    shared rotary tables left out) are the cost model's titan-run terms to the byte; the block input is kept by
    the attention norm, as the model counts it."""
    spec = load_model("llama3-debug")
    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    b, s = 2, 64
    torch.manual_seed(0)
    block = TransformerBlock(0, spec).to(dt)
    set_rebuild_product(block, True)   # as titan-run's parallelize: eager, no recompute
    x = torch.randn(b, s, spec.dim, dtype=dt, requires_grad=True)
    h = x * 1.0                                    # the previous block's output
    cos, sin = rope_cos_sin(torch.arange(s), spec.head_dim, spec.rope_theta, dt)
    skip = {t.untyped_storage().data_ptr() for t in [x, cos, sin, *block.parameters()]}
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(h, cos, sin)
    out.float().sum().backward()
    assert x.grad is not None
    t = layer_activation_terms(spec, Workload(seq_len=s, global_batch=b, dtype=dtype), False, "none", False)
    modelled = b * s * (t[SEQ] + t[SHARD] + t[FULL] + t[SCORE] * s)
    assert sum(storages.values()) == modelled, (sorted(storages.values()), modelled)


def test_compiled_norm_matches_eager_without_warnings():
    """Under torch.compile the norm is F.rms_norm, which Inductor fuses with its backward; it equals the eager
    Function within float rounding (fp32; the weight gradient sums over the tokens in another order) and no
    warning is printed."""
    import warnings
    norm, x, grad = _inputs()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(norm)(x)
        g_compiled = _grads(out, x, norm.weight, grad)
    assert not caught, [str(w.message) for w in caught]
    ref = norm(x)
    g_eager = _grads(ref, x, norm.weight, grad)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_compiled[0], g_eager[0], rtol=1e-6, atol=1e-6)
    # the weight gradient of channel j is a sum over the B * S tokens of grad * x_hat; two summation orders
    # differ by up to ~sqrt(n) * eps * sum |terms| (cancellation makes a bound relative to the result alone
    # order-dependent: a 1.7e-5 relative difference on one channel was seen on another CPU)
    xd = x.detach()
    terms = (grad * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)).abs().sum((0, 1))
    bound = (B * S) ** 0.5 * torch.finfo(torch.float32).eps * terms
    assert ((g_compiled[1] - g_eager[1]).abs() <= bound).all(), ((g_compiled[1] - g_eager[1]).abs() / bound).max()


def _typed_case() -> dict:
    """Under the spmd_types checker (fake process group, rank 0 of 2): the type of the norm's output and of the
    weight's gradient, for an input Varying on the axis and the weight Replicate."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    import spmd_types as spmd
    from executor.parallel import spmd_step  # noqa: F401 (registers the norm as a local function)
    from executor.parallel.fsdp import spmd_typecheck
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    axis = spmd.MeshAxis.of(dist.group.WORLD)
    norm, x, grad = _inputs()
    with spmd_typecheck():
        spmd.assert_type(x, {axis: spmd.V})
        spmd.assert_type(norm.weight, {axis: spmd.R})
        out = norm(x)
        typed = {str(k): "V" if v is spmd.V else str(v) for k, v in spmd.get_local_type(out).items()}
        out.backward(grad)
    dist.destroy_process_group()
    return {"out": typed, "grad": bool(torch.isfinite(norm.weight.grad).all())}


@pytest.mark.skipif(not hasattr(dist, "_is_spmd_types_available") or not dist._is_spmd_types_available(),
                    reason="spmd_types needs torch >= 2.14")
def test_the_checker_carries_the_input_type_through():
    got = in_fresh_process(_typed_case)
    assert len(got["out"]) == 1 and list(got["out"].values())[0] == "V", got
    assert got["grad"]
