"""titan-run --dry-run: exact per-rank state bytes for a big world in one process, equal to the cost model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from cost_models.estimate import estimate
from cost_models.specs import Workload, load_hardware, load_model
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable


def dry_run(tmp_path, model, plan: Plan, seq_len, gb, *extra):
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump({"model": model, "workload": {"seq_len": seq_len, "global_batch": gb},
                                 "plan": plan.to_dict()}))
    r = subprocess.run([sys.executable, "-m", "executor.cli", "--dry-run", "--plan", str(f), "--json", *extra],
                       capture_output=True, text=True, timeout=600)
    return r


@pytest.mark.parametrize("plan", [
    Plan(dp_shard=64, tp=8, pp=2, n_microbatches=4, schedule="1F1B"),
    Plan(dp_replicate=2, dp_shard=32, tp=4, cp=2, n_microbatches=2, microbatch=1),
    Plan(dp_shard=16, pp=4, n_microbatches=8, schedule="Interleaved1F1B", stages_per_rank=2, tp=2),
])
def test_dry_run_state_bytes_match_cost_model(tmp_path, plan):
    r = dry_run(tmp_path, "llama3-8b", plan, 4096, plan.global_batch())
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["status"] == "ok" and doc["world"] == plan.world_size
    assert len(doc["ranks"]) == plan.pp          # first rank of each stage
    est = estimate(CandidateTable.from_plans([plan]), load_model("llama3-8b"), load_hardware("h100-sxm"),
                   Workload(seq_len=4096, global_batch=plan.global_batch()))
    analytic = est.memory["params"][0] + est.memory["grads"][0] + est.memory["optimizer"][0]
    assert doc["worst_state_bytes"] == pytest.approx(analytic, rel=0.01)


def test_dry_run_memory_estimate(tmp_path):
    r = dry_run(tmp_path, "llama3-debug", Plan(dp_shard=4, tp=2, microbatch=2), 256, 8, "--memory")
    assert r.returncode == 0, r.stderr[-2000:]
    est = json.loads(r.stdout.strip().splitlines()[-1])["ranks"][0]["memory_estimate"]
    assert est["total"] > est["act"] > 0


def test_dry_run_refuses_bad_plan(tmp_path):
    r = dry_run(tmp_path, "llama3-8b", Plan(dp_shard=2, tp=3), 4096, 2)
    assert r.returncode == 2 and "tp" in r.stderr and len(r.stderr.strip().splitlines()) == 1
