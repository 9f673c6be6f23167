"""Unit tests of the analytic cost models (cost_models/): counts, formulas, invariants, speed."""
from __future__ import annotations

import time

import numpy as np
import pytest

from cost_models.coefficients import Coefficients, CoefficientsError
from cost_models.comm import all_reduce_time, all_to_all_time, group_link, p2p_time, ring_gather_time
from cost_models.estimate import GIB, Estimates, estimate
from cost_models.flops import attention_flops_per_token, flops_per_token, param_counts
from cost_models.memory import MEMORY_KEYS, in_flight_microbatches, per_layer_activation_bytes
from cost_models.specs import SpecError, Workload, load_hardware, load_model, model_from_dict
from cost_models.comm import axis_links
from cost_models.compute import Rates, gemm_time, launch_bound
from cost_models.step_time import TIME_KEYS, stage_times
from search_spaces import CandidateTable, Plan, Target, enumerate_plans, load_space


def table(*plans: Plan) -> CandidateTable:
    return CandidateTable.from_plans(plans)


def est1(plan: Plan, model="llama3-70b", hw="h100-sxm", wl=None, coeffs=None):
    m = load_model(model) if isinstance(model, str) else model
    wl = wl or Workload(seq_len=8192, global_batch=plan.global_batch())
    return estimate(table(plan), m, load_hardware(hw), wl, coeffs)


# --------------------------------------------------------------------------- parameter counts and FLOPs
@pytest.mark.parametrize("name,total,active,tol", [
    ("llama3-8b", 8.03e9, 8.03e9, 0.01),
    ("llama3-70b", 70.6e9, 70.6e9, 0.01),
    ("llama3-405b", 405.9e9, 405.9e9, 0.01),
    ("deepseek-v3-671b", 671e9, 37e9, 0.03),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.03),
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),
])
def test_param_counts_match_published(name, total, active, tol):
    pc = param_counts(load_model(name))
    assert pc["total"] == pytest.approx(total, rel=tol)
    assert pc["active"] == pytest.approx(active, rel=tol)
    assert pc["matmul_active"] < pc["active"]


def test_flops_per_token_is_the_declared_formula():
    m = load_model("llama3-8b")
    pc = param_counts(m)
    expect = 6 * pc["matmul_active"] + 12 * m.n_layers * m.n_heads * m.head_dim * 8192 / 2
    assert flops_per_token(m, 8192) == pytest.approx(expect, rel=1e-12)
    assert flops_per_token(m, 8192) == pytest.approx(51.47e9, rel=0.01)
    assert attention_flops_per_token(m, 16384) == pytest.approx(2 * attention_flops_per_token(m, 8192))


def test_mfu_uses_the_declared_formula():
    plan = Plan(dp_shard=8, tp=8, microbatch=1, n_microbatches=4)
    e = est1(plan)
    hw = load_hardware("h100-sxm")
    expect = flops_per_token(load_model("llama3-70b"), 8192) * e.tokens_per_s / (64 * hw.peak_tflops_bf16 * 1e12)
    assert e.mfu[0] == pytest.approx(expect[0])
    assert 0 < e.mfu[0] < 1


# --------------------------------------------------------------------------- collectives
def test_alpha_beta_collectives_on_known_numbers():
    assert ring_gather_time(8, 1e9, 1e11, 1e-5) == pytest.approx(7e-5 + 7 / 8 * 1e-2)
    assert all_reduce_time(8, 1e9, 1e11, 1e-5) == pytest.approx(2 * (7e-5 + 7 / 8 * 1e-2))
    assert ring_gather_time(1, 1e9, 1e11, 1e-5) == 0.0
    assert p2p_time(1e9, 1e11, 1e-5) == pytest.approx(1e-2 + 1e-5)
    # all intra-node: 7/8 of 0.8 GB at 100 GB/s + 7 latencies
    assert all_to_all_time(8, 8e8, 8, 1e11, 1e-5, 1e10, 2e-5) == pytest.approx(7 / 8 * 8e-3 + 7e-5)
    # 4 of 8 on the node: off-node half at 10 GB/s dominates
    assert all_to_all_time(8, 8e8, 4, 1e11, 1e-5, 1e10, 2e-5) == pytest.approx(4 / 8 * 8e-2 + 4 * 2e-5)


def test_axis_link_placement():
    hw, co = load_hardware("h100-sxm"), Coefficients()
    e = hw.efficiency
    tp8 = group_link(np.array([8]), np.array([1]), hw, co)                 # tp inside a node
    assert tp8.intra[0] and tp8.bw[0] == pytest.approx(hw.intra_node_bw_gbs * 1e9 * e["comm_intra"])
    dp_strided = group_link(np.array([16]), np.array([8]), hw, co)         # one member per node
    assert not dp_strided.intra[0]
    assert dp_strided.bw[0] == pytest.approx(hw.inter_node_bw_gbs * 1e9 * e["comm_inter"])
    dp_dense = group_link(np.array([16]), np.array([1]), hw, co)           # 8 members per node share 8 NICs
    assert dp_dense.bw[0] == pytest.approx(min(8 * hw.inter_node_bw_gbs * e["comm_inter"],
                                               hw.intra_node_bw_gbs * e["comm_intra"]) * 1e9)
    assert dp_dense.p2p_bw[0] == pytest.approx(hw.inter_node_bw_gbs * 1e9 * e["comm_inter"])


# --------------------------------------------------------------------------- memory
def _peak(plan, **kw):
    return est1(plan, **kw).peak_memory_bytes[0]


@pytest.mark.parametrize("layout", ["fsdp2", "megatron"])
def test_more_tp_or_dp_shard_means_less_memory_per_rank(layout):
    wl = lambda p: Workload(seq_len=8192, global_batch=p.global_batch(), state_layout=layout, zero=1)  # noqa: E731
    base = dict(microbatch=1, n_microbatches=4, ac="selective")
    tps = [_peak(p, wl=wl(p)) for p in (Plan(dp_shard=8, tp=t, **base) for t in (1, 2, 4, 8))]
    assert all(a > b for a, b in zip(tps, tps[1:])), tps
    dps = [_peak(p, wl=wl(p)) for p in (Plan(dp_shard=d, tp=4, **base) for d in (1, 2, 8, 32))]
    assert all(a > b for a, b in zip(dps, dps[1:])), dps


def test_more_pp_means_less_memory_per_rank():
    wl = lambda p: Workload(seq_len=8192, global_batch=p.global_batch(), state_layout="megatron", zero=1)  # noqa: E731
    peaks = [_peak(p, wl=wl(p)) for p in (Plan(dp_shard=4, tp=8, pp=pp, microbatch=1, n_microbatches=16)
                                          for pp in (1, 2, 4, 8))]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks
    # fsdp2: the parameter/optimizer shards shrink with pp as well
    p1, p4 = (est1(Plan(dp_shard=4, tp=8, pp=pp, microbatch=1, n_microbatches=16)) for pp in (1, 4))
    assert p4.memory["params"][0] < p1.memory["params"][0]
    assert p4.memory["optimizer"][0] < p1.memory["optimizer"][0]


@pytest.mark.parametrize("policy,attn,layout", [("matmul", "fused", "fsdp2"), ("op", "fused", "fsdp2"),
                                                ("attention", "materialized", "megatron")])
def test_activations_full_lt_selective_lt_none(policy, attn, layout):
    m = load_model("llama3-8b")
    wl = Workload(seq_len=4096, global_batch=8, attention_impl=attn, selective_ac=policy, state_layout=layout)
    t = table(*(Plan(dp_shard=8, tp=1, ac=a) for a in ("none", "selective", "full")))
    kept, _ = per_layer_activation_bytes(t, m, wl, Coefficients(), moe=False)
    assert kept[2] < kept[1] < kept[0]
    e = estimate(t, m, load_hardware("h100-sxm"), wl)
    assert e.memory["activations"][2] < e.memory["activations"][1] < e.memory["activations"][0]
    assert e.time["compute"][0] < e.time["compute"][1] < e.time["compute"][2]   # recomputation costs time


def test_activations_reproduce_korthikanti_table2():
    """Korthikanti et al. 2022, Table 2: per layer sbh(10 + 24/t + 5as/(ht)) with TP,
    sbh(34/t) with TP+SP and selective recompute, 2sbh/t with full recompute and SP."""
    s, b, h, a, t = 2048, 4, 6144, 64, 8
    m = model_from_dict(dict(name="gpt22b", dim=h, n_layers=48, n_heads=a, ffn_hidden=4 * h, vocab_size=51200,
                             mlp="gelu", norm="layernorm"))
    kw = dict(seq_len=s, global_batch=b, state_layout="megatron", attention_impl="materialized", dropout=True,
              selective_ac="attention")
    # Megatron's fused kernels (LayerNorm, bias-GeLU, softmax) are what compile=True expresses
    plan = table(*(Plan(tp=t, microbatch=b, ac=ac, compile=True) for ac in ("none", "selective", "full")))
    no_sp, _ = per_layer_activation_bytes(plan, m, Workload(sequence_parallel=False, **kw), Coefficients(), False)
    sp, _ = per_layer_activation_bytes(plan, m, Workload(sequence_parallel=True, **kw), Coefficients(), False)
    sbh = s * b * h
    assert no_sp[0] == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert sp[1] == pytest.approx(sbh * 34 / t, rel=1e-12)
    assert sp[2] == pytest.approx(2 * sbh / t, rel=1e-12)


def test_in_flight_microbatches_by_schedule():
    t = table(Plan(pp=4, n_microbatches=16, schedule="1F1B"), Plan(pp=4, n_microbatches=16, schedule="GPipe"),
              Plan(pp=4, n_microbatches=16, schedule="Interleaved1F1B", stages_per_rank=2),
              Plan(pp=4, n_microbatches=16, schedule="ZBVZeroBubble", stages_per_rank=2),
              Plan(pp=4, n_microbatches=16, schedule="DualPipeV", stages_per_rank=2), Plan(n_microbatches=16))
    first, last = in_flight_microbatches(t)
    assert list(first) == pytest.approx([4, 16, 4 * (1 + 3 / 8), 4, 4.5, 1])
    assert last[0] == 1 and last[1] == 16 and last[5] == 1


def _cpu_debug(*plans, **wl):
    m, hw = load_model("llama3-debug"), load_hardware("cpu")
    w = Workload(seq_len=256, global_batch=plans[0].global_batch(), dtype="fp32", **wl)
    return estimate(table(*plans), m, hw, w), m, w


def test_block_activations_match_saved_tensors_of_the_executor_model():
    """llama3-debug, fp32 eager, mb 8 x 256 tokens: torch.autograd.graph.saved_tensors_hooks on
    executor/models/llama.py count 44 MiB + the 64 KiB LSE per block: the GQA K and V saved at
    n_heads width (repeat_interleave before SDPA), no extra copy of the attention output."""
    m = load_model("llama3-debug")
    wl = Workload(seq_len=256, global_batch=8, dtype="fp32")
    kept, _ = per_layer_activation_bytes(table(Plan(microbatch=8)), m, wl, Coefficients(), moe=False)
    assert kept[0] == pytest.approx(44 * 2 ** 20 + 8 * 2048 * 4, rel=1e-12)
    # Megatron's kernels take GQA K/V un-expanded: 2 x 1 MiB less
    meg, _ = per_layer_activation_bytes(table(Plan(microbatch=8)), m, Workload(seq_len=256, global_batch=8,
                                        dtype="fp32", state_layout="megatron"), Coefficients(), moe=False)
    assert kept[0] - meg[0] == pytest.approx(2 * 2 ** 20, rel=1e-12)


def test_gpipe_keeps_the_logits_of_all_microbatches_on_the_loss_stage():
    lg = [_cpu_debug(Plan(pp=2, microbatch=1, n_microbatches=n, schedule=s))[0].memory["logits"][0]
          for s in ("GPipe", "1F1B") for n in (8, 16)]
    per_mb = 256 * 512 * (4 + 4)            # the stage output (fp32 logits) and the fp32 log-softmax
    assert lg[1] - lg[0] == pytest.approx(8 * per_mb, rel=1e-9)
    assert lg[2] == lg[3]                   # 1F1B: one micro-batch on the loss stage (the worst rank is the first)


def test_multi_stage_schedules_keep_send_buffers_until_the_step_ends():
    # Interleaved1F1B's activations grow with n_microbatches past the in-flight cap (P2P sends are
    # waited at the end of the step); 1F1B's do not
    a = {(s, n): _cpu_debug(Plan(pp=2, microbatch=1, n_microbatches=n, schedule=s,
                                 stages_per_rank=2 if s != "1F1B" else 1))[0].memory["activations"][0]
         for s in ("Interleaved1F1B", "1F1B") for n in (8, 16)}
    resid = 256 * 256 * 4
    assert a[("Interleaved1F1B", 16)] - a[("Interleaved1F1B", 8)] == pytest.approx(3 * 8 * resid, rel=1e-9)
    assert a[("1F1B", 16)] == a[("1F1B", 8)]


def test_zero_bubble_v_keeps_output_gradients_for_deferred_weight_grads():
    from cost_models.memory import pipeline_extra_bytes
    m = load_model("llama3-debug")
    wl = Workload(seq_len=256, global_batch=16, dtype="fp32")
    t = table(Plan(pp=2, microbatch=2, n_microbatches=8, schedule="ZBVZeroBubble", stages_per_rank=2),
              Plan(pp=2, microbatch=2, n_microbatches=8, schedule="DualPipeV", stages_per_rank=2))
    d = pipeline_extra_bytes(t, m, wl)["deferred_w"]
    # 0.5 of the rank's 2 layers' matmul output gradients (wq, wk, wv, wo, w1, w3, w2 = 5 MiB per layer)
    assert d[0] == pytest.approx(0.5 * 2 * 5 * 2 ** 20, rel=1e-9) and d[1] == 0


def test_one_backward_pass_peaks_before_gradients_exist():
    """pp == 1 with one micro-batch (or GPipe): the activation peak comes before any gradient, so
    the peak is params + optimizer + max(grads, activation phase); with gradient accumulation the
    gradients of earlier micro-batches are alive at the peak."""
    e, _, _ = _cpu_debug(Plan(microbatch=8), Plan(microbatch=8, ac="full"), Plan(microbatch=4, n_microbatches=2))
    assert e.memory["grads"][0] == 0 and e.memory["grads"][1] == 0
    assert e.memory["grads"][2] == pytest.approx(4 * 3_410_176, rel=1e-6)   # 3.4 M params (+ norms), fp32
    # measured (bench_memory_vs_model): single mb8 ac=full 107.4 MiB; the phase max predicts it within 3%
    assert e.peak_memory_bytes[1] / 2 ** 20 == pytest.approx(107.4, rel=0.03)


def test_pipelined_fsdp_regathers_blocks_every_microbatch():
    e, _, _ = _cpu_debug(Plan(dp_shard=2, pp=2, microbatch=1, n_microbatches=16),
                         Plan(dp_replicate=2, pp=2, microbatch=1, n_microbatches=16))
    block = 786_432 * 4                     # one llama3-debug block, fp32
    assert e.memory["fsdp_buffers"][0] >= 4 * block
    assert e.memory["fsdp_buffers"][1] < 4 * block   # replicate-only FSDP: nothing to gather


# --------------------------------------------------------------------------- step time
def test_pipeline_bubble_fractions():
    """1F1B / interleaved bubbles are (p-1)/m (/v) of the busy time of a stage WITHOUT the LM head:
    warm-up and cool-down run through the stages that do not hold it (Narayanan et al. Sec. 2.2)."""
    wl = Workload(seq_len=8192, global_batch=32)
    m, hw, co = load_model("llama3-70b"), load_hardware("h100-sxm"), Coefficients()
    for plan, frac in ((Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8), 3 / 8),
                       (Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8, schedule="Interleaved1F1B",
                             stages_per_rank=2), 3 / 16)):
        e = est1(plan, wl=wl)
        busy = e.time["compute"] + e.time["tp_comm"] + e.time["cp_comm"] + e.time["ep_comm"]
        t = table(plan)
        st = stage_times(t, m, hw, wl, co, axis_links(t, hw, co), Rates(hw, wl, co))
        head = plan.n_microbatches * (st["head_F"] + st["head_B"] + st["head_W"])
        assert head[0] > 0
        assert e.time["pp_bubble"][0] / (busy[0] - head[0]) == pytest.approx(frac, rel=1e-9)
        assert e.time["pp_bubble"][0] < frac * busy[0]
    zb = est1(Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8, schedule="ZBVZeroBubble", stages_per_rank=2), wl=wl)
    one = est1(Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8), wl=wl)
    assert zb.time["pp_bubble"][0] < 0.5 * one.time["pp_bubble"][0]


def test_gemm_roofline_tiles_waves_and_alignment():
    hw = load_hardware("a100-80g")
    r = Rates(hw, Workload(seq_len=1024, global_batch=8), Coefficients())
    assert r.sms == 108 and r.gemm == pytest.approx(312e12 * 0.86)
    ideal = lambda m, k, n: 2.0 * m * k * n / r.gemm  # noqa: E731
    # 27 x 16 tiles of 256x128 = 4 full waves on 108 SMs: no loss
    assert gemm_time(6912, 4096, 2048, r.gemm, r.mem, 2, 2, r.sms) == pytest.approx(ideal(6912, 4096, 2048))
    # a 128x128 output is 4 tiles of 64x64 (half rate: half the reuse) for 108 SMs: split-K cuts the
    # k loop 16 ways (slices of 256), one wave, plus writing and summing 15 fp32 partials
    # (NVIDIA GEMM guide, Sec. 2.3, 3.2; CUTLASS split-K)
    expect = 2 * 64 * 64 * 256 / (r.gemm / 108 * 0.5) + 15 * 128 * 128 * 8 / r.mem
    assert gemm_time(128, 4096, 128, r.gemm, r.mem, 2, 2, r.sms) == pytest.approx(expect)
    assert expect > 5 * ideal(128, 4096, 128)
    # a row more than 4 full waves of 256x128 tiles: the best is 55 x 4 = 220 tiles of 128x128 in
    # 3 waves (1.5x the full-wave time); no quantization without an SM count
    t108 = gemm_time(256 * 27, 4096, 512, r.gemm, r.mem, 2, 2, r.sms)
    assert t108 == pytest.approx(ideal(256 * 27, 4096, 512))
    t109 = gemm_time(256 * 27 + 1, 4096, 512, r.gemm, r.mem, 2, 2, r.sms)
    assert t109 == pytest.approx(3 * 2.0 * 128 * 128 * 4096 / (r.gemm / 108))
    assert gemm_time(256 * 27 + 1, 4096, 512, r.gemm, r.mem, 2, 2, 0) == pytest.approx(ideal(256 * 27 + 1, 4096, 512))
    # an odd leading dimension (GPT-2's unpadded 50257) halves the tensor-core rate; 50304 does not
    t_odd = gemm_time(8192, 2048, 50257, r.gemm, r.mem, 2, 2, 0)
    t_pad = gemm_time(8192, 2048, 50304, r.gemm, r.mem, 2, 2, 0)
    assert t_odd / t_pad == pytest.approx(2 * 50257 / 50304)
    assert gemm_time(8192, 2048, 25128, r.gemm, r.mem, 2, 2, 0) == pytest.approx(ideal(8192, 2048, 25128))
    # tiny matmuls are bound by their operand traffic (roofline)
    assert gemm_time(8, 8192, 8192, r.gemm, r.mem, 2, 2, r.sms) == pytest.approx(2 * (8 * 8192 * 2 + 8192 * 8192) / r.mem,
                                                                                rel=1e-3)
    # grouped: 16 experts in one kernel share the waves
    one = gemm_time(256, 2048, 768, r.gemm, r.mem, 2, 2, r.sms)
    grouped = gemm_time(256, 2048, 768, r.gemm, r.mem, 2, 2, r.sms, groups=16)
    assert grouped < 16 * one and grouped >= 16 * ideal(256, 2048, 768)


def test_launch_bound_smooth_max():
    g, h = np.array([1.0, 3.0, 3.0]), np.array([3.0, 1.0, 3.0])
    np.testing.assert_allclose(launch_bound(g, h, float("inf")), [3.0, 3.0, 3.0])
    f = launch_bound(g, h, 4.0)
    assert np.all(f >= 3.0) and f[2] == pytest.approx(3.0 * 2 ** 0.25)
    assert launch_bound(100.0, 1.0, 4.0) == pytest.approx(100.0, rel=1e-6)


def test_small_microbatches_are_launch_bound_on_the_a100_preset():
    """vTrain's regime: a GPT layer's time per micro-batch has a host floor (~76 launches of
    Megatron's eager stack per layer, forward + recompute + backward), so micro-batch 1 and 2
    cost about the same per micro-batch while large micro-batches are GPU-bound."""
    m = model_from_dict({"name": "gpt", "dim": 1024, "n_layers": 24, "n_heads": 16, "ffn_hidden": 4096,
                         "vocab_size": 50257, "mlp": "gelu", "norm": "layernorm"})
    hw = load_hardware("a100-80g")
    assert hw.kernel_launch_us == 40.0 and load_hardware("h100-sxm").kernel_launch_us == 4.0
    wl = Workload(seq_len=1024, global_batch=64, state_layout="megatron", zero=0, attention_impl="materialized",
                  dropout=True, sequence_parallel=False, selective_ac="attention")
    per_mb = {}
    for mb in (1, 2, 8):
        e = estimate(table(Plan(dp_shard=1, microbatch=mb, n_microbatches=64 // mb, ac="full", compile=True)),
                     m, hw, wl)
        per_mb[mb] = e.step_time_s[0] / (64 // mb)
    assert per_mb[2] / per_mb[1] < 1.2                    # launch-bound: micro-batch 2 almost free
    assert per_mb[8] / per_mb[2] > 2.0                    # GPU-bound: time grows with the work
    assert 24 * 76 * 40e-6 < per_mb[1] < 2.0 * 24 * 76 * 40e-6


def test_compile_and_float8_speed_up():
    base = dict(dp_shard=8, microbatch=2, ac="selective")
    e = est1(Plan(**base), model="llama3-8b")
    c = est1(Plan(compile=True, **base), model="llama3-8b")
    f = est1(Plan(compile=True, float8=True, **base), model="llama3-8b")
    assert f.step_time_s[0] < c.step_time_s[0] < e.step_time_s[0]
    assert c.step_time_s[0] > 0.7 * e.step_time_s[0]          # a modest speedup


def test_breakdowns_sum_to_totals_and_vectorized_equals_per_row():
    rng = np.random.default_rng(0)
    for model, space, world in (("llama3-70b", "dense", 64), ("deepseek-v3-16b", "moe", 32)):
        m = load_model(model)
        tgt = Target.of(m, world_size=world, seq_len=4096, global_batch=64, gpus_per_node=8)
        tab = enumerate_plans(load_space(space), tgt).table
        wl = Workload(seq_len=4096, global_batch=64)
        hw = load_hardware("h100-sxm")
        e = estimate(tab, m, hw, wl)
        assert set(e.memory) == set(MEMORY_KEYS) and set(e.time) == set(TIME_KEYS)
        np.testing.assert_allclose(sum(e.memory.values()), e.peak_memory_bytes, rtol=1e-12)
        np.testing.assert_allclose(sum(e.time.values()), e.step_time_s, rtol=1e-12)
        for v in list(e.memory.values()) + list(e.time.values()):
            assert np.all(v >= 0) and np.all(np.isfinite(v))
        np.testing.assert_allclose(e.tokens_per_s, 64 * 4096 / e.step_time_s)
        np.testing.assert_allclose(e.tokens_per_s_per_gpu * world, e.tokens_per_s)
        assert e.capacity_bytes == (hw.memory_gib - hw.memory_reserved_gib) * GIB
        np.testing.assert_array_equal(e.fits, e.peak_memory_bytes <= e.capacity_bytes)
        for i in rng.choice(len(tab), size=25, replace=False):
            one = estimate(tab.take([i]), m, hw, wl)
            assert one.step_time_s[0] == pytest.approx(e.step_time_s[i], rel=1e-12)
            assert one.peak_memory_bytes[0] == pytest.approx(e.peak_memory_bytes[i], rel=1e-12)
            for k in TIME_KEYS:
                assert one.time[k][0] == pytest.approx(e.time[k][i], rel=1e-12, abs=1e-15)


def test_small_cpu_case():
    m, hw = load_model("llama3-debug"), load_hardware("cpu")
    wl = Workload(seq_len=256, global_batch=16, dtype="fp32")
    t = table(Plan(dp_shard=4, microbatch=4), Plan(dp_shard=2, tp=2, microbatch=8),
              Plan(dp_shard=2, pp=2, microbatch=4, n_microbatches=2), Plan(dp_shard=2, cp=2, microbatch=8))
    e = estimate(t, m, hw, wl)
    assert isinstance(e, Estimates) and len(e) == 4
    assert np.all(e.fits) and np.all(e.step_time_s > 0) and np.all((e.mfu > 0) & (e.mfu < 1))
    assert e.peak_memory_bytes.max() < 1 * GIB


def test_estimate_is_fast_on_a_large_space():
    m = load_model("llama3-405b")
    tgt = Target.of(m, world_size=16384, seq_len=8192, global_batch=2048, gpus_per_node=8)
    tab = enumerate_plans(load_space("dense"), tgt).table
    assert len(tab) > 100_000
    hw, wl = load_hardware("h100-sxm"), Workload(seq_len=8192, global_batch=2048)
    estimate(tab, m, hw, wl)
    t0 = time.perf_counter()
    e = estimate(tab, m, hw, wl)
    dt = time.perf_counter() - t0
    assert dt < 1.5, f"estimate took {dt:.2f} s on {len(tab)} candidates (target well under 0.5 s)"
    assert e.fits.any()


# --------------------------------------------------------------------------- coefficients and specs
def test_host_time_per_launch_comes_from_the_preset_unless_overridden():
    wl = Workload(seq_len=1024, global_batch=8)
    hw = load_hardware("a100-80g")
    assert Rates(hw, wl, Coefficients()).launch == pytest.approx(40e-6)
    assert Rates(hw, wl, Coefficients(host_overhead_scale=0.5)).launch == pytest.approx(20e-6)
    assert Rates(hw, wl, Coefficients(kernel_launch_s=4e-6)).launch == pytest.approx(4e-6)   # old calibration files
    with pytest.raises(CoefficientsError, match="launch_overlap_sharpness"):
        Coefficients(launch_overlap_sharpness=0)


def test_coefficients_yaml_round_trip(tmp_path):
    c = Coefficients(gemm_efficiency_scale=0.9, tp_overlap=0.5, memory_overhead_bytes=1e9)
    path = tmp_path / "cal.yaml"
    c.save(path, meta={"fitted_on": "unit test"})
    assert Coefficients.load(path) == c
    assert Coefficients.from_dict(c.to_dict()) == c
    assert Coefficients() == Coefficients.from_dict({})


@pytest.mark.parametrize("d,key", [({"gemm_scale": 1.0}, "gemm_scale"), ({"tp_overlap": 2.0}, "tp_overlap"),
                                   ({"gemm_efficiency_scale": 0}, "gemm_efficiency_scale"),
                                   ({"dp_overlap": "high"}, "dp_overlap"), ({"ep_imbalance": 0.5}, "ep_imbalance")])
def test_coefficients_errors_name_the_key(d, key):
    with pytest.raises(CoefficientsError, match=key):
        Coefficients.from_dict(d)


def test_workload_regime_keys_are_validated():
    with pytest.raises(SpecError, match="selective_ac"):
        Workload(seq_len=8, global_batch=1, selective_ac="some")
    with pytest.raises(SpecError, match="attention_impl"):
        Workload(seq_len=8, global_batch=1, attention_impl="flash")
    with pytest.raises(SpecError, match="dropout"):
        Workload(seq_len=8, global_batch=1, dropout=1)


def test_default_coefficients_mean_no_correction():
    c = Coefficients()
    for k, v in c.to_dict().items():
        if k.endswith("_scale") or k == "ep_imbalance":
            assert v == 1.0, k
    assert c.tp_overlap == 0.0 and c.step_overhead_s == 0.0 and c.memory_overhead_bytes == 0.0
