"""Process lifetime: a child that dies with its parent (stdlib only).

Shared by both command-line tools, so it lives in the lowest layer that the planner and
the executor may both import: ``titan-plan`` starts trials (``planner/trials.py``) and
``titan-run`` starts torchrun and its workers (``executor/launch.py``), and no process of
either chain may outlive the one that started it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1              # <linux/prctl.h>


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies, however it dies (Linux prctl PR_SET_PDEATHSIG; a no-op elsewhere).

    Used as a ``preexec_fn`` (planner/trials.py) and at the start of each worker (and of ``python -m
    executor.launch torchrun``).
    The signal fires when the parent *thread* ends, so children are started from the main thread.  If the
    parent died before the prctl took effect (re-parented already), exit at once.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0 and (parent == 1 or os.getppid() != parent):
        os._exit(1)
