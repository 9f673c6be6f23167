"""Data parallel at scale (issue 12, class 4): Megatron's gradient buckets and the one that cannot be hidden."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models import data_parallel as D
from cost_models import step_time as S
from cost_models.coefficients import Coefficients
from cost_models.comm import axis_links
from cost_models.compute import Rates
from cost_models.memory import rank_params
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable


def _megatron_walk(sizes, bucket):
    """Megatron-LM's bucketing loop, transcribed (param_and_grad_buffer.py,
    ``_compute_default_per_buffer_param_layout``): parameters in reverse order, a bucket closes as soon
    as it holds >= bucket_size elements; returns the bucket sizes."""
    out, start, end, open_ = [], 0, 0, False
    for n in sizes[::-1]:
        end += n
        open_ = True
        if end - start >= bucket:
            out.append(end - start)
            start, open_ = end, False
    if open_:
        out.append(end - start)
    return out


def test_default_bucket_size_is_megatrons():
    """max(40M, 1M x dp) parameters (DistributedDataParallel.__init__)."""
    assert D.megatron_bucket_params(4) == 40e6
    assert D.megatron_bucket_params(40) == 40e6
    assert D.megatron_bucket_params(512) == 512e6
    np.testing.assert_array_equal(D.megatron_bucket_params(np.array([1, 64, 288])), [40e6, 64e6, 288e6])


@pytest.mark.parametrize("bucket, head, block, n, emb, want", [
    (512.0, 393.0, 97.5, 32, 393.0, 393.0),    # Nemotron-4 15B TP 4 at DP 512 (M params): 2 + 5x6 blocks close, embedding alone
    (40.0, 393.0, 97.5, 32, 393.0, 393.0),     # DP 4: every block is its own bucket, the embedding too
    (250.0, 0.0, 100.0, 7, 50.0, 150.0),       # pipeline rank 0 (no head): 3 + 3 blocks close, 1 left + embedding
    (1000.0, 10.0, 100.0, 3, 50.0, 360.0),     # never fills a bucket: one bucket, all of it
    (120.0, 100.0, 30.0, 5, 40.0, 40.0),       # head + 1 block (130) close, then one bucket of 4 blocks: embedding alone
    (120.0, 100.0, 30.0, 6, 40.0, 70.0),       # the same with one block more: 1 left + embedding
])
def test_last_bucket_by_hand(bucket, head, block, n, emb, want):
    """The closed form against hand-walked cases (parameters in units of 1M), and the transcribed loop."""
    sizes = [emb] + [block] * n + ([head] if head else [])
    got = float(D.megatron_last_bucket(bucket, head, block, n, emb))
    assert got == pytest.approx(want)
    assert _megatron_walk(sizes, bucket)[-1] == pytest.approx(want)


def test_last_bucket_matches_megatrons_loop_on_a_grid():
    """The closed form equals Megatron's loop for every (bucket, head, block, n, emb) on a grid."""
    for bucket in (30.0, 64.0, 100.0, 257.0, 1000.0):
        for head in (0.0, 10.0, 65.0, 300.0):
            for block in (7.0, 27.0, 64.0, 130.0):
                for n in (1, 2, 5, 9, 32):
                    for emb in (5.0, 65.0, 400.0):
                        sizes = [emb] + [block] * n + ([head] if head else [])
                        assert float(D.megatron_last_bucket(bucket, head, block, n, emb)) == \
                            pytest.approx(_megatron_walk(sizes, bucket)[-1]), (bucket, head, block, n, emb)


def test_megatron_exposes_the_last_buckets_reduce_scatter_and_all_gather():
    """Llama 3 8B, TP 8 x DP 64 on DGX H100, Megatron distributed optimizer with bf16 gradients, overlap on.
    The whole reduce-scatter hides under the last micro-batch's backward, but not the last bucket's, nor
    its all-gather before the first forward.  By hand (per TP rank, M = 1e6 parameters):
    bucket = max(40M, 1M x 64) = 64M; head = 128256 x 4096 / 8 + 4096 = 65.67M >= 64M (a bucket alone);
    block = (41.94M + 176.16M) / 8 + 8192 (norms, not TP-sharded) = 27.27M -> 3 blocks a bucket, 32 mod 3 = 2 left:
    last bucket = 2 x 27.27M + 65.67M (embedding).  DP ring: stride 8 -> one member per node, 64 nodes:
    bandwidth one NIC's, 50 GB/s x 0.8; latency 63 network steps of 12 us.  RS (bf16) and AG (bf16) each
    63 x 12 us + 63/64 x 2 B x last / 40 GB/s."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm")
    wl = Workload(seq_len=8192, global_batch=128, state_layout="megatron", zero=1, grad_dtype="bf16")
    coeffs = Coefficients()
    t = CandidateTable.from_plans([Plan(dp_shard=64, tp=8, microbatch=2, n_microbatches=1)])
    r = Rates(hw, wl, coeffs)
    links = axis_links(t, hw, coeffs)
    st = S.stage_times(t, model, hw, wl, coeffs, links, r)
    dp, _ = S.data_parallel(t, model, hw, wl, coeffs, links, r, st)

    block = (41_943_040 + 176_160_768) / 8 + 8192       # attention + MLP matmuls over TP, two norms whole
    head = 128256 * 4096 / 8 + 4096
    last = 2 * block + 128256 * 4096 / 8
    assert float(rank_params(t, model)["dense_block"][0]) == pytest.approx(block)
    one = 63 * 12e-6 + 63 / 64 * 2.0 * last / (50e9 * 0.8)
    # precondition: overlap hides everything but the tail (the whole RS is shorter than the backward)
    local = head + 32 * block + 128256 * 4096 / 8
    whole_rs = 63 * 12e-6 + 63 / 64 * 2.0 * local / (50e9 * 0.8)
    assert whole_rs < float(st["B"][0] + st["W"][0])
    assert float(dp[0]) == pytest.approx(2 * one, rel=1e-9)
    # overlap off: the whole reduce-scatter and all-gather, as before
    off = Coefficients(dp_overlap=0.0)
    dp0, _ = S.data_parallel(t, model, hw, wl, off, links, r, st)
    assert float(dp0[0]) == pytest.approx(2 * whole_rs, rel=1e-9)


def test_tail_grows_with_dp_once_the_bucket_outgrows_the_embedding():
    """Weak scaling at a fixed layout: the bucket size grows with DP (1M per rank above 40 ranks), so the
    exposed tail grows too -- a few ms here, the sourced part of the measured DP slowdown."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm")
    wl = Workload(seq_len=8192, global_batch=4096, state_layout="megatron", zero=1, grad_dtype="bf16")
    coeffs = Coefficients()
    dps = [8, 64, 256, 512]
    t = CandidateTable.from_plans([Plan(dp_shard=d, tp=8, microbatch=2, n_microbatches=4096 // (2 * d))
                                   for d in dps])
    r = Rates(hw, wl, coeffs)
    links = axis_links(t, hw, coeffs)
    st = S.stage_times(t, model, hw, wl, coeffs, links, r)
    dp, _ = S.data_parallel(t, model, hw, wl, coeffs, links, r, st)
    assert np.all(np.diff(dp) > 0)
    tail = D._megatron_tail_params(t, model, rank_params(t, model))
    emb = 128256 * 4096 / 8
    assert tail[0] >= emb and tail[-1] > tail[0]


def test_deepspeed_bf16_optimizer_all_reduces_fp32_gradients():
    """DeepSpeed's pipeline engine with its BF16 optimizer (grad_accum hp_copy, BLOOM) shards the optimizer but
    all-reduces the whole fp32 gradients (pipe/engine.py ``_bf16_reduce_grads``, ``buffered_allreduce_fallback``)
    and then all-gathers the bf16 partitions; nothing hides either (ReduceGrads is its own instruction).  Megatron's
    distributed optimizer reduce-scatters instead.  Same layout, overlap off: the difference is one more pass of the
    4-byte gradients (an all-reduce is two ring passes).  DeepSpeed's ZeRO-1 without the BF16 optimizer
    (gradients accumulated by autograd in ``.grad``) all-reduces as well: stage 1 takes buffered_reduce_fallback,
    whose allreduce_bucket forces ``rank = None`` (stage2.py at 2151c787a, BLOOM's)."""
    model, hw = load_model("llama3-8b"), load_hardware("a100-80g")
    t = CandidateTable.from_plans([Plan(dp_shard=8, tp=4, pp=4, microbatch=1, n_microbatches=8)])
    coeffs = Coefficients(dp_overlap=0.0)
    out = {}
    for accum in ("hp_copy", "autograd", "fused"):
        wl = Workload(seq_len=2048, global_batch=64, state_layout="megatron", zero=1, grad_accum=accum,
                      grad_dtype="fp32")
        r, links = Rates(hw, wl, coeffs), axis_links(t, hw, coeffs)
        st = S.stage_times(t, model, hw, wl, coeffs, links, r)
        out[accum] = float(S.data_parallel(t, model, hw, wl, coeffs, links, r, st)[0][0])
    link = links["dp"]
    local = float(rank_params(t, model)["last_dense"][0])
    bw, alpha, tree = float(link.bw[0]), float(link.alpha[0]), float(link.tree_latency[0])
    rs = 7 * alpha + 7 / 8 * 4.0 * local / bw                       # Megatron: reduce-scatter of fp32 gradients
    ar = 2 * rs - 14 * alpha + min(14 * alpha, tree)                  # DeepSpeed: all-reduce (NCCL's ring or tree latency)
    assert out["hp_copy"] - out["fused"] == pytest.approx(ar - rs, rel=1e-9)
    assert out["autograd"] == pytest.approx(out["hp_copy"], rel=1e-12)
    assert ar - rs > 0.9 * rs
