"""The search takes TorchTitan's per-op selective policy (workload ``selective_ac: op``, every other matmul of a block
recomputed) where only it lets a faster layout fit, as `titan-plan estimate` does for one layout: titan-run runs both
policies (executor/parallel/activation_checkpoint.py, tests/test_selective_ac.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

from cost_models.estimate import estimate
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from planner.rank import plan_candidates
from search_spaces.space import load_space
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import planner_cli

M70, H100 = load_model("llama3-70b"), load_hardware("h100-sxm")
WL = Workload(seq_len=8192, global_batch=128)
SPACE = load_space("dense")


@pytest.fixture(scope="module")
def searched():
    both = plan_candidates(SPACE, M70, H100, WL, world_size=64, selective_acs=("auto", "op"))
    own = plan_candidates(SPACE, M70, H100, WL, world_size=64)
    op = plan_candidates(SPACE, M70, H100, dataclasses.replace(WL, selective_ac="op"), world_size=64)
    return both, own, op


def test_the_per_op_policy_wins_where_it_lets_a_faster_layout_fit(searched):
    """Llama 3 70B on 64 H100s at 8K: the fastest layout that fits under every-matmul selective recompute is slower
    than the one the per-op policy fits; the search takes that, and its figures are a direct estimate's."""
    both, own, op = searched
    assert both.workload.selective_ac == "op"
    best = both.best()
    plan = both.table.plan(best)
    assert plan.ac == "selective"
    assert both.step_time()[best] < own.step_time()[own.best()]
    assert both.policy_best["op"] == pytest.approx(float(both.step_time()[best]))
    assert both.policy_best["auto"] == pytest.approx(float(own.step_time()[own.best()]))
    # searched only where the default does not fit, yet the same pick as a search under the per-op policy alone
    assert both.step_time()[best] == pytest.approx(float(op.step_time()[op.best()]))
    direct = estimate(CandidateTable.from_plans([plan]), M70, H100, dataclasses.replace(WL, selective_ac="op"))
    assert float(direct.step_time_s[0]) == pytest.approx(float(both.step_time()[best]))
    assert float(direct.peak_memory_bytes[0]) == pytest.approx(float(both.peak_memory()[best]))
    assert bool(direct.fits[0])


def test_where_every_matmul_output_fits_the_default_stays():
    """Llama 3 8B on 64 H100s at 8K: nothing needs the per-op policy, so the default policy is kept."""
    res = plan_candidates(SPACE, load_model("llama3-8b"), H100, Workload(seq_len=8192, global_batch=96),
                          world_size=64, selective_acs=("auto", "op"))
    assert res.workload.selective_ac == "auto"
    assert set(res.policy_best) == {"auto", "op"}
    assert res.policy_best["auto"] <= res.policy_best["op"]


def test_the_cli_says_so_and_writes_a_plan_titan_run_accepts(tmp_path):
    from executor.config import _check_workload_runs
    from search_spaces.plan import Plan
    out = tmp_path / "plan.yaml"
    r = planner_cli("--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm", "--seq-len", "8192",
                    "--global-batch", "128", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "selective checkpointing: op (TorchTitan's per-op policy" in r.stdout
    doc = yaml.safe_load(out.read_text())
    assert doc["workload"]["selective_ac"] == "op" and doc["plan"]["ac"] == "selective"
    _check_workload_runs(Workload(**doc["workload"]), Plan.from_dict(doc["plan"]))   # titan-run's one-line refusals
    # stated, it is not searched
    r = planner_cli("--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm", "--seq-len", "8192",
                    "--global-batch", "128", "--selective-ac", "matmul", "--no-write")
    assert r.returncode == 0 and "selective checkpointing: op" not in r.stdout
