"""Context parallel: ring attention and CP training vs single-process runs (real gloo processes)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from executor.parallel.context_parallel import head_tail_indices
from executor.parallel.ring_attention import choose_kernel, make_kernel
from tests.distributed.harness import check_worker_run, launch_worker


# --------------------------------------------------------------------------- in-process units
def test_head_tail_indices_cover_sequence_once():
    for cp in (1, 2, 4):
        seq = 8 * cp
        parts = [head_tail_indices(seq, cp, r) for r in range(cp)]
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
        c = seq // (2 * cp)
        assert parts[0][:c].tolist() == list(range(c))
        assert parts[0][c:].tolist() == list(range(seq - c, seq))


def test_head_tail_indices_rejects_indivisible_seq():
    with pytest.raises(ValueError, match="seq_len divisible by 2\\*cp"):
        head_tail_indices(10, 4, 0)


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_block_kernel_matches_sdpa(kernel, causal, kv_heads):
    """One block: output, log-sum-exp and gradients (given the block's own out/lse) vs SDPA."""
    g = torch.Generator().manual_seed(0)
    b, h, sq, d = 2, 4, 6, 8
    sk = sq if causal else 10
    q = torch.randn(b, h, sq, d, generator=g, requires_grad=True)
    k = torch.randn(b, kv_heads, sk, d, generator=g, requires_grad=True)
    v = torch.randn(b, kv_heads, sk, d, generator=g, requires_grad=True)
    rep = h // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         is_causal=causal)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    kern = make_kernel(kernel, 1 / math.sqrt(d))
    with torch.no_grad():
        out, lse, aux = kern.fwd(q, k, v, causal)
        s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) / math.sqrt(d)
        if causal:
            s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
        dq, dk, dv = kern.bwd(dout, q, k, v, out.to(q.dtype), lse, causal, aux)
    torch.testing.assert_close(out.float(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.float(), s.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq.float(), q.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dk.float(), k.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dv.float(), v.grad, atol=1e-5, rtol=1e-5)


def test_kernel_choice():
    q = torch.empty(1, 2, 4, 8)
    assert choose_kernel(q) in ("cpu_flash", "math")  # env var may force math
    assert choose_kernel(q, "math") == "math"
    with pytest.raises(ValueError, match="kernel must be one of"):
        choose_kernel(q, "nope")


# --------------------------------------------------------------------------- multi-process
def _check_ring(report):
    assert report["meta_ok"], "ring attention on meta tensors"
    assert report["cases"]
    for c in report["cases"]:
        what = f"{c['kernel']} {c['dtype']} heads {c['heads']}/{c['kv_heads']} chunk {c['chunk']} cp {c['cp']}"
        for key in ("out", "dq", "dk", "dv"):
            if c["dtype"] == "float32":
                assert c[key] < 1e-5, f"{what}: {key} max error {c[key]:.3g}"
            else:  # bf16: no worse than single-process bf16 SDPA, within noise
                assert c[key] <= 2 * c["base_" + key] + 5e-3, \
                    f"{what}: {key} error {c[key]:.3g} vs single-process bf16 {c['base_' + key]:.3g}"


@pytest.mark.distributed
def test_ring_attention_cp2():
    _check_ring(launch_worker("_pp_cp_worker.py", 2, "--case", "ring"))


@pytest.mark.distributed
@pytest.mark.slow
def test_ring_attention_cp4():
    _check_ring(launch_worker("_pp_cp_worker.py", 4, "--case", "ring"))


@pytest.mark.distributed
def test_cp2_training_matches_single_process():
    report = launch_worker("_pp_cp_worker.py", 2, "--case", "cp")
    check_worker_run(report["runs"]["cp"], report["ref_losses"])


@pytest.mark.distributed
@pytest.mark.slow
def test_cp2_training_with_per_block_compile():
    """Per-block torch.compile with the ring excluded (torch.compiler.disable): no deadlock, same losses."""
    report = launch_worker("_pp_cp_worker.py", 2, "--case", "cp", "--model", "tiny", "--compile")
    check_worker_run(report["runs"]["cp"], report["ref_losses"])
