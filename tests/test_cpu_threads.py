"""A CPU host running fewer processes than cores: titan-run gives each process cores // processes threads
(executor/train.py), and the cost model plans with those threads (HardwareSpec.threads_per_process, for_world)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from cost_models.estimate import estimate
from cost_models.flops import flops_per_token
from cost_models.specs import load_hardware, load_model, this_host_cores
from cost_models.workload import Workload
from planner.cli import main as plan_main
from planner.local import on_this_host
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable

MODEL = load_model("llama3-debug")
WL = Workload(seq_len=256, global_batch=8, dtype="fp32")


def _cpu(cores: int, procs: int):
    return dataclasses.replace(load_hardware("cpu"), host_cores=cores, gpus_per_node=procs)


def _plan(world: int) -> Plan:
    return Plan(dp_shard=world, microbatch=8 // world, n_microbatches=1)


def test_threads_per_process_is_titan_runs_rule():
    assert _cpu(8, 2).threads_per_process(2) == 4
    assert _cpu(8, 3).threads_per_process(3) == 2          # 8 // 3
    assert _cpu(2, 4).threads_per_process(4) == 1          # more processes than cores: one each
    np.testing.assert_array_equal(_cpu(8, 8).threads_per_process(np.array([1, 2, 8, 16])), [8, 4, 1, 1])
    assert load_hardware("h100-sxm").threads_per_process(1) == 1
    assert dataclasses.replace(load_hardware("cpu"), host_cores=None).threads_per_process(1) == 1


def test_for_world_scales_rates_once():
    hw = _cpu(4, 4)
    one = hw.for_world(1)                                  # one process, four threads
    g, m = 1 + 3 * hw.thread_gemm_scaling, 1 + 3 * hw.thread_memory_scaling
    assert one.peak_tflops_fp32 == pytest.approx(hw.peak_tflops_fp32 * g)
    assert one.peak_tflops_bf16 == pytest.approx(hw.peak_tflops_bf16 * g)
    assert one.memory_bw_gbs == pytest.approx(hw.memory_bw_gbs * m)
    assert one.for_world(1) == one                         # a one-core-per-process spec: nothing more to scale
    assert hw.for_world(4) is hw                           # as many processes as cores
    gpu = load_hardware("h100-sxm")
    assert gpu.for_world(1) is gpu


def test_one_process_on_two_cores_is_planned_with_two_threads():
    table = CandidateTable.from_plans([_plan(1)])
    two = estimate(table, MODEL, _cpu(2, 1), WL)
    one = estimate(table, MODEL, _cpu(1, 1), WL)           # the same host with one core
    base = _cpu(1, 1)
    by_hand = dataclasses.replace(base, peak_tflops_fp32=base.peak_tflops_fp32 * (1 + base.thread_gemm_scaling),
                                  memory_bw_gbs=base.memory_bw_gbs * (1 + base.thread_memory_scaling))
    scaled = estimate(table, MODEL, by_hand, WL)
    assert two.step_time_s[0] == pytest.approx(scaled.step_time_s[0], rel=1e-12)
    # faster, but by less than the GEMM speedup (memory-bound work and per-kernel host time scale less)
    speedup = one.step_time_s[0] / two.step_time_s[0]
    assert 1 + _cpu(2, 1).thread_memory_scaling < speedup < 1 + _cpu(2, 1).thread_gemm_scaling
    # MFU against the process's threads (titan-run's MFU counts a host's threads as its cores)
    peak = 2 * _cpu(2, 1).peak_tflops_fp32 * 1e12
    assert two.mfu[0] == pytest.approx(flops_per_token(MODEL, WL.seq_len) * two.tokens_per_s[0] / peak)
    # memory does not depend on threads
    assert two.peak_memory_bytes[0] == one.peak_memory_bytes[0]


def test_plans_of_several_job_sizes_each_get_their_threads():
    hw = _cpu(4, 4)
    plans = [_plan(1), _plan(2), _plan(4), _plan(2)]
    mixed = estimate(CandidateTable.from_plans(plans), MODEL, hw, WL)
    for i, p in enumerate(plans):
        alone = estimate(CandidateTable.from_plans([p]), MODEL, hw, WL)
        assert mixed.step_time_s[i] == pytest.approx(alone.step_time_s[0], rel=1e-12)
        assert mixed.mfu[i] == pytest.approx(alone.mfu[0], rel=1e-12)


def test_the_stock_cpu_preset_stands_for_this_host():
    stock = load_hardware("cpu")
    assert on_this_host(stock, "cpu").host_cores == this_host_cores()
    other = dataclasses.replace(stock, host_cores=64)
    assert on_this_host(other, "/some/profiled.yaml") is other     # a profiled file states its own host
    gpu = load_hardware("h100-sxm")
    assert on_this_host(gpu, "h100-sxm") is gpu


def test_one_gpu_plan_on_this_host_predicts_threads(capsys):
    """`titan-plan --gpus 1` here: one process with every core; faster per sequence than one thread."""
    assert plan_main(["--gpus", "1", "--global-batch", "8", "--json", "--no-write"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["top"][0]
    hw = on_this_host(load_hardware("cpu"), "cpu")
    table = CandidateTable.from_plans([Plan.from_dict(row["plan"])])
    single = estimate(table, MODEL, dataclasses.replace(hw, host_cores=1, gpus_per_node=1),
                      Workload(seq_len=out["inputs"]["seq_len"], global_batch=8, dtype="fp32"))
    predicted = row["predicted"]["step_time_s"]
    if this_host_cores() > 1:
        assert predicted < 0.8 * single.step_time_s[0]
    else:
        assert predicted == pytest.approx(single.step_time_s[0], rel=1e-9)


def test_the_headline_says_the_threads(capsys):
    assert plan_main(["--gpus", "1", "--global-batch", "8", "--no-write"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    t = this_host_cores()
    assert ("1 per node, %d threads each)" % t in first) if t > 1 else ("1 per node)" in first)
