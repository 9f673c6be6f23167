"""A reduce-scatter after every micro-batch (workload ``pp_grad_sync: every_microbatch``) is something titan-run runs
under GPipe, 1F1B and Interleaved1F1B only: the split-backward (V) schedules compute the weight gradients after the
micro-batch's FSDP post-backward has run (``executor/config.py`` `grad_sync_error`).  titan-plan's search rejects
those candidates (`search_spaces.plan.grad_sync_unrunnable`, `constraints.R_GRAD_SYNC`), so it never writes a plan
titan-run refuses; ``titan-plan estimate`` still predicts such a layout and says in one line that it is a what-if."""
from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest
import yaml

from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from executor.config import ConfigError, _check_workload_runs, grad_sync_error
from planner.cli import main
from planner.rank import plan_candidates
from search_spaces import constraints as C
from search_spaces.plan import SCHEDULES, V_SCHEDULES, Plan, grad_sync_unrunnable
from search_spaces.space import load_space

V3, H100 = load_model("deepseek-v3-671b"), load_hardware("h100-sxm")
WL = Workload(seq_len=4096, global_batch=128)


def _plan(schedule: str, pp: int) -> Plan:
    multi = schedule in V_SCHEDULES or schedule == "Interleaved1F1B"
    return Plan(dp_shard=2, pp=pp, schedule=schedule, stages_per_rank=2 if multi and pp > 1 else 1, microbatch=1,
                n_microbatches=4)


# every schedule with a pipeline, and the single-stage ones without (the multi-stage ones need pp > 1)
CASES = [(s, pp) for s in SCHEDULES for pp in (1, 2) if pp > 1 or s in ("GPipe", "1F1B")]


@pytest.mark.parametrize("schedule, pp, grad_sync", [(s, pp, g) for (s, pp), g in itertools.product(
    CASES, ("last_microbatch", "every_microbatch"))])
def test_the_rule_is_the_executors(schedule, pp, grad_sync):
    """`grad_sync_unrunnable` says no exactly where titan-run refuses the workload's ``pp_grad_sync``."""
    plan = _plan(schedule, pp)
    refused = True
    try:
        _check_workload_runs(Workload(seq_len=256, global_batch=8, pp_grad_sync=grad_sync), plan)
        refused = False
    except ConfigError:
        pass
    assert bool(grad_sync_unrunnable(plan, grad_sync)) == refused == (grad_sync_error(plan, grad_sync) is not None)
    assert refused == (grad_sync == "every_microbatch" and pp > 1 and schedule in V_SCHEDULES)


def test_the_search_keeps_only_what_titan_run_runs():
    """DeepSeek-V3 on 1,024 H100s: a V schedule is the fastest layout under either setting before the rule
    (DualPipeV), so the rule changes the pick; every rejected candidate is a V pipeline, counted once."""
    space = load_space("moe")
    every = plan_candidates(space, V3, H100, dataclasses.replace(WL, pp_grad_sync="every_microbatch"),
                            world_size=1024)
    last = plan_candidates(space, V3, H100, WL, world_size=1024)
    bad = grad_sync_unrunnable(every.table, "every_microbatch")
    assert bad.any() and not bad[every.order].any()
    assert any(r.reason == C.R_GRAD_SYNC and r.count == int(bad.sum()) for r in every.rejected)
    assert not any(r.reason == C.R_GRAD_SYNC for r in last.rejected)
    assert last.table.plan(last.best()).schedule in V_SCHEDULES        # the default keeps V schedules
    assert every.table.plan(every.best()).schedule not in V_SCHEDULES
    # the rejected V candidates would otherwise fit: the rule, not memory, removes them
    assert (bad & (every.est.peak_memory_bytes <= every.est.capacity_bytes)).any()


def test_the_written_plan_is_one_titan_run_takes(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    q = ["--model", "deepseek-v3-671b", "--gpus", "1024", "--hardware", "h100-sxm", "--seq-len", "4096",
         "--global-batch", "128", "--pp-grad-sync", "every_microbatch", "--out", str(out)]
    assert main(q) == 0
    text = capsys.readouterr().out
    assert f"candidates: {C.R_GRAD_SYNC}" in text
    doc = yaml.safe_load(out.read_text())
    plan, wl = Plan(**doc["plan"]), Workload(**doc["workload"])
    assert plan.pp > 1 and plan.schedule not in V_SCHEDULES and wl.pp_grad_sync == "every_microbatch"
    _check_workload_runs(wl, plan)                         # titan-run's own check of the workload keys: passes


def test_the_estimate_predicts_it_as_a_what_if(capsys):
    q = ["estimate", "--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm", "--pp", "4", "--dp-shard",
         "16", "--schedule", "ZBVZeroBubble", "--stages-per-rank", "2", "--ac", "full", "--seq-len", "8192",
         "--global-batch", "128"]
    assert main([*q, "--pp-grad-sync", "every_microbatch", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["titan_run_can_run"] is False and C.R_GRAD_SYNC in doc["note"]
    assert doc["predicted"]["step_time_s"] > 0
    assert main([*q, "--json"]) == 0                       # the default (last micro-batch) runs there
    assert json.loads(capsys.readouterr().out)["titan_run_can_run"] is True


def test_an_unstated_sync_is_searched_for_what_only_it_fits():
    """Left ``auto``, titan-plan searches both syncs (`plan_command.grad_syncs_to_search`): Llama 3 405B on 2,048
    H100s at 8K, whose fastest layouts do not fit while the gradients accumulate unsharded, takes a reduce-scatter
    per micro-batch for a pick faster than any that fits the default sync; the other sync's best is reported, and a
    pick made that way does not fit under the default sync (the regime is searched for the memory it saves)."""
    from cost_models.coefficients import Coefficients
    from cost_models.estimate import estimate
    from search_spaces.table import CandidateTable
    model, wl = load_model("llama3-405b"), Workload(seq_len=8192, global_batch=512)
    space = load_space("dense")
    kw = dict(world_size=2048, pp_splits=("layers", "weighted"), tp_activations=("auto", "sharded"))
    both = plan_candidates(space, model, H100, wl, grad_syncs=("auto", "every_microbatch"), **kw)
    default = plan_candidates(space, model, H100, wl, **kw)
    assert both.workload.pp_grad_sync == "every_microbatch" and default.workload.pp_grad_sync == "auto"
    assert set(both.sync_best) == {"auto", "every_microbatch"} and default.sync_best == {}
    pick = both.table.plan(both.best())
    assert pick.pp > 1 and pick.fsdp_size > 1 and pick.schedule not in V_SCHEDULES
    assert both.step_time()[both.best()] < default.step_time()[default.best()]
    assert both.sync_best["auto"] == pytest.approx(float(default.step_time()[default.best()]))
    under_default = estimate(CandidateTable.from_plans([pick]), model, H100,
                             dataclasses.replace(both.workload, pp_grad_sync="auto"), Coefficients())
    assert not under_default.fits[0]


def test_the_report_says_which_sync_the_search_took(tmp_path, capsys):
    """The same question through the command line: the text report says why (each sync's best step), `--json` has
    them under ``pp_grad_sync``, and the written plan carries the sync titan-run is to run, which it takes."""
    q = ["--model", "llama3-405b", "--gpus", "2048", "--hardware", "h100-sxm", "--seq-len", "8192",
         "--global-batch", "512"]
    assert main([*q, "--no-write", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pp_grad_sync"]["chosen"] == "every_microbatch"
    best = doc["pp_grad_sync"]["best_step_s"]
    assert best["every_microbatch"] < best["auto"]
    out = tmp_path / "plan.yaml"
    assert main([*q, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pipeline gradient sync: every_microbatch (" in text and f"best step {best['auto']:.4g} s" in text
    written = yaml.safe_load(out.read_text())
    plan, wl = Plan(**written["plan"]), Workload(**written["workload"])
    assert wl.pp_grad_sync == "every_microbatch" and written["inputs"]["workload"]["pp_grad_sync"] == "auto"
    _check_workload_runs(wl, plan)


def test_when_no_setting_fits_the_estimate_says_how_close_each_comes(capsys):
    """The Llama 3 paper's 8,192-GPU layout asked with the degrees only, under Interleaved1F1B with two stages per
    rank (four fit: 77.8 GiB with sequence shards and a reduce-scatter per micro-batch): none of titan-run's
    settings of the unstated TP-activation and gradient-sync keys fits, so the figures stay the defaults' and one
    note gives each setting's peak and names the smallest (not the defaults' 191 GiB alone)."""
    args = ["estimate", "--model", "llama3-405b", "--hardware", "h100-sxm", "--gpus", "8192", "--seq-len", "8192",
            "--global-batch", "2048", "--tp", "8", "--pp", "16", "--dp-shard", "64", "--ac", "none",
            "--schedule", "Interleaved1F1B", "--stages-per-rank", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("note: tp-activations, pp-grad-sync not given"))
    assert "no setting fits, the figures are the defaults'" in note
    peaks = {label: float(p) for label, p in re.findall(r"(?:; |\()(\w+, \w+): [^;]*?peak ([0-9.]+) GiB", note)}
    assert set(peaks) == {f"{a}, {b}" for a in ("gathered", "sharded") for b in ("last_microbatch", "every_microbatch")}
    smallest = min(peaks, key=peaks.get)
    assert f"the smallest peak is {smallest}'s" in note
    assert peaks["gathered, last_microbatch"] > peaks[smallest]
    assert "DOES NOT FIT" in out
    # the figures printed are the defaults' (gathered, last_microbatch)
    shown = float(re.search(r"peak\s+([0-9.]+)\s+\(usable", out).group(1))
    assert abs(shown - peaks["gathered, last_microbatch"]) < 0.1


def test_the_llama3_8192_gpu_interleaved_layout_fits_under_titan_runs_own_settings(capsys):
    """The layout that trained (arXiv:2407.21783 Table 4: TP 8, PP 16, DP 64, 8K, no recompute) under
    Interleaved1F1B with four stages per rank, asked with the degrees only: titan-run's sequence shards, a
    reduce-scatter per micro-batch, its rebuilt FFN input and its released stage outputs make it fit."""
    args = ["estimate", "--model", "llama3-405b", "--hardware", "h100-sxm", "--gpus", "8192", "--seq-len", "8192",
            "--global-batch", "2048", "--tp", "8", "--pp", "16", "--dp-shard", "64", "--ac", "none",
            "--schedule", "Interleaved1F1B", "--stages-per-rank", "4", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["predicted"]["headroom_gib"] >= 0 and doc["titan_run_can_run"]
    assert doc["workload"]["tp_activations"] == "sharded" and doc["workload"]["pp_grad_sync"] == "every_microbatch"
    assert doc["workload"]["pp_sent_tensors"] == "auto" and doc["workload"]["swiglu_impl"] == "auto"
