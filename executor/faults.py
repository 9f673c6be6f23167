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

Expected failures (the environment, not a bug): :func:`expected_failure` turns a missing or
unreadable file, a read-only or full disk, a file-size limit into one line naming the path and
the problem; the worker prints it once per node (:func:`print_once`) and exits 2, and the torchrun
wrapper (``launch.torchrun_main``) then adds nothing.
"""
from __future__ import annotations

import errno
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

# errno values that mean "the environment refused": a path, permissions, space, a size limit
EXPECTED_ERRNOS = {
    errno.ENOENT: "does not exist", errno.ENOTDIR: "a parent is not a folder", errno.EISDIR: "is a folder",
    errno.EACCES: "permission denied", errno.EPERM: "operation not permitted", errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (file-size limit)", errno.ENAMETOOLONG: "name too long",
}
# torch's zip writer reports a short write (a full disk, a size limit) without an errno
_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+|file write failed|PytorchStreamWriter failed writing")


# a collective that failed because a peer vanished (killed) or never came (stopped, hung): this rank is a victim
_PEER_GONE = re.compile(r"Connection reset by peer|Connection closed by peer|Connection refused|Broken pipe|"
                        r"Timed out waiting|Socket Timeout|timed out after|operation timed out", re.IGNORECASE)
EXIT_PEER_FAILED = 3          # a rank that failed only because another one did (launch.torchrun_main blames that one)


def peer_failure(exc: BaseException) -> bool:
    """True when `exc` is a torch.distributed error caused by another rank (gone or silent), not by this one."""
    return any(type(e).__name__ in ("DistBackendError", "DistNetworkError", "DistError", "RuntimeError")
               and _PEER_GONE.search(str(e)) for e in _causes(exc))


class ExpectedFailure(Exception):
    """An expected failure already put in one line (e.g. by the background checkpoint writer)."""


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


def _causes(exc: BaseException):
    """`exc`, its causes and contexts, and the per-rank exceptions a DCP CheckpointException carries."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):          # torch.distributed.checkpoint.api.CheckpointException
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def expected_failure(exc: BaseException, where: str | Path | None = None) -> str | None:
    """One line for an expected failure (see EXPECTED_ERRNOS), or None for anything else (a bug: traceback)."""
    for e in _causes(exc):
        if isinstance(e, ExpectedFailure):
            return str(e)
        if isinstance(e, OSError) and e.errno in EXPECTED_ERRNOS:
            path = e.filename if e.filename is not None else where
            return f"{path}: {EXPECTED_ERRNOS[e.errno]} ({e.strerror or errno.errorcode.get(e.errno)})"
        if isinstance(e, RuntimeError) and _SHORT_WRITE.search(str(e)):
            return (f"{where or 'a checkpoint file'}: a write came up short (a full disk or a file-size limit?): "
                    f"{' '.join(str(e).split())[:160]}")
    return None


_MARKER = "titan-run-error-{key}-{launcher}"      # {launcher}: the workers' parent's pid


def clear_error_markers(launcher_pid: int) -> None:
    """Remove the markers `print_once` left in the temp dir for the workers of the launcher process
    `launcher_pid` (the torchrun agent, ``executor.launch``), once they are gone."""
    for marker in Path(tempfile.gettempdir()).glob(_MARKER.format(key="*", launcher=launcher_pid)):
        marker.unlink(missing_ok=True)


def _marker_dir() -> Path:
    """Where a node's workers meet for `print_once`: the elastic agent's folder of this attempt (the parent of
    each worker's ``TORCHELASTIC_ERROR_FILE`` folder, shared by the node's workers and made afresh for every
    restart), which titan-run's launcher removes with its log dir and a hand-started torchrun keeps in its
    own; else the temp dir."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    return Path(error_file).parent.parent if error_file else Path(tempfile.gettempdir())


def print_once(line: str) -> None:
    """Print `line` to stderr once per node and run: the first rank to get here prints it (a marker file in
    `_marker_dir`; in the temp dir titan-run's launcher removes it when the run ends, `clear_error_markers`).
    A node with one process prints without a marker."""
    if os.environ.get("LOCAL_WORLD_SIZE", "1") == "1":
        print(f"titan-run: error: {line}", file=sys.stderr, flush=True)
        return
    key = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT"))
    marker = _marker_dir() / _MARKER.format(key=re.sub(r'[^A-Za-z0-9_.-]', '_', key), launcher=os.getppid())
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return
    except OSError:
        pass                                    # no temp dir: print anyway
    print(f"titan-run: error: {line}", file=sys.stderr, flush=True)
