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
from cost_models.step_time import TIME_KEYS
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
    assert list(first) == pytest.approx([4, 16, 4 * (1 + 3 / 8), 4, 5, 1])
    assert last[0] == 1 and last[1] == 16 and last[5] == 1


# --------------------------------------------------------------------------- step time
def test_pipeline_bubble_fractions():
    wl = Workload(seq_len=8192, global_batch=32)
    for plan, frac in ((Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8), 3 / 8),
                       (Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8, schedule="Interleaved1F1B",
                             stages_per_rank=2), 3 / 16)):
        e = est1(plan, wl=wl)
        busy = e.time["compute"] + e.time["tp_comm"] + e.time["cp_comm"] + e.time["ep_comm"]
        assert e.time["pp_bubble"][0] / busy[0] == pytest.approx(frac, rel=1e-9)
    zb = est1(Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8, schedule="ZBVZeroBubble", stages_per_rank=2), wl=wl)
    one = est1(Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8), wl=wl)
    assert zb.time["pp_bubble"][0] < 0.5 * one.time["pp_bubble"][0]


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
