"""`titan-plan estimate` on a layout that does not fit lists what would make it fit (planner/remedies.py): each
single change that fits, fastest first, else changes together (titan-run's own first), else that the degrees
must change.  Every figure it gives is checked against the estimate of the changed layout itself."""
from __future__ import annotations

import json

import pytest

from tests.cost_model_helpers import planner_cli

H100 = ["estimate", "--hardware", "h100-sxm", "--json"]
L8B = [*H100, "--model", "llama3-8b", "--gpus", "8"]


def _est(*args) -> dict:
    r = planner_cli(*args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _check_against_its_own_estimate(base: list[str], remedy: dict) -> None:
    """The remedy's flags appended to the question give the figures the remedy states."""
    got = _est(*base, *remedy["flags"].split())
    assert got["predicted"]["peak_memory_gib"] == pytest.approx(remedy["peak_memory_gib"], abs=2e-3), remedy
    assert got["predicted"]["step_time_s"] == pytest.approx(remedy["step_time_s"], rel=1e-5), remedy
    assert (got["predicted"]["headroom_gib"] >= 0) == remedy["fits"], remedy


def test_single_changes_that_fit_fastest_first():
    base = [*L8B, "--seq-len", "8192", "--global-batch", "16", "--ac", "selective", "--microbatch", "2"]
    doc = _est(*base)
    assert doc["predicted"]["headroom_gib"] < 0 and doc["remedies"]["combined"] is None
    single = doc["remedies"]["single"]
    assert {d["flags"] for d in single} == {"--microbatch 1", "--ac full"}, single
    assert [d["step_time_s"] for d in single] == sorted(d["step_time_s"] for d in single)
    for d in single:
        assert d["fits"] and d["titan_run"]
        _check_against_its_own_estimate(base, d)


def test_changes_together_when_no_single_one_fits():
    base = [*L8B, "--seq-len", "32768", "--global-batch", "8", "--tp", "2", "--ac", "selective", "--microbatch", "2"]
    doc = _est(*base)
    rem = doc["remedies"]
    assert rem["single"] == [] and rem["combined"]["flags"] == "--ac full --microbatch 1", rem
    assert rem["combined"]["titan_run"] and rem["combined"]["fits"]
    _check_against_its_own_estimate(base, rem["combined"])
    for one in ("--ac full", "--microbatch 1"):     # neither alone fits
        assert _est(*base, *one.split())["predicted"]["headroom_gib"] < 0, one


def test_another_frameworks_regime_only_when_titan_runs_own_changes_do_not_fit():
    base = [*L8B, "--seq-len", "65536", "--global-batch", "8", "--tp", "2", "--ac", "selective", "--microbatch", "1"]
    rem = _est(*base)["remedies"]
    assert rem["single"] == [] and not rem["combined"]["titan_run"] and rem["combined"]["fits"], rem
    assert "--loss-impl fused" in rem["combined"]["flags"]
    _check_against_its_own_estimate(base, rem["combined"])
    assert _est(*base, "--ac", "full")["predicted"]["headroom_gib"] < 0    # titan-run's own: all tried, none fits


def test_text_report_and_a_layout_that_fits():
    base = ["estimate", "--hardware", "h100-sxm", "--model", "llama3-405b", "--gpus", "64", "--seq-len", "8192",
            "--global-batch", "64", "--tp", "8", "--ac", "full"]
    r = planner_cli(*base)
    assert r.returncode == 0, r.stderr
    tail = r.stdout.strip().splitlines()[-3:]
    assert tail[0].startswith("does not fit by ") and "no single change fits" in tail[0], tail
    assert tail[1].startswith("  even together, still DOES NOT FIT: ") and "the degrees must change" in tail[2], tail
    fits = _est(*L8B, "--seq-len", "8192", "--global-batch", "16", "--ac", "full", "--microbatch", "1")
    assert fits["predicted"]["headroom_gib"] >= 0 and fits["remedies"] is None
