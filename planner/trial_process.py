"""One trial as a process: run `titan-run` in its own session with a hard timeout, read its metrics as it
runs (so the study can prune it), kill its whole process group, and never let it outlive titan-plan."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from search_spaces.lifetime import die_with_parent


# The trial's process-group guard (its own session, so it outlives a kill -9 of titan-plan): once titan-plan
# is gone (this process re-parented), SIGKILL the trial's whole group -- the trial leader itself dies at once
# by PR_SET_PDEATHSIG, what it started (torchrun, an srun step, ...) is in its group. Ends with the group.
GROUP_GUARD = """
import os, signal, sys, time
planner, pgid = int(sys.argv[1]), int(sys.argv[2])
while True:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        break
    if os.getppid() != planner:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    time.sleep(0.2)
"""


def run_one(cmd: list[str], run_dir: Path, timeout_s: float,
            on_step: Callable[[int, float], bool] | None = None) -> dict[str, Any]:
    """Run a trial command in its own session; kill the whole group on timeout or prune.

    `on_step(step, step_time_s)` is called for each new metrics line; returning
    True prunes the trial. Returns the summary (with a status always set).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "trial.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    guard = subprocess.Popen([sys.executable, "-S", "-c", GROUP_GUARD, str(os.getpid()), str(proc.pid)],
                             start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    seen, status = 0, None
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                status = "timeout"
                break
            if on_step is not None:
                for rec in _new_metrics(run_dir, seen):
                    seen += 1
                    if on_step(int(rec.get("step", seen)), float(rec["step_time_s"])):
                        status = "pruned"
                        break
                if status:
                    break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            kill_group(proc)
        guard.kill()
        guard.wait()
        log.close()
    if status:
        return {"status": status, "reason": f"{status} after {time.monotonic() - t0:.0f} s"}
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        try:
            s = json.loads(summary_path.read_text())
        except ValueError:
            s = {}
        if s.get("status"):
            if s["status"] != "ok":
                errs = s.get("errors") or []
                s.setdefault("reason", errs[0].get("message", "")[:300] if errs else
                             _error_line(run_dir / "trial.log") or f"exit {proc.returncode}")
            return s
    tail = (run_dir / "trial.log").read_text(errors="replace").strip().splitlines()[-3:]
    return {"status": "error", "reason": f"exit {proc.returncode}: " + " | ".join(tail)[:300]}


def _error_line(log: Path) -> str | None:
    """The last one-line error titan-run printed (``titan-run: error: ...``), if any."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("titan-run: error:")]
    return lines[-1][len("titan-run: error:"):].strip()[:300] if lines else None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the trial's whole process group, then SIGKILL what is left."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(pgid):
            break
    try:
        os.killpg(pgid, signal.SIGKILL)   # grandchildren that outlived the leader
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _new_metrics(run_dir: Path, seen: int):
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return []
    lines = f.read_text().splitlines()
    out = []
    for line in lines[seen:]:
        try:
            rec = json.loads(line)
        except ValueError:
            break                       # a line being written
        if "step_time_s" in rec:
            out.append(rec)
    return out
