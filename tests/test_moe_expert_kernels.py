"""The experts' kernels on Transformer Engine's GroupedLinear (Megatron-core's TEGroupedMLP, the megatron
layout): one cuBLAS GEMM per local expert over TE's 4 compute streams, and under float8 per-tensor current
scaling three quantize kernels (amax, scale, cast) per expert and quantized tensor; against one grouped
kernel per weight (torch._grouped_mm: titan-run, TorchTitan, the fsdp2 layout).  Hand counts, the wave
rounds, and the step time they add."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.coefficients import Coefficients
from cost_models.compute import (CURRENT_SCALING_KERNELS, TE_GEMM_STREAMS, Rates, expert_gemm_time, expert_kernels,
                                 gemm_time, per_expert_gemms)
from cost_models.specs import load_hardware, load_model
from cost_models.step_time import step_time_breakdown
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable

QWEN = load_model("qwen3-30b-a3b")          # 128 experts, top 8, SwiGLU experts of width 768, 48 MoE layers
H100 = load_hardware("h100-sxm")


def _wl(layout: str) -> Workload:
    zero = {"zero": 1} if layout == "megatron" else {}
    return Workload(seq_len=4096, global_batch=1024, state_layout=layout, **zero)


def test_te_constants_are_the_sources():
    # transformer_engine/common/util/multi_stream.cpp: num_compute_streams = 4; quantizer.cpp
    # Float8CurrentScalingQuantizer::quantize_impl: nvte_compute_amax, nvte_compute_scale_from_amax, nvte_quantize
    assert TE_GEMM_STREAMS == 4 and CURRENT_SCALING_KERNELS == 3
    assert per_expert_gemms(_wl("megatron")) and not per_expert_gemms(_wl("fsdp2"))


def test_per_expert_gemms_share_the_sms_four_at_a_time():
    r = Rates(H100, _wl("megatron"), Coefficients())
    # Qwen3-30B-A3B's fc1 (gate and up: n = 2 x 768) at 512 tokens per expert
    m, k, n = 512, 2048, 1536
    g = lambda groups: gemm_time(m, k, n, r.gemm, r.mem, 2, 2, r.sms, groups=groups)  # noqa: E731
    assert expert_gemm_time(m, k, n, r.gemm, r, 2, 16, False) == pytest.approx(g(16))      # one grouped kernel
    assert expert_gemm_time(m, k, n, r.gemm, r, 2, 16, True) == pytest.approx(4 * g(4))    # 4 rounds of 4
    assert expert_gemm_time(m, k, n, r.gemm, r, 2, 6, True) == pytest.approx(g(4) + g(2))  # a round of 4, one of 2
    assert expert_gemm_time(m, k, n, r.gemm, r, 2, 3, True) == pytest.approx(g(3))         # fewer than the streams
    # 4 x 48 tiles of 128x128 on 132 SMs take 2 waves per round (8 in all) where 16 x 48 pooled take 6
    assert expert_gemm_time(m, k, n, r.gemm, r, 2, 16, True) > 1.2 * g(16)
    # vectorized over candidates
    got = expert_gemm_time(m, k, n, r.gemm, r, 2, np.array([16.0, 6.0, 3.0]), True)
    np.testing.assert_allclose(got, [4 * g(4), g(4) + g(2), g(3)])


def test_expert_kernel_counts_by_hand():
    plans = [Plan(dp_shard=16, ep=16, microbatch=1, n_microbatches=64, compile=True, float8=f8) for f8 in (True, False)]
    plans.append(Plan(dp_shard=16, ep=8, microbatch=1, n_microbatches=64, compile=True, float8=True))
    t = CandidateTable.from_plans(plans)
    got = expert_kernels(t, QWEN, _wl("megatron"), True)
    # 8 local experts: fc1 and fc2 one GEMM each per expert (16) instead of the 3 grouped ones counted;
    # float8: 2 tensors x 3 kernels x 8 experts forward and backward = 96, as 96 / 3 = 32 forward kernels
    # under the model's backward = 2 x forward rule; 16 local experts: 32 - 3 + 64
    np.testing.assert_allclose(got, [13 + 32, 13, 29 + 64])
    assert not expert_kernels(t, QWEN, _wl("fsdp2"), True).any()       # torch._grouped_mm: one kernel per weight
    assert not expert_kernels(t, QWEN, _wl("megatron"), False).any()   # a dense block


def test_step_time_pays_each_expert_kernel():
    # 4 local experts (ep 32): the 4 GEMMs of a weight run in one round, as the grouped kernel does, so with
    # no GPU-side cost per kernel and a plain maximum of host and GPU time the two layouts' compute agrees;
    # with one, the megatron layout pays the extra kernels: forward once, backward twice, per MoE block
    # and micro-batch
    plan = Plan(dp_shard=32, ep=32, microbatch=1, n_microbatches=32, compile=True, float8=True)
    t = CandidateTable.from_plans([plan])
    lat = 3e-6
    base = dict(launch_overlap_sharpness=float("inf"), kernel_launch_s=1e-9)
    wl = Workload(seq_len=4096, global_batch=1024, state_layout="megatron", zero=1)
    # (the loss eager in both: fsdp2's auto compiles it under compile at tp 1, memory.loss_compiled)
    wf = Workload(seq_len=4096, global_batch=1024, state_layout="fsdp2", loss_impl="eager")
    zero = Coefficients(kernel_latency_s=0.0, **base)
    c_m = step_time_breakdown(t, QWEN, H100, wl, zero)["compute"][0]
    c_f = step_time_breakdown(t, QWEN, H100, wf, zero)["compute"][0]
    assert c_m == pytest.approx(c_f, rel=1e-9)
    paid = Coefficients(kernel_latency_s=lat, **base)
    d = (step_time_breakdown(t, QWEN, H100, wl, paid)["compute"][0]
         - step_time_breakdown(t, QWEN, H100, wf, paid)["compute"][0])
    extra = float(expert_kernels(t, QWEN, wl, True)[0])
    assert extra == pytest.approx(2 * 4 - 3 + 4 * 4)
    assert d == pytest.approx(QWEN.n_moe_layers * plan.n_microbatches * 3 * extra * lat, rel=1e-6)
