"""cost_models/estimate.py: the vectorized estimate (breakdowns, per-row equality, speed)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from cost_models.estimate import GIB, Estimates, estimate
from cost_models.memory import MEMORY_KEYS
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from cost_models.step_time import TIME_KEYS
from search_spaces import Plan, Target, enumerate_plans, load_space
from tests.cost_model_helpers import table


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
    assert len(tab) > 90_000          # (96,320 since the V schedules drop selective checkpointing)
    hw, wl = load_hardware("h100-sxm"), Workload(seq_len=8192, global_batch=2048)
    estimate(tab, m, hw, wl)
    t0 = time.perf_counter()
    e = estimate(tab, m, hw, wl)
    dt = time.perf_counter() - t0
    assert dt < 1.5, f"estimate took {dt:.2f} s on {len(tab)} candidates (target well under 0.5 s)"
    assert e.fits.any()


def test_a_search_times_only_the_candidates_whose_memory_fits():
    """`estimate(time_within_bytes=...)`: the step time (and what derives from it) only where the peak memory,
    or its p90 bound, is within the limit, NaN elsewhere; the memory of every candidate and the time of the
    timed ones exactly as a full estimate has them."""
    m, hw = load_model("llama3-70b"), load_hardware("h100-sxm")
    wl = Workload(seq_len=4096, global_batch=64)
    tab = enumerate_plans(load_space("dense"), Target.of(m, world_size=64, seq_len=4096, global_batch=64,
                                                         gpus_per_node=8)).table
    full = estimate(tab, m, hw, wl)
    limit = 0.8 * full.capacity_bytes
    for p90 in (False, True):
        part = estimate(tab, m, hw, wl, time_within_bytes=limit, p90=p90)
        timed = (full.peak_memory_p90_bytes if p90 else full.peak_memory_bytes) <= limit
        assert timed.any() and (~timed).any()
        np.testing.assert_array_equal(np.isnan(part.step_time_s), ~timed)
        for name in ("step_time_s", "tokens_per_s", "mfu", "step_time_p90_s"):
            np.testing.assert_array_equal(getattr(part, name)[timed], getattr(full, name)[timed])
        for k in TIME_KEYS:
            np.testing.assert_array_equal(part.time[k][timed], full.time[k][timed])
        for k in MEMORY_KEYS:
            np.testing.assert_array_equal(part.memory[k], full.memory[k])
        np.testing.assert_array_equal(part.peak_memory_p90_bytes, full.peak_memory_p90_bytes)
