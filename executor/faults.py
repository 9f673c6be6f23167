"""Fault injection for the tests: every hook that makes a run fail on purpose lives here.

Environment variables (unset in real runs, so none of this fires):

* ``TITAN_RUN_FAULT="rank:step"``: that rank raises a ``RuntimeError`` before that step
  (tests/test_executor_cli.py: a failing rank stops the others, exit 1, failure summary).
* ``TITAN_RUN_KILL="rank:step"``: that rank SIGKILLs itself before that step;
  ``"rank:step:save"``: inside the checkpoint save of that step, after the shards are written and
  before the checkpoint is marked complete (with asynchronous saves the writer process kills its
  trainer at that point: ``checkpoint_writer.py``, job key ``kill``).  Each fires once per run
  directory: a marker file stops it from firing again after an elastic restart
  (tests/distributed/test_checkpoint.py).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def raise_if_fault(rank: int, step: int) -> None:
    """``TITAN_RUN_FAULT="rank:step"``: raise on that rank before that step."""
    fault = os.environ.get("TITAN_RUN_FAULT")
    if fault == f"{rank}:{step}":
        raise RuntimeError(f"injected fault (TITAN_RUN_FAULT={fault})")


def kill_due(rank: int, step: int, run_dir: Path, where: str = "step") -> bool:
    """True when ``TITAN_RUN_KILL`` names this rank, step and place ("step" or "save"), once per run dir."""
    spec = os.environ.get("TITAN_RUN_KILL")
    if not spec:
        return False
    parts = spec.split(":")
    want_where = parts[2] if len(parts) > 2 else "step"
    if (parts[0], parts[1], want_where) != (str(rank), str(step), where):
        return False
    marker = Path(run_dir) / f".titan-kill-{rank}-{step}-{where}.done"
    if marker.exists():
        return False
    marker.write_text(str(time.time()))
    return True


def sigkill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_kill(rank: int, step: int, run_dir: Path, where: str = "step") -> None:
    """SIGKILL this process when :func:`kill_due`."""
    if kill_due(rank, step, run_dir, where):
        sigkill_self()


def before_step(rank: int, step: int, run_dir: Path) -> None:
    """The hooks the training loop runs before each step."""
    raise_if_fault(rank, step)
    maybe_kill(rank, step, run_dir)
