"""`titan-plan calibrate` on a study whose 'measurements' come from known coefficients.

The measured figures are the cost model's own predictions under perturbed
coefficients (slower GEMMs, a fixed per-step cost, more activation memory), so a
correct fit must find its way back: errors after calibration far below the ones
before, every measured peak at or under its calibrated prediction, and repeated
runs of one plan counted once.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cost_models.coefficients import Coefficients
from cost_models.estimate import estimate
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from planner import calibrate as cal
from planner.cli import main as plan_main
from planner.rank import plan_candidates
from planner.trials import TrialSettings, open_study
from search_spaces.space import load_space
from search_spaces.table import CandidateTable

TRUE = Coefficients(gemm_efficiency_scale=0.55, step_overhead_s=0.05, activation_memory_scale=1.15,
                    memory_overhead_bytes=8 * 2 ** 20)


def _study(tmp_path, n_plans=12, repeats=1, noise=0.0):
    model, hw = load_model("llama3-debug"), load_hardware("cpu")
    hw = dataclasses.replace(hw, gpus_per_node=4)
    wl = Workload(seq_len=256, global_batch=32, dtype="fp32")
    res = plan_candidates(load_space("dense"), model, hw, wl, world_size=4, gpus_per_node=4)
    idx = res.order[np.linspace(0, len(res.order) - 1, n_plans).astype(int)]
    plans = [res.table.plan(int(i)) for i in idx]
    truth = estimate(CandidateTable.from_plans(plans), model, hw, wl, TRUE)
    storage = f"sqlite:///{tmp_path / 'cal.db'}"
    attrs = {"model": "llama3-debug", "hardware": "cpu", "gpus": 4, "seq_len": 256, "global_batch": 32,
             "dtype": "fp32"}
    study = open_study(TrialSettings(storage=storage, study_name="cal"), attrs)
    rng = np.random.default_rng(0)
    for r in range(repeats):
        for p, t, m in zip(plans, truth.step_time_s, truth.peak_memory_bytes):
            trial = study.ask()
            t_meas = float(t) * (1 + noise * rng.standard_normal())
            for k, v in {"plan": p.to_dict(), "status": "ok", "step_time_s": t_meas,
                         "tokens_per_s": 8192 / t_meas, "peak_memory_bytes": float(m)}.items():
                trial.set_user_attr(k, v)
            study.tell(trial, 8192 / t_meas)
    return storage, plans, truth


def test_calibration_recovers_known_coefficients(tmp_path):
    storage, plans, truth = _study(tmp_path)
    m = cal.load_measurements(storage, "cal")
    assert len(m.plans) == len(plans)
    r = cal.calibrate(m, loo=True)
    assert r["time_before"]["median_ape_pct"] > 20          # the perturbation is visible
    assert r["time_after_loo"]["median_ape_pct"] < 3        # and the held-out plans are predicted again
    assert r["time_after_loo"]["spearman"] > 0.9
    band = r["memory_band_after"]
    assert band["max_measured_over_predicted"] <= 1.0 + 1e-9  # the promise
    assert band["min_measured_over_predicted"] > 0.97         # without over-reserving


def test_repeated_runs_count_once_and_noise_is_median(tmp_path):
    storage, plans, truth = _study(tmp_path, n_plans=6, repeats=3, noise=0.02)
    m = cal.load_measurements(storage, "cal")
    assert len(m.plans) == 6                                   # 18 trials, 6 plans
    assert np.allclose(m.step_time_s, truth.step_time_s, rtol=0.05)


def test_cli_calibrate_writes_a_file_the_planner_uses(tmp_path, capsys):
    storage, _, _ = _study(tmp_path, n_plans=8)
    out = tmp_path / "calibration.yaml"
    assert plan_main(["calibrate", "--storage", storage, "--out", str(out), "--no-loo"]) == 0
    printed = capsys.readouterr().out
    assert "measured/predicted after" in printed
    c = Coefficients.load(out)
    assert c.memory_scale >= 1.0 and c.gemm_efficiency_scale < 0.8
    assert plan_main(["--model", "llama3-debug", "--hardware", "cpu", "--gpus", "4", "--calibration", str(out),
                      "--no-write", "--json"]) == 0


def test_cli_calibrate_says_when_there_are_too_few_trials_to_check(tmp_path, capsys):
    storage, _, _ = _study(tmp_path, n_plans=3)
    assert plan_main(["calibrate", "--storage", storage, "--out", str(tmp_path / "c.yaml")]) == 0
    printed = capsys.readouterr().out
    assert "no leave-one-out check with 3 trials: it needs 4" in printed and "nan" not in printed
    (tmp_path / "more").mkdir()
    storage, _, _ = _study(tmp_path / "more", n_plans=5)
    assert plan_main(["calibrate", "--storage", storage, "--out", str(tmp_path / "d.yaml")]) == 0
    printed = capsys.readouterr().out
    assert "after (leave-one-out)" in printed and "no leave-one-out" not in printed


def test_oversubscribed_cpu_host_slows_compute():
    model, wl = load_model("llama3-debug"), Workload(seq_len=256, global_batch=32, dtype="fp32")
    hw = dataclasses.replace(load_hardware("cpu"), gpus_per_node=4)
    assert hw.host_cores == 2
    space = load_space("dense")
    r4 = plan_candidates(space, model, hw, wl, world_size=4, gpus_per_node=4)
    r2 = plan_candidates(space, model, dataclasses.replace(hw, host_cores=4), wl, world_size=4, gpus_per_node=4)
    # the same candidates; 4 processes on 2 cores take twice the compute time of 4 on 4
    np.testing.assert_allclose(r4.est.time["compute"], 2.0 * r2.est.time["compute"], rtol=1e-12)
    gpu = load_hardware("h100-sxm")
    assert gpu.oversubscription(64) == pytest.approx(1.0)
