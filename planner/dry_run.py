"""The dry-run stage: apply top candidates for the full world in one process, before any trial.

For each candidate the planner writes a plan file and runs
``titan-run --dry-run --plan P --world N --json`` in a subprocess (the
planner stays torch-free). The dry run applies the plan exactly as a real
run would on the meta device under a fake process group, so it (1) catches
layouts the executor cannot apply and (2) gives each rank's exact parameter,
gradient and optimizer bytes, which are compared with the analytic memory
model's figures for the same candidate.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from search_spaces.planfile import write_plan_file

from .rank import PlanningResult


def dry_run_candidates(res: PlanningResult, idx: list[int], *, model_ref: str, workload: dict[str, Any],
                       timeout_s: float = 300.0) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in idx:
            plan = res.table.plan(int(i))
            f = Path(tmp) / f"cand{i}.yaml"
            write_plan_file(f, {"model": model_ref, "workload": workload, "plan": plan})
            cmd = [sys.executable, "-m", "executor.dry_run", "--plan", str(f), "--world", str(plan.world_size),
                   "--json"]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
                doc = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {
                    "status": "error", "error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
            except subprocess.TimeoutExpired:
                doc = {"status": "error", "error": f"dry run timed out after {timeout_s:.0f} s"}
            except ValueError:
                doc = {"status": "error", "error": "unreadable dry-run output"}
            analytic = float(res.est.memory["params"][i] + res.est.memory["grads"][i] + res.est.memory["optimizer"][i])
            row = {"index": int(i), "plan": plan, "status": doc.get("status", "error"),
                   "error": doc.get("error"), "analytic_state_bytes": analytic}
            if row["status"] == "ok":
                row["dry_run_state_bytes"] = float(doc["worst_state_bytes"])
                row["state_ratio"] = analytic / row["dry_run_state_bytes"]
            out.append(row)
    return out
