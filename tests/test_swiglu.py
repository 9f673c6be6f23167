"""titan-run's SwiGLU activation (executor/models/layers.py ``swiglu``): the plain code's values and gradients,
bit for bit, keeping gate and up for backward instead of gate, silu(gate) and up (what the cost model's
``swiglu_impl: fused`` charges, titan-run's ``auto``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cost_models.workload import Workload
from executor.models.layers import swiglu
from executor.models.moe import _padded_bmm_swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_is_the_plain_code_bit_for_bit(dtype):
    torch.manual_seed(0)
    gate, up, grad = (torch.randn(64, 96, dtype=dtype) for _ in range(3))
    a1, b1 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    plain = F.silu(a1) * b1
    plain.backward(grad)
    a2, b2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    fused = swiglu(a2, b2)
    fused.backward(grad)
    assert torch.equal(fused, plain)
    assert torch.equal(a2.grad, a1.grad) and torch.equal(b2.grad, b1.grad)


def _saved(fn, gate, up) -> list[int]:
    """data_ptrs of the storages `fn` saves for backward."""
    ptrs: list[int] = []

    def pack(t):
        ptrs.append(t.untyped_storage().data_ptr())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(gate, up)
    return ptrs


def test_swiglu_keeps_gate_and_up_only():
    gate = torch.randn(32, 48, requires_grad=True)
    up = torch.randn(32, 48, requires_grad=True)
    inputs = {gate.untyped_storage().data_ptr(), up.untyped_storage().data_ptr()}
    assert set(_saved(swiglu, gate, up)) == inputs
    plain = set(_saved(lambda a, b: F.silu(a) * b, gate, up))
    assert inputs < plain and len(plain) == 3           # the plain code keeps silu(gate) as well
    # the cost model's default (auto) is this kernel, on both layouts; TorchTitan's regime states eager
    assert Workload(seq_len=8, global_batch=1).swiglu_fused
    assert not Workload(seq_len=8, global_batch=1, swiglu_impl="eager").swiglu_fused


def test_grouped_experts_use_it_and_match_the_plain_code():
    """The MoE experts' padded-bmm path (CPU) runs the same Function: output and gradients equal the plain
    per-expert SwiGLU."""
    torch.manual_seed(1)
    e, dim, hidden = 3, 16, 24
    counts = torch.tensor([5, 0, 7])
    x = torch.randn(int(counts.sum()), dim, requires_grad=True)
    w1, w3 = (torch.randn(e, dim, hidden, requires_grad=True) for _ in range(2))
    w2 = torch.randn(e, hidden, dim, requires_grad=True)
    out = _padded_bmm_swiglu(x, counts, w1, w2, w3)
    out.square().sum().backward()
    got = [t.grad.clone() for t in (x, w1, w2, w3)]
    for t in (x, w1, w2, w3):
        t.grad = None
    starts = torch.cumsum(counts, 0) - counts
    ref = torch.cat([(F.silu(x[s:s + c] @ w1[i]) * (x[s:s + c] @ w3[i])) @ w2[i]
                     for i, (s, c) in enumerate(zip(starts.tolist(), counts.tolist()))])
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for g, t in zip(got, (x, w1, w2, w3)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-3)
