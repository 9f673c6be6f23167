"""The dry-run stage: apply top candidates for the full world in one process, before any trial.

For each candidate the planner writes a plan file and runs
``titan-run --dry-run --plan P --world N --json`` in a subprocess (the
planner stays torch-free). The dry run applies the plan exactly as a real
run would on the meta device under a fake process group, so it (1) catches
layouts the executor cannot apply and (2) gives each rank's exact parameter,
gradient and optimizer bytes, which are compared with the analytic memory
model's figures for the same candidate, and (3) with ``memory=True`` a
FakeTensor estimate of one step's peak per inspected rank (pipelined and
context-parallel layouts included), compared with the analytic peak.
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
                       timeout_s: float = 300.0, memory: bool = True) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in idx:
            plan = res.table.plan(int(i))
            f = Path(tmp) / f"cand{i}.yaml"
            write_plan_file(f, {"model": model_ref, "workload": workload, "plan": plan})
            cmd = [sys.executable, "-m", "executor.dry_run", "--plan", str(f), "--world", str(plan.world_size),
                   "--json"] + (["--memory"] if memory else [])
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
                peaks = [(r["memory_estimate"]["total"], r) for r in doc["ranks"] if r.get("memory_estimate")]
                if peaks:
                    peak, worst = max(peaks, key=lambda t: t[0])
                    row["dry_run_peak_bytes"] = float(peak)
                    row["analytic_peak_bytes"] = float(res.est.peak_memory_bytes[i])
                    row["peak_ratio"] = row["analytic_peak_bytes"] / row["dry_run_peak_bytes"]
                    row["peak_rank"] = worst["rank"]
                    row["in_flight"] = worst["memory_model"].get("in_flight_max")
            out.append(row)
    return out


def format_row(row: dict[str, Any]) -> str:
    """One line for the planner's report: state bytes and, when estimated, the step peak (worst rank)."""
    if row["status"] != "ok":
        return f"FAILED: {row['error']}"
    out = f"state {_size(row['dry_run_state_bytes'])} (analytic/dry-run {row['state_ratio']:.3f})"
    if "dry_run_peak_bytes" in row:
        out += (f"  step peak {_size(row['dry_run_peak_bytes'])} on rank {row['peak_rank']}, "
                f"{row['in_flight']:g} micro-batches in flight (analytic/dry-run {row['peak_ratio']:.3f})")
    return out


def _size(b: float) -> str:
    return f"{b / 2**30:8.3f} GiB" if b >= 2**30 else f"{b / 2**20:8.1f} MiB"
