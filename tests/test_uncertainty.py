"""Error bands (cost_models/uncertainty.py) and their derivation (bench/derive_uncertainty.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cost_models.estimate import estimate
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from cost_models.uncertainty import (MEMORY_GROUPS, TIME_GROUPS, Spreads, UncertaintyError, bands, load_spreads,
                                     uncovered_at)
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable

from tests.cost_model_helpers import load_bench

ROOT = Path(__file__).resolve().parents[1]




def _spreads(**over) -> Spreads:
    d = dict(time={"compute": 0.1, "tp_comm": 0.2, "cp_comm": 0.0, "ep_comm": 0.0, "dp_comm": 0.5, "pp": 0.3},
             memory={"states": 0.02, "activations": 0.1, "buffers": 0.0},
             time_rows={"compute": 30, "tp_comm": 10, "cp_comm": 0, "ep_comm": 1, "dp_comm": 10, "pp": 10},
             memory_rows={"states": 10, "activations": 10, "buffers": 10},
             regimes=frozenset({"1F1B on a dense model", "no pipeline, a dense model",
                                "full activation checkpointing above 100B parameters", "fsdp2 state layout",
                                "hardware h100-sxm", "tensor parallel keeping gathered inputs"}), max_world=16384, min_share=0.05, min_rows=3)
    d.update(over)
    return Spreads(**d)


def _table(**plan):
    base = dict(dp_shard=8, pp=1, tp=8, cp=1, microbatch=1, n_microbatches=4, schedule="1F1B", ac="full")
    base.update(plan)
    return CandidateTable.from_plans([Plan(**base)])


def test_band_is_the_share_weighted_sum_of_term_spreads():
    sp = _spreads()
    t = _table()
    time = {"compute": np.array([6.0]), "other": np.array([1.0]), "tp_comm": np.array([2.0]),
            "dp_comm": np.array([1.0]), "pp_bubble": np.array([0.0])}
    mem = {"params": np.array([10.0]), "grads": np.array([10.0]), "optimizer": np.array([20.0]),
           "activations": np.array([50.0]), "logits": np.array([10.0])}
    b = bands(t, load_model("llama3-405b"), load_hardware("h100-sxm"), Workload(seq_len=8192, global_batch=32),
              time, mem, sp)
    assert b.step_time_p90_s[0] == pytest.approx(10.0 * (1 + 0.7 * 0.1 + 0.2 * 0.2 + 0.1 * 0.5))
    assert b.peak_memory_p90_bytes[0] == pytest.approx(100.0 * (1 + 0.4 * 0.02 + 0.6 * 0.1))
    assert uncovered_at(b.uncovered, 0) == []   # every regime and leaned-on term is covered


def test_uncovered_terms_and_regimes_are_flagged_and_fall_back_to_the_widest_spread():
    sp = _spreads()
    model, hw, wl = load_model("llama3-405b"), load_hardware("h100-sxm"), Workload(seq_len=8192, global_batch=32)
    dual = _table(pp=4, dp_shard=2, schedule="DualPipeV", stages_per_rank=2, ac="none", n_microbatches=8)
    t = CandidateTable.concat([dual, _table()])
    time = {"compute": np.array([8.0, 8.0]), "ep_comm": np.array([2.0, 0.0])}
    mem = {"params": np.array([1.0, 1.0])}
    b = bands(t, model, hw, wl, time, mem, sp)
    first, second = uncovered_at(b.uncovered, 0), uncovered_at(b.uncovered, 1)
    assert "DualPipeV on a dense model" in first
    assert "no activation checkpointing above 100B parameters" in first
    assert any(s.startswith("expert-parallel all-to-all (validated on 1 published run)") for s in first)
    assert second == []
    # the uncovered EP term gets the widest covered spread (dp_comm 0.5), not its own 0
    assert b.step_time_p90_s[0] == pytest.approx(10.0 * (1 + 0.8 * 0.1 + 0.2 * 0.5))
    big = bands(_table(dp_shard=4096), model, hw, wl, {"compute": np.array([1.0])}, mem, sp)
    assert uncovered_at(big.uncovered, 0) == ["more devices than the largest validated run (16384)"]


def test_estimates_carry_p90_arrays_and_reasons():
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm")
    t = CandidateTable.concat([_table(tp=1, dp_shard=64), _table(tp=4, dp_shard=2, pp=8, schedule="DualPipeV",
                                                                  stages_per_rank=2, n_microbatches=16)])
    e = estimate(t, model, hw, Workload(seq_len=8192, global_batch=64))
    assert e.step_time_p90_s.shape == e.step_time_s.shape == (2,)
    assert np.all(e.step_time_p90_s >= e.step_time_s) and np.all(e.peak_memory_p90_bytes >= e.peak_memory_bytes)
    row = e.row(1)
    assert row["step_time_p90_s"] == pytest.approx(float(e.step_time_p90_s[1]))
    assert "DualPipeV on a dense model" in row["uncovered"]


def test_shipped_spreads_load_and_name_what_a_broken_file_lacks(tmp_path):
    sp = load_spreads()
    assert set(sp.time) == set(TIME_GROUPS) and set(sp.memory) == set(MEMORY_GROUPS)
    assert sp.time["compute"] > 0 and sp.time_rows["compute"] >= sp.min_rows
    bad = tmp_path / "u.yaml"
    bad.write_text("time: {}\nmemory: {}\n")
    with pytest.raises(UncertaintyError, match="missing or malformed key 'compute'"):
        load_spreads(str(bad))


def test_fit_reaches_the_coverage_and_recovers_a_clean_attribution():
    du = load_bench("derive_uncertainty")
    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.ones(3), size=200)
    a = np.array([0.05, 0.4, 0.0])
    r = (w @ a) * rng.uniform(-1.0, 1.0, size=200)
    q, c, achieved = du.fit(w, r, 0.9)
    assert achieved >= 0.9 and np.all(q >= 0)
    assert q[1] > q[0] > q[2] - 1e-12           # the term that carries the error gets the widest band
    assert np.mean(r <= w @ (q * 0.8)) < 0.9     # and no wider than needed


_vr = load_bench("validate_reference")
_REF = _vr.reference_dir()


@pytest.mark.skipif(not (_REF / "published_runs.yaml").is_file(), reason=f"reference data not found under {_REF}")
def test_shipped_bands_cover_the_published_runs():
    """The derivation targets 90% of the rows under their p90; a cost-model change that moves the residuals
    far from the stored spreads shows up here (rerun bench/derive_uncertainty.py --write)."""
    cases, _ = _vr.build_cases(_vr.load_rows(_REF))
    below = []
    for c in cases:
        if "tokens_per_s_per_gpu" not in c.measured:
            continue
        coeffs = _vr.Coefficients()
        e = estimate(CandidateTable.from_plans([c.plan]), c.model, c.hw, c.workload, coeffs)
        measured_step = c.workload.global_batch_tokens / (c.measured["tokens_per_s_per_gpu"] * c.plan.world_size)
        below.append(measured_step <= e.step_time_p90_s[0] * (1 + 1e-9))
    assert len(below) >= 30 and np.mean(below) >= 0.8, np.mean(below)


def test_the_estimate_report_and_its_json_say_what_no_published_run_covers(tmp_path):
    """The uncovered terms and regimes reach the user: one 'validation:' line in the breakdown, and the list in
    --json's predicted block (the plan file's too); a covered candidate says so."""
    import json
    from tests.cost_model_helpers import planner_cli
    common = ("estimate", "--model", "llama3-8b", "--gpus", "64", "--hardware", "h100-sxm", "--seq-len", "8192",
              "--global-batch", "128", "--tp", "1", "--pp", "4", "--dp-shard", "16", "--ac", "none")
    dual = planner_cli(*common, "--schedule", "DualPipeV")
    assert dual.returncode == 0, dual.stderr
    lines = [x for x in dual.stdout.splitlines() if x.startswith("validation: ")]
    assert lines == ["validation: no published run covers DualPipeV on a dense model (the p90 bounds were not "
                     "measured there)"], dual.stdout
    doc = json.loads(planner_cli(*common, "--schedule", "DualPipeV", "--json").stdout)
    assert doc["predicted"]["not_validated"] == ["DualPipeV on a dense model"]
    plain = planner_cli(*common, "--schedule", "1F1B")
    assert "validation: every term and regime it leans on is covered by published runs" in plain.stdout, plain.stdout


def test_the_breakdown_says_when_the_p90_peak_is_over_the_usable_memory():
    """A candidate that fits by its point estimate but whose conservative peak does not gets one 'note:' line naming
    the usable memory and --rank-by p90; with the bound inside the usable memory there is no such line."""
    from cost_models.estimate import GIB
    from cost_models.specs import hardware_from_dict
    from planner.report import format_breakdown
    model, wl, table = load_model("llama3-8b"), Workload(seq_len=8192, global_batch=32), _table()
    base = load_hardware("h100-sxm")
    first = estimate(table, model, base, wl)
    peak, p90 = float(first.peak_memory_bytes[0]), float(first.peak_memory_p90_bytes[0])
    assert peak < p90

    def report(usable_bytes):
        hw = hardware_from_dict({**base.to_dict(), "memory_gib": base.memory_reserved_gib + usable_bytes / GIB})
        est = estimate(table, model, hw, wl)
        assert bool(est.fits[0])
        return [ln for ln in format_breakdown(est, 0).splitlines() if ln.startswith("note: the p90 peak")]

    between = report((peak + p90) / 2)
    assert len(between) == 1 and "usable" in between[0] and "--rank-by p90" in between[0], between
    assert report(1.01 * p90) == []
