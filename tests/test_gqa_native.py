"""Grouped-query K/V taken natively (``executor/models/layers.py`` ``CoreAttention``: SDPA with ``enable_gqa``;
``executor/parallel/ring_attention.py``'s flash block kernels with fewer K/V heads).

What a llama3-debug block keeps, counted with ``saved_tensors_hooks``, is the cost model's titan-run terms
(``gqa_kv: auto`` = native) to the byte, with K and V at ``n_kv_heads`` width; the expanded path (TorchTitan's
``repeat_kv`` before SDPA) keeps the cost model's ``gqa_kv: expanded`` terms.  Loss and gradients of the
native path equal the expanded path's within float rounding, eager and compiled without a graph break.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_models.activations import FULL, SCORE, SEQ, SHARD, layer_activation_terms
from cost_models.specs import load_model
from cost_models.workload import Workload
from executor.models.layers import CoreAttention, rope_cos_sin
from executor.parallel.parallelize import set_rebuild_product
from executor.models.llama import Transformer, TransformerBlock
from executor.parallel.ring_attention import make_kernel

SPEC = load_model("llama3-debug")


class RepeatKV(nn.Module):
    """The expanded path: K and V repeated to n_heads before SDPA (TorchTitan's ``repeat_kv``)."""

    def forward(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                              is_causal=True)


def _measure(dtype: torch.dtype, sdpa: nn.Module, b: int = 2, s: int = 64):
    """(unique saved bytes of one block, {shape: bytes} of what its SDPA node keeps of K and V)."""
    torch.manual_seed(0)
    block = TransformerBlock(0, SPEC).to(dtype)
    set_rebuild_product(block, True)   # as titan-run's parallelize: eager, no recompute
    block.attention.sdpa = sdpa
    x = torch.randn(b, s, SPEC.dim, dtype=dtype, requires_grad=True)
    h = x * 1.0                                    # the previous block's output
    cos, sin = rope_cos_sin(torch.arange(s), SPEC.head_dim, SPEC.rope_theta, dtype)
    skip = {t.untyped_storage().data_ptr() for t in [x, cos, sin, *block.parameters()]}
    storages: dict[int, int] = {}
    kv: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    inner = sdpa.forward

    def traced(q, k, v):                           # what the attention kernel itself keeps of K and V
        seen: list[torch.Tensor] = []
        # the innermost hooks alone see a saved tensor: count it for the block too
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or pack(t), lambda t: t):
            out = inner(q, k, v)
        for t in seen:                             # 4-D and neither Q nor the output O: K and V (the LSE is 3-D)
            st = t.untyped_storage()
            if t.dim() == 4 and st.data_ptr() not in (q.untyped_storage().data_ptr(),
                                                      out.untyped_storage().data_ptr()):
                kv[st.data_ptr()] = st.nbytes()
        return out

    sdpa.forward = traced
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(h, cos, sin)
    out.float().sum().backward()
    assert x.grad is not None
    return sum(storages.values()), sum(kv.values())


def _modelled(dtype: str, b: int = 2, s: int = 64, **wl) -> float:
    t = layer_activation_terms(SPEC, Workload(seq_len=s, global_batch=b, dtype=dtype, **wl), False, "none", False)
    return b * s * (t[SEQ] + t[SHARD] + t[FULL] + t[SCORE] * s)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_block_keeps_kv_at_kv_heads_as_the_cost_model_counts(dtype):
    """Native (titan-run): the block keeps the cost model's default (auto = native) terms to the byte, and the
    SDPA kernel keeps K and V at n_kv_heads x head_dim each; expanded: the cost model's ``gqa_kv: expanded``
    terms, K and V at n_heads width.  The difference is the cost model's per-token K/V difference."""
    assert SPEC.n_kv_heads < SPEC.n_heads
    b, s = 2, 64
    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    e = dt.itemsize
    native, kv_native = _measure(dt, CoreAttention(), b, s)
    expanded, kv_expanded = _measure(dt, RepeatKV(), b, s)
    assert native == _modelled(dtype, b, s) == _modelled(dtype, b, s, gqa_kv="native")
    assert expanded == _modelled(dtype, b, s, gqa_kv="expanded")
    assert kv_native == b * s * 2 * SPEC.n_kv_heads * SPEC.head_dim * e
    assert kv_expanded == b * s * 2 * SPEC.n_heads * SPEC.head_dim * e
    t_nat = layer_activation_terms(SPEC, Workload(seq_len=s, global_batch=b, dtype=dtype), False, "none", False)
    t_exp = layer_activation_terms(SPEC, Workload(seq_len=s, global_batch=b, dtype=dtype, gqa_kv="expanded"),
                                   False, "none", False)
    assert kv_expanded - kv_native == b * s * (t_exp[SHARD] - t_nat[SHARD])


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _swap(model, cls):
    for block in model.layers.values():
        block.attention.sdpa = cls()


def _assert_parity(a, b, rel=1e-5):
    (la, ga), (lb, gb) = a, b
    assert abs(la.item() - lb.item()) <= rel * abs(lb.item()), (la, lb)
    for n in gb:
        err = (ga[n] - gb[n]).norm().item()
        assert err <= rel * gb[n].norm().item() + 1e-12, (n, err, gb[n].norm().item())


def test_loss_and_grads_match_the_expanded_path():
    torch.manual_seed(0)
    model = Transformer(SPEC)
    tokens = torch.randint(0, SPEC.vocab_size, (2, 129))
    native = _loss_and_grads(model, tokens)
    _swap(model, RepeatKV)
    expanded = _loss_and_grads(model, tokens)
    _assert_parity(native, expanded)


def test_compiled_core_attention_has_no_graph_break_and_matches_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, SPEC.n_heads, 64, SPEC.head_dim, generator=g, requires_grad=True)
    k = torch.randn(2, SPEC.n_kv_heads, 64, SPEC.head_dim, generator=g, requires_grad=True)
    v = torch.randn(2, SPEC.n_kv_heads, 64, SPEC.head_dim, generator=g, requires_grad=True)
    attn = CoreAttention()
    explained = torch._dynamo.explain(attn)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True)
    out_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(out_c.square().sum(), (q, k, v))
    out_e = attn(q, k, v)
    grads_e = torch.autograd.grad(out_e.square().sum(), (q, k, v))
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for gc, ge in zip(grads_c, grads_e):
        assert gc.shape == ge.shape
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_cpu_flash_block_takes_kv_heads_natively(causal):
    """The ring's CPU flash block kernel takes K/V at kv heads (no copy) and returns dK/dV at kv heads, equal to
    the fp32 math kernel's (which broadcasts over the group) within float rounding; the query block may be
    shorter than the K/V block (the ring's ``src > rank`` case)."""
    g = torch.Generator().manual_seed(0)
    b, h, kv, d = 2, 8, 2, 32
    sk = 64
    sq = sk if causal else sk // 2
    q = torch.randn(b, h, sq, d, generator=g)
    k = torch.randn(b, kv, sk, d, generator=g)
    v = torch.randn(b, kv, sk, d, generator=g)
    dout = torch.randn(b, h, sq, d, generator=g)
    res = {}
    for name in ("cpu_flash", "math"):
        kern = make_kernel(name, 1.0 / math.sqrt(d))
        out, lse, aux = kern.fwd(q, k, v, causal)
        res[name] = (out, lse, *kern.bwd(dout, q, k, v, out, lse, causal, aux))
    for got, want in zip(res["cpu_flash"], res["math"]):
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)
    assert res["cpu_flash"][3].shape[1] == kv and res["cpu_flash"][4].shape[1] == kv
