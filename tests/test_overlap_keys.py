"""Workload keys ``tp_comm_overlap`` / ``dp_comm_overlap``: a run's TP and DP overlap switches, by flag and plan
file (they were reachable only through a calibration file's ``tp_overlap`` / ``dp_overlap``)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from cost_models.coefficients import Coefficients
from cost_models.estimate import estimate
from cost_models.specs import SpecError, load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import assert_titan_run_refuses, planner_cli

H100 = load_hardware("h100-sxm")
LLAMA70 = load_model("llama3-70b")
# TP 8 x PP 4 x DP 4: TP collectives, pipeline, and a data-parallel gradient reduction on the critical path
PLAN = Plan(tp=8, pp=4, dp_shard=4, microbatch=1, n_microbatches=16, schedule="Interleaved1F1B", stages_per_rank=2,
            ac="none", runnable=False)
ESTIMATE = ["estimate", "--model", "llama3-70b", "--gpus", "128", "--hardware", "h100-sxm", "--seq-len", "8192",
            "--global-batch", "64", "--tp", "8", "--pp", "4", "--microbatch", "1", "--schedule", "Interleaved1F1B",
            "--stages-per-rank", "2", "--ac", "none", "--json", "--reshard",    # the plan file's (PLAN's) resharding
            "--tp-activations", "gathered"]     # stated: the layout keeps its TP regime on every path compared


def _time(wl: Workload, coeffs: Coefficients | None = None) -> dict:
    e = estimate(CandidateTable.from_plans([PLAN]), LLAMA70, H100, wl, coeffs or Coefficients())
    return {k: float(v[0]) for k, v in e.time.items()}


def _wl(**kw) -> Workload:
    return Workload(seq_len=8192, global_batch=64, **kw)


def test_each_value_is_the_overlap_coefficient_it_names():
    for key, coeff, part in (("tp_comm_overlap", "tp_overlap", "tp_comm"), ("dp_comm_overlap", "dp_overlap", "dp_comm")):
        none, full = _time(_wl(**{key: "none"})), _time(_wl(**{key: "full"}))
        assert none == _time(_wl(), Coefficients().replace(**{coeff: 0.0})), key
        assert full == _time(_wl(), Coefficients().replace(**{coeff: 1.0})), key
        assert full[part] < none[part], (key, full[part], none[part])
        # an explicit value wins over a calibration's coefficient; auto keeps the coefficient
        assert _time(_wl(**{key: "none"}), Coefficients().replace(**{coeff: 1.0})) == none, key
        assert _time(_wl(), Coefficients().replace(**{coeff: 0.5}))[part] != none[part], key
    # only the named part moves, the pipeline bubble made of the stage times that hold it, and the data-parallel
    # traffic that the exposed TP waits hid (TP inside the node, DP across nodes: data_parallel.overlap_windows)
    a, b = _time(_wl(tp_comm_overlap="none")), _time(_wl(tp_comm_overlap="full"))
    assert {k for k in a if not np.isclose(a[k], b[k])} == {"tp_comm", "pp_bubble", "dp_comm"}, (a, b)
    assert b["dp_comm"] > a["dp_comm"] and b["tp_comm"] + b["dp_comm"] < a["tp_comm"] + a["dp_comm"], (a, b)


def test_bad_values_are_refused_in_one_line():
    with pytest.raises(SpecError) as ei:
        _wl(tp_comm_overlap="asynch")
    msg = str(ei.value)
    assert "\n" not in msg and "tp_comm_overlap" in msg and "auto, none, full, async" in msg, msg


def test_the_flags_and_the_plan_file_set_them_and_json_echoes_them(tmp_path):
    via_flag = planner_cli(*ESTIMATE, "--tp-comm-overlap", "full", "--dp-comm-overlap", "none")
    assert via_flag.returncode == 0, via_flag.stderr
    doc = json.loads(via_flag.stdout)
    assert doc["workload"]["tp_comm_overlap"] == "full" and doc["workload"]["dp_comm_overlap"] == "none"
    cal = tmp_path / "cal.yaml"
    Coefficients(tp_overlap=1.0, dp_overlap=0.0).save(cal)
    via_cal = planner_cli(*ESTIMATE, "--calibration", str(cal))
    assert via_cal.returncode == 0, via_cal.stderr
    assert json.loads(via_cal.stdout)["predicted"] == doc["predicted"]
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({
        "model": "llama3-70b", "plan": PLAN.to_dict(),
        "workload": {"seq_len": 8192, "global_batch": 64, "tp_comm_overlap": "full", "dp_comm_overlap": "none"}}))
    via_file = planner_cli(*ESTIMATE, "--plan", str(plan_file))
    assert via_file.returncode == 0, via_file.stderr
    assert json.loads(via_file.stdout)["predicted"] == doc["predicted"]
    plain = json.loads(planner_cli(*ESTIMATE).stdout)
    assert plain["workload"]["tp_comm_overlap"] == "auto" and plain["predicted"] != doc["predicted"]


def test_titan_run_refuses_what_it_does_not_run(tmp_path):
    assert_titan_run_refuses(tmp_path, "tp_comm_overlap", "full", ["auto", "none"])
    assert_titan_run_refuses(tmp_path, "tp_comm_overlap", "async", ["auto", "none"])
    assert_titan_run_refuses(tmp_path, "dp_comm_overlap", "none", ["auto", "full"])



def test_on_a_cpu_host_auto_overlaps_nothing():
    """gloo runs its collectives in host threads on the cores the compute uses: on a ``device: cpu`` host an
    unstated ``dp_comm_overlap`` is ``none`` (and the CP ring's exchanges are not hidden either); a stated value
    and an accelerator keep theirs."""
    cpu, debug = load_hardware("cpu"), load_model("llama3-debug")
    t = CandidateTable.from_plans([Plan(dp_shard=2, microbatch=8, compile=True), Plan(cp=2, microbatch=8)])
    auto, full = (Workload(seq_len=256, global_batch=16, **kw) for kw in ({}, {"dp_comm_overlap": "full"}))

    def est(w, coeffs=None, hw=cpu):
        return estimate(t, debug, hw, w, coeffs or Coefficients())

    serial = Coefficients(dp_overlap=0.0, cp_overlap=0.0)
    assert np.array_equal(est(auto).step_time_s, est(auto, serial).step_time_s)
    assert est(auto).time["dp_comm"][0] > 2 * est(full).time["dp_comm"][0]       # the FSDP plan's collectives
    assert est(auto).time["cp_comm"][1] > est(full).time["cp_comm"][1]            # the CP ring's exchanges
    # an accelerator keeps the coefficients' overlap under auto
    assert np.array_equal(est(auto, hw=H100).step_time_s, est(full, hw=H100).step_time_s)
    assert (est(auto, serial, hw=H100).step_time_s > est(auto, hw=H100).step_time_s).all()
