"""Pipeline parallel: stage split, and every schedule vs a single-process run (real gloo processes)."""
from __future__ import annotations

import re

import pytest
import torch

from cost_models.specs import load_model
from executor.models.llama import Transformer
from executor.parallel.pipeline import schedule_class, split_for_rank, split_layers, stage_ids_for_rank
from search_spaces.plan import Plan
from tests.distributed.harness import check_worker_run, launch_worker

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"]


def _plan(schedule, pp=2, v=None, n_mb=4):
    if v is None:
        v = 1 if schedule in ("GPipe", "1F1B") else 2
    return Plan(pp=pp, schedule=schedule, stages_per_rank=v, n_microbatches=n_mb)


# --------------------------------------------------------------------------- in-process units
def test_split_layers_even():
    assert [list(r) for r in split_layers(4, 4)] == [[0], [1], [2], [3]]
    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
    assert [len(r) for r in split_layers(7, 3)] == [3, 2, 2]
    with pytest.raises(ValueError, match="at least one layer per stage"):
        split_layers(3, 4)


def test_stage_placement():
    assert [stage_ids_for_rank(_plan("1F1B", pp=4), r) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_ids_for_rank(_plan("Interleaved1F1B", pp=2, v=3, n_mb=4), r) for r in range(2)] == \
        [[0, 2, 4], [1, 3, 5]]
    for s in ("ZBVZeroBubble", "DualPipeV"):
        assert [stage_ids_for_rank(_plan(s, pp=4, n_mb=8), r) for r in range(4)] == \
            [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_split_meta_model_keeps_fqns(schedule):
    spec = load_model("llama3-debug")
    with torch.device("meta"):
        model = Transformer(spec)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = _plan(schedule)
    seen: dict[str, tuple] = {}
    stage_of_layer = {}
    for r in range(plan.pp):
        for s, mod in split_for_rank(model, plan, r):
            assert (mod.tok_embeddings is not None) == (s == 0)
            assert (mod.output is not None) == (mod.norm is not None) == (s == plan.n_stages - 1)
            for k in mod.layers.keys():
                stage_of_layer[int(k)] = s
            for n, p in mod.named_parameters():
                assert p.is_meta
                assert n not in seen, f"{n} in two stages"
                seen[n] = tuple(p.shape)
    assert seen == full
    assert [stage_of_layer[i] for i in range(spec.n_layers)] == sorted(stage_of_layer.values())
    assert len(list(model.layers.keys())) == spec.n_layers  # original untouched


def test_microbatch_rules_match_torch():
    """torch's micro-batch rules are Plan rules (so the planner never proposes what torch refuses)."""
    from search_spaces.plan import PlanError

    from executor.parallel.pipeline import microbatch_error
    assert microbatch_error(_plan("1F1B", pp=4, n_mb=4)) is None
    assert microbatch_error(_plan("Interleaved1F1B", pp=2, n_mb=6)) is None      # 3 rounds of 2
    with pytest.raises(PlanError, match="multiple"):
        _plan("Interleaved1F1B", pp=2, n_mb=5)                                   # 2 rounds
    assert microbatch_error(_plan("DualPipeV", pp=2, n_mb=4)) is None
    with pytest.raises(PlanError, match="needs at least 4"):
        _plan("DualPipeV", pp=2, n_mb=2)
    assert microbatch_error(_plan("ZBVZeroBubble", pp=2, n_mb=2)) is None


def test_unknown_schedule_error_names_torch_version():
    with pytest.raises(ValueError, match=re.escape(f"not available in torch {torch.__version__}")):
        schedule_class("NoSuchSchedule")


# --------------------------------------------------------------------------- multi-process
@pytest.fixture(scope="module")
def pp2_report():
    return launch_worker("_pp_cp_worker.py", 2, "--case", "pp", "--schedules", ",".join(SCHEDULES))


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_schedule_matches_single_process(pp2_report, schedule):
    run = pp2_report["runs"][schedule]
    check_worker_run(run, pp2_report["ref_losses"])
    assert run["n_fqns"] == run["n_ref_fqns"], "stage parameters do not cover the model"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_pp2_cp2_matches_single_process(schedule):
    report = launch_worker("_pp_cp_worker.py", 4, "--case", "pp_cp", "--schedules", schedule)
    check_worker_run(report["runs"][f"pp_cp_{schedule}"], report["ref_losses"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    "ZBVZeroBubble --pp 2 --dp 2 --fsdp --batch 8",      # split backward x FSDP (reshard switched off)
    "DualPipeV --pp 2 --dp 2 --fsdp --batch 8",
    "ZBVZeroBubble --pp 2 --tp 2",                        # sequence-sharded hidden states between stages
    "DualPipeV --pp 2 --cp 2 --ac",                       # ring attention recomputed inside the schedule
])
def test_pp2_with_fsdp_tp_cp(layout):
    """PP with FSDP / TP+SP / CP+AC in the standalone worker (test-local TP/FSDP, this repo's PP/CP)."""
    schedule, *rest = layout.split()
    report = launch_worker("_pp_cp_worker.py", 4, "--case", "mix", "--model", "tiny", "--schedules", schedule,
                           *rest)
    (run,) = report["runs"].values()
    check_worker_run(run, report["ref_losses"])
