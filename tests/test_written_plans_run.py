"""What titan-plan writes, titan-run takes: the best plans of the search, over models, device counts, spaces (both
backends) and the workload keys titan-run runs on some layouts only, all pass titan-run's own plan checks
(``executor.config.check_plan_runs``: degrees, the model's and the workload's refusals, the backend's), and so does the
plan file the CLI writes.  The cases where the search used to write a refused plan are among them: ``pp_grad_sync:
every_microbatch`` under a V schedule, float8 TP or a V pipeline over replicas on the dtensor backend."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from executor.config import ConfigError, check_plan_runs
from planner.cli import main
from planner.rank import plan_candidates
from search_spaces.plan import Plan
from search_spaces.space import load_space

QUESTIONS = [("llama3-8b", 16, "a100-80g", "dense", 2048), ("llama3-70b", 64, "h100-sxm", "dense", 4096),
             ("llama3-405b", 1024, "h100-sxm", "dense", 8192), ("mixtral-8x7b", 64, "h100-sxm", "moe", 4096),
             ("deepseek-v3-671b", 1024, "h100-sxm", "moe", 4096)]
WORKLOADS = [{}, {"pp_grad_sync": "every_microbatch"}, {"tp_activations": "sharded"}, {"pp_split": "weighted"}]
TOP = 50


def _refusals(res, model) -> list[str]:
    out = []
    for i in res.order[:TOP]:
        try:
            check_plan_runs(res.table.plan(i), model, res.workload, res.table.plan(i).world_size)
        except ConfigError as e:
            out.append(f"{res.table.plan(i).describe()}: {e}")
    return out


@pytest.mark.parametrize("backend", ["spmd_types", "dtensor"])
@pytest.mark.parametrize("name, world, hw, space, seq", QUESTIONS)
def test_the_best_plans_are_ones_titan_run_takes(name, world, hw, space, seq, backend):
    model, h = load_model(name), load_hardware(hw)
    sp = load_space(space)
    sp = dataclasses.replace(sp, knobs={**sp.knobs, "backend": [backend]})
    checked = 0
    for keys in WORKLOADS:
        res = plan_candidates(sp, model, h, Workload(seq_len=seq, global_batch=256, **keys), world_size=world)
        assert _refusals(res, model) == [], keys
        checked += min(TOP, res.n_feasible)
    assert checked > 0


def test_the_written_plan_file_is_one_titan_run_takes(tmp_path, capsys):
    for keys in (["--pp-grad-sync", "every_microbatch"], ["--pp-split", "weighted"], []):
        out = tmp_path / "plan.yaml"
        assert main(["--model", "deepseek-v3-671b", "--gpus", "1024", "--hardware", "h100-sxm", "--seq-len", "4096",
                     "--global-batch", "256", *keys, "--out", str(out)]) == 0
        capsys.readouterr()
        doc = yaml.safe_load(out.read_text())
        plan = Plan(**doc["plan"])
        check_plan_runs(plan, load_model(doc["model"]), Workload(**doc["workload"]), 1024)
