"""titan-plan searches the TP activation regime (workload ``tp_activations``) when the question states none: the
gathered inputs (``auto``, titan-run's default) and the sequence shards (``sharded``, all-gathered again in
backward: titan-run runs it on spmd_types, eager, ac none or full, no float8) are scored as workloads of their
own; under ``sharded`` the candidates titan-run cannot keep shards on are rejected
(`search_spaces.plan.tp_shards_unrunnable`, the executor's own refusals), the regime whose best candidate
is faster is chosen (the default on a tie) and written to the plan file."""
from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
import yaml

from cost_models.coefficients import Coefficients
from cost_models.estimate import estimate
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from executor.config import ConfigError, _check_workload_runs
from planner.cli import main
from planner.rank import plan_candidates
from search_spaces import constraints as C
from search_spaces.plan import Plan, tp_shards_unrunnable
from search_spaces.space import load_space
from search_spaces.table import CandidateTable

M70, A100, H100 = load_model("llama3-70b"), load_hardware("a100-80g"), load_hardware("h100-sxm")
WL = Workload(seq_len=8192, global_batch=128)
# 70B on 64 A100 at tp 4 where only the shards let the fastest layout (ac none) fit: at 8K the gathered inputs fit
# too since titan-run's FFNs rebuild their down projection's input (executor/models/layers.py rebuilt_input)
WL_LONG = dataclasses.replace(WL, seq_len=12288)


def tp4_eager_space():
    """The dense space at tp 4 (no pipeline, no CP, no HSDP), eager and without float8."""
    space = load_space("dense")
    return dataclasses.replace(space, degrees={**space.degrees, "tp": [4], "pp": [1], "cp": [1], "dp_replicate": [1]},
                               knobs={**space.knobs, "compile": [False], "float8": [False]})


def _best(res) -> float:
    return float(res.step_time()[res.best()])


def test_keeping_shards_wins_where_it_lets_a_faster_layout_fit():
    space = tp4_eager_space()
    run = lambda regimes: plan_candidates(space, M70, A100, WL_LONG, world_size=64, tp_activations=regimes)  # noqa: E731
    both, gathered, sharded = run(("auto", "sharded")), run(("auto",)), run(("sharded",))
    assert both.workload.tp_activations == "sharded" and gathered.tp_best == {} and sharded.tp_best == {}
    assert both.tp_best == pytest.approx({"auto": _best(gathered), "sharded": _best(sharded)})
    assert _best(sharded) < 0.9 * _best(gathered)
    chosen = both.table.plan(both.best())
    assert chosen.tp == 4 and chosen.ac == "none"
    # gathered, the same layout does not fit: the shards are what make it fit
    est = estimate(CandidateTable.from_plans([chosen]), M70, A100, dataclasses.replace(WL_LONG, tp_activations="gathered"),
                   Coefficients())
    assert not bool(est.fits[0])


def test_a_tie_keeps_the_gathered_default():
    """Under full recompute both regimes run at the same speed (the block keeps its input only): the default stays."""
    space = tp4_eager_space()
    res = plan_candidates(space, M70, H100, dataclasses.replace(WL, global_batch=64), world_size=16,
                          tp_activations=("auto", "sharded"))
    assert res.tp_best["auto"] == pytest.approx(res.tp_best["sharded"])
    assert res.workload.tp_activations == "auto"


def test_under_sharded_only_what_titan_run_runs_is_feasible():
    res = plan_candidates(load_space("dense"), M70, H100, WL, world_size=64, tp_activations=("sharded",))
    t = res.table
    bad = tp_shards_unrunnable(t)
    assert bad.any() and not bad[res.order].any()
    assert any(r.reason == C.R_TP_SHARDS and r.count == int(bad.sum()) for r in res.rejected)


@pytest.mark.parametrize("backend, compile_, float8, ac", itertools.product(
    ("spmd_types", "dtensor"), (False, True), (False, True), ("none", "selective", "full")))
def test_the_rule_is_the_executors(backend, compile_, float8, ac):
    """`tp_shards_unrunnable` says no exactly where titan-run refuses ``tp_activations: sharded``."""
    plan = Plan(dp_shard=2, tp=2, microbatch=1, backend=backend, compile=compile_, float8=float8, ac=ac)
    refused = True
    try:
        _check_workload_runs(Workload(seq_len=256, global_batch=8, tp_activations="sharded"), plan)
        refused = False
    except ConfigError:
        pass
    assert bool(tp_shards_unrunnable(plan)) == refused
    assert not tp_shards_unrunnable(Plan(dp_shard=4, microbatch=1, backend=backend, compile=compile_,
                                           float8=float8, ac=ac))        # tp 1: nothing to keep


def test_the_cli_writes_the_chosen_regime_and_a_stated_one_is_searched_alone(tmp_path, capsys):
    space = tp4_eager_space()
    f = tmp_path / "tp4_eager.yaml"
    f.write_text(yaml.safe_dump({"name": "tp4_eager", "degrees": space.degrees, "knobs": space.knobs,
                                 "tp_within_node": space.tp_within_node}))
    q = ["--model", "llama3-70b", "--gpus", "64", "--hardware", "a100-80g", "--seq-len", "12288", "--global-batch",
         "128", "--space", str(f)]
    out = tmp_path / "plan.yaml"
    assert main([*q, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TP activations: sharded" in text and "(set --tp-activations to fix one)" in text
    doc = yaml.safe_load(out.read_text())
    assert doc["workload"]["tp_activations"] == "sharded" and doc["plan"]["ac"] == "none"
    assert main([*q, "--no-write", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tp_activations"]["chosen"] == "sharded"
    assert main([*q, "--no-write", "--json", "--tp-activations", "gathered"]) == 0
    stated = json.loads(capsys.readouterr().out)
    assert "tp_activations" not in stated and stated["chosen"]["ac"] != "none"


def test_the_sharded_scoring_reuses_the_gathered_one_exactly():
    """The sharded regime re-estimates only the candidates it changes (tp > 1 and runnable under it) on top of the
    gathered run of the same split; every other candidate's figures are the gathered ones, and each candidate's
    figures equal a full estimate of the sharded workload where the regime is runnable (NaN time figures alike:
    the search times only what fits)."""
    from planner import rank
    space, wl = load_space("dense"), dataclasses.replace(WL, tp_activations="sharded")
    kw = dict(world_size=64, gpus_per_node=None, coeffs=None, memory_margin=0.0, rank_by="time")
    gathered = rank._plan_one(space, M70, H100, WL, **kw)
    fresh = rank._plan_one(space, M70, H100, wl, **kw)
    reused = rank._plan_one(space, M70, H100, wl, reuse=gathered, **kw)
    ok = ~tp_shards_unrunnable(fresh.table)
    assert (fresh.table.tp > 1).any() and (ok & (fresh.table.tp > 1)).any() and (~ok).any()
    for name in ("step_time_s", "peak_memory_bytes", "step_time_p90_s", "peak_memory_p90_bytes", "fits"):
        assert np.array_equal(getattr(reused.est, name)[ok], getattr(fresh.est, name)[ok], equal_nan=True), name
    for part in ("memory", "time"):
        for k, v in getattr(fresh.est, part).items():
            assert np.array_equal(getattr(reused.est, part)[k][ok], v[ok], equal_nan=True), (part, k)
    assert np.array_equal(reused.order, fresh.order) and reused.rejected == fresh.rejected
    tp1 = fresh.table.tp == 1
    assert np.array_equal(fresh.est.step_time_s[tp1], gathered.est.step_time_s[tp1], equal_nan=True)  # tp 1: the same


@pytest.mark.parametrize("ac, policy", [("none", "matmul"), ("full", "matmul"), ("selective", "matmul"),
                                        ("selective", "op"), ("selective", "attention")])
def test_without_tp_the_regime_changes_nothing(ac, policy):
    """At tp 1 there is nothing gathered to keep or shard: both regimes give the same figures (the 'matmul'
    policy's kept shards of the gathered inputs are a tp > 1 term, as the gathered inputs are)."""
    plans = [Plan(dp_shard=8, microbatch=1, ac=ac, runnable=False), Plan(dp_shard=4, cp=2, microbatch=2, ac=ac)]
    tab = CandidateTable.from_plans(plans)
    est = {r: estimate(tab, M70, H100, dataclasses.replace(WL, tp_activations=r, selective_ac=policy), Coefficients())
           for r in ("gathered", "sharded")}
    assert np.array_equal(est["gathered"].peak_memory_bytes, est["sharded"].peak_memory_bytes)
    assert np.array_equal(est["gathered"].step_time_s, est["sharded"].step_time_s)


def test_the_estimate_takes_the_regime_the_search_would(capsys):
    """Without --tp-activations (and --ac) an eager TP layout is estimated under the regime whose best setting is
    fastest among those that fit, said in a note; given, no note and that regime's figures."""
    q = ["estimate", "--model", "llama3-70b", "--gpus", "64", "--hardware", "a100-80g", "--seq-len", "12288",
         "--global-batch", "128", "--tp", "4", "--no-compile", "--microbatch", "1", "--json"]
    docs = {}
    for name, extra in (("auto", []), ("gathered", ["--tp-activations", "gathered"]),
                        ("sharded", ["--tp-activations", "sharded"])):
        assert main([*q, *extra]) == 0
        docs[name] = json.loads(capsys.readouterr().out)
    auto, gathered, sharded = docs["auto"], docs["gathered"], docs["sharded"]
    assert sharded["predicted"]["step_time_s"] < gathered["predicted"]["step_time_s"]
    assert auto["workload"]["tp_activations"] == "sharded" and auto["predicted"] == sharded["predicted"]
    assert auto["plan"]["ac"] == "none" and gathered["plan"]["ac"] != "none"
    assert any(n.startswith("tp-activations not given: 'sharded'") for n in auto["knob_notes"])
    assert not any(n.startswith("tp-activations") for n in gathered["knob_notes"] + sharded["knob_notes"])
    # compiled, titan-run keeps no shards: the gathered regime, no note
    assert main([*q, "--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["workload"]["tp_activations"] == "auto"
    assert not any(n.startswith("tp-activations") for n in compiled["knob_notes"])


def test_a_stated_regime_is_estimated_on_any_layout(capsys):
    """A stated ``sharded`` is a what-if (another framework's regime, e.g. the Llama 3 stack's) also where titan-run
    keeps no shards: compiled, it is still estimated, with titan-run's limit left to titan-run."""
    q = ["estimate", "--model", "llama3-70b", "--gpus", "64", "--hardware", "a100-80g", "--seq-len", "8192",
         "--global-batch", "128", "--tp", "4", "--compile", "--tp-activations", "sharded", "--json"]
    assert main(q) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["tp_activations"] == "sharded" and doc["plan"]["compile"] is True


def test_auto_is_the_tools_choice_in_a_plan_file_too(tmp_path, capsys):
    """A plan file's ``tp_activations: auto`` (as titan-plan writes it) leaves the choice to the search, as an
    unstated key does; a value other than auto is searched alone."""
    space = tp4_eager_space()
    f = tmp_path / "tp4_eager.yaml"
    f.write_text(yaml.safe_dump({"name": "tp4_eager", "degrees": space.degrees, "knobs": space.knobs,
                                 "tp_within_node": space.tp_within_node}))
    for value, searched in (("auto", True), ("gathered", False)):
        q = tmp_path / f"q_{value}.yaml"
        q.write_text(yaml.safe_dump({"model": "llama3-70b", "hardware": "a100-80g", "plan": {"tp": 4, "dp_shard": 16},
                                     "workload": {"seq_len": 8192, "global_batch": 128, "tp_activations": value}}))
        assert main(["--plan", str(q), "--gpus", "64", "--space", str(f), "--no-write", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert ("tp_activations" in doc) is searched, value
