"""The dry-run stage: apply top candidates for the full world in one process, before any trial.

For each candidate the planner writes a plan file and runs
``titan-run --dry-run --plan P --world N --json`` in a subprocess (the
planner stays torch-free). The dry run applies the plan exactly as a real
run would on the meta device under a fake process group, so it (1) catches
layouts the executor cannot apply and (2) gives each rank's exact parameter,
gradient and optimizer bytes, which are compared with the analytic memory
model's figures for the same candidate, and (3) with ``memory=True`` a
FakeTensor estimate of one step's peak per inspected rank (pipelined and
context-parallel layouts included), compared with the analytic peak; a
candidate whose simulated peak exceeds the device's usable memory leaves the
ranking like one the executor cannot apply (status ``over_memory``).
Progress: a bar on a terminal, one line per candidate otherwise (planner/progress.py).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from search_spaces.planfile import write_plan_file

from .progress import Progress
from .rank import PlanningResult


def dry_run_candidates(res: PlanningResult, idx: list[int], *, model_ref: str, workload: dict[str, Any],
                       timeout_s: float = 300.0, memory: bool = True,
                       usable_bytes: float | None = None) -> list[dict[str, Any]]:
    """One row per candidate (status ok / over_memory / error); `usable_bytes` defaults to the device's
    usable memory (`Estimates.capacity_bytes`)."""
    usable = res.est.capacity_bytes if usable_bytes is None else float(usable_bytes)
    out = []
    with tempfile.TemporaryDirectory() as tmp, Progress(len(idx), "dry run", unit="candidate") as bar:
        for i in idx:
            plan = res.table.plan(int(i))
            f = Path(tmp) / f"cand{i}.yaml"
            write_plan_file(f, {"model": model_ref, "workload": workload, "plan": plan})
            doc = _run_one(f, plan.world_size, timeout_s=timeout_s, memory=memory)
            row = drop_over_memory([_row(res, int(i), plan, doc)], usable)[0]
            out.append(row)
            bar.step(f"{plan.layout_str()} {plan.knobs_str()}: {row['status']}")
    return out


def _run_one(plan_file: Path, world: int, *, timeout_s: float, memory: bool) -> dict[str, Any]:
    """`titan-run --dry-run --json` of one plan file: its JSON document, or status error with the reason."""
    cmd = [sys.executable, "-m", "executor.dry_run", "--plan", str(plan_file), "--world", str(world),
           "--json"] + (["--memory"] if memory else [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {
            "status": "error", "error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"dry run timed out after {timeout_s:.0f} s"}
    except ValueError:
        return {"status": "error", "error": "unreadable dry-run output"}


def _row(res: PlanningResult, i: int, plan, doc: dict[str, Any]) -> dict[str, Any]:
    """The dry run's figures next to the analytic model's, for candidate `i`."""
    analytic = float(res.est.memory["params"][i] + res.est.memory["grads"][i] + res.est.memory["optimizer"][i])
    row = {"index": i, "plan": plan, "status": doc.get("status", "error"), "error": doc.get("error"),
           "analytic_state_bytes": analytic}
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
    return row


def drop_over_memory(rows: list[dict[str, Any]], usable_bytes: float) -> list[dict[str, Any]]:
    """Rows whose simulated step peak exceeds `usable_bytes` become status ``over_memory`` (they leave the
    ranking with the failed ones); the others are returned unchanged."""
    out = []
    for row in rows:
        peak = row.get("dry_run_peak_bytes")
        if row["status"] == "ok" and peak is not None and peak > usable_bytes:
            row = {**row, "status": "over_memory", "usable_bytes": float(usable_bytes),
                   "error": f"simulated step peak {_size(peak).strip()} on rank {row['peak_rank']} exceeds the "
                            f"usable {_size(usable_bytes).strip()} per device (analytic peak "
                            f"{_size(row['analytic_peak_bytes']).strip()})"}
        out.append(row)
    return out


def format_row(row: dict[str, Any]) -> str:
    """One line for the planner's report: state bytes and, when estimated, the step peak (worst rank)."""
    if row["status"] == "over_memory":
        return f"DROPPED: {row['error']}"
    if row["status"] != "ok":
        return f"FAILED: {row['error']}"
    out = f"state {_size(row['dry_run_state_bytes'])} (analytic/dry-run {row['state_ratio']:.3f})"
    if "dry_run_peak_bytes" in row:
        out += (f"  step peak {_size(row['dry_run_peak_bytes'])} on rank {row['peak_rank']}, "
                f"{row['in_flight']:g} micro-batches in flight (analytic/dry-run {row['peak_ratio']:.3f})")
    return out


def _size(b: float) -> str:
    return f"{b / 2**30:8.3f} GiB" if b >= 2**30 else f"{b / 2**20:8.1f} MiB"
