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
    base = [*L8B, "--seq-len", "8192", "--global-batch", "16", "--ac", "selective", "--microbatch", "2",
            "--selective-ac", "matmul"]
    doc = _est(*base)
    assert doc["predicted"]["headroom_gib"] < 0 and doc["remedies"]["combined"] is None
    single = doc["remedies"]["single"]
    assert {d["flags"] for d in single} == {"--microbatch 1", "--ac full", "--selective-ac op"}, single
    # unstated, the estimate takes the per-op policy itself (the remedy's figures)
    auto = _est(*base[:-2])
    assert auto["workload"]["selective_ac"] == "op" and auto["predicted"]["headroom_gib"] >= 0
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


def test_the_frameworks_under_whose_regime_it_fits():
    """The Llama 3 paper's 405B layout at 8K without recompute and without resharding after forward
    (arXiv:2407.21783 Table 4, Sec. 3.3.2; it trained) does not fit under titan-run's kernels (with resharding
    it does: tests/test_grad_sync_search.py); the report names the regime it fits under, with the figures that
    ``--framework NAME`` gives for the same layout, and none when the question already is under it."""
    base = ["estimate", "--hardware", "h100-sxm", "--model", "llama3-405b", "--gpus", "8192", "--seq-len", "8192",
            "--global-batch", "2048", "--tp", "8", "--pp", "16", "--schedule", "Interleaved1F1B",
            "--stages-per-rank", "4", "--ac", "none", "--no-reshard"]
    doc = _est(*base, "--json")
    fws = doc["remedies"]["frameworks"]
    assert doc["predicted"]["headroom_gib"] < 0 and "llama3-meta" in {d["framework"] for d in fws}, fws
    assert [d["step_time_s"] for d in fws] == sorted(d["step_time_s"] for d in fws)
    for d in fws:
        _check_against_its_own_estimate([*base, "--json"], {**d, "fits": True})
    text = planner_cli(*base).stdout
    assert "it fits under another framework's regime (titan-run does not run it): --framework llama3-meta" in text
    under = _est(*base, "--json", "--framework", "llama3-meta")
    assert under["predicted"]["headroom_gib"] >= 0 and under["remedies"] is None


def test_the_weighted_pipeline_split_is_a_remedy_titan_run_runs():
    """Llama 3 405B (126 layers) over PP 8: the layers-only split gives stage 0 16 layers, and stage 0 keeps the
    most micro-batches in flight; the weighted split gives it the embedding and 15 (128 units / 8).  At seq 9984
    the layout misses 80 GB by ~0.5 GiB and --pp-split weighted alone makes it fit, at the figures its own estimate
    gives."""
    base = [*H100, "--model", "llama3-405b", "--gpus", "512", "--pp", "8", "--tp", "8", "--dp-shard", "8",
            "--global-batch", "1024", "--ac", "full", "--microbatch", "4", "--seq-len", "9984",
            "--tp-activations", "gathered",     # (keeping TP shards would make it fit too,
            "--pp-grad-sync", "last_microbatch"]     # and so would a reduce-scatter per micro-batch)
    doc = _est(*base)
    assert doc["predicted"]["headroom_gib"] < 0
    split = [d for d in doc["remedies"]["single"] if d["flags"] == "--pp-split weighted"]
    assert len(split) == 1 and split[0]["titan_run"] and split[0]["fits"], doc["remedies"]
    _check_against_its_own_estimate(base, split[0])
