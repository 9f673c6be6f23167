"""A search space may name the dtensor backend (``knobs: backend: [dtensor]``, to compare the backends); titan-run
refuses two kinds of plan there (``executor/config.py``): float8 with tp > 1 (torchao's DTensor float8 TP styles are
not wired) and a split-backward (V) pipeline whose data parallelism is replicas only (its gradients do not match one
process on dtensor).  The search rejects exactly those candidates (`search_spaces.plan.backend_unrunnable`,
``constraints.R_BACKEND``), so the plan it writes is one titan-run takes; ``estimate`` predicts them as a what-if."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from planner.cli import main
from planner.rank import plan_candidates
from search_spaces import constraints as C
from search_spaces.plan import BACKENDS, SCHEDULES, V_SCHEDULES, Plan, backend_unrunnable
from search_spaces.space import load_space

WL = Workload(seq_len=4096, global_batch=256)


def _executor_refuses(plan: Plan) -> bool:
    return (C.float8_tp_backend_error(plan, plan.backend) is not None
            or C.replicate_split_backward_error(plan, plan.backend) is not None)


@pytest.mark.parametrize("backend, schedule, float8, tp, data", itertools.product(
    BACKENDS, SCHEDULES, (False, True), (1, 2), ("replicas", "shards")))
def test_the_rule_is_the_executors(backend, schedule, float8, tp, data):
    multi = schedule in V_SCHEDULES or schedule == "Interleaved1F1B"
    dp = {"dp_replicate": 2} if data == "replicas" else {"dp_shard": 2}
    plan = Plan(**dp, pp=2, tp=tp, schedule=schedule, stages_per_rank=2 if multi else 1, microbatch=1,
                n_microbatches=4, float8=float8, backend=backend)
    assert bool(backend_unrunnable(plan)) == _executor_refuses(plan)
    expected = backend == "dtensor" and ((float8 and tp > 1) or (schedule in V_SCHEDULES and data == "replicas"))
    assert bool(backend_unrunnable(plan)) == expected


def _dtensor(space):
    return dataclasses.replace(space, knobs={**space.knobs, "backend": ["dtensor"]})


@pytest.mark.parametrize("model, world, space", [("llama3-70b", 64, "dense"), ("deepseek-v3-671b", 1024, "moe")])
def test_the_search_on_dtensor_keeps_only_what_titan_run_runs(model, world, space):
    """Float8 TP layouts that fit in memory are among the candidates; on dtensor they are rejected, not picked
    (DeepSeek-V3: the fastest layout on spmd_types is one, so a dtensor search wrote it before)."""
    m, hw = load_model(model), load_hardware("h100-sxm")
    spmd = plan_candidates(load_space(space), m, hw, WL, world_size=world)
    dt = plan_candidates(_dtensor(load_space(space)), m, hw, WL, world_size=world)
    bad = backend_unrunnable(dt.table)
    assert (bad & (dt.est.peak_memory_bytes <= dt.est.capacity_bytes)).any()
    assert not bad[dt.order].any()
    if model == "deepseek-v3-671b":
        best_spmd = spmd.table.plan(spmd.best())
        assert best_spmd.float8 and best_spmd.tp > 1
    assert any(r.reason == C.R_BACKEND and r.count == int(bad.sum()) for r in dt.rejected)
    assert not any(r.reason == C.R_BACKEND for r in spmd.rejected)
    assert not _executor_refuses(dt.table.plan(dt.best()))


def test_the_estimate_predicts_it_as_a_what_if(capsys):
    q = ["estimate", "--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm", "--dp-shard", "32", "--tp",
         "2", "--float8", "--compile", "--ac", "full", "--seq-len", "8192", "--global-batch", "128", "--json"]
    assert main([*q, "--backend", "dtensor"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["titan_run_can_run"] is False and C.R_BACKEND in doc["note"]
    assert main(q) == 0                                    # spmd_types, the default, runs it
    assert json.loads(capsys.readouterr().out)["titan_run_can_run"] is True
