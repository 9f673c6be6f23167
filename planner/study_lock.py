"""One titan-plan per Optuna study: the lock that refuses a second planner on the same study."""
from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
from pathlib import Path

from .rank import PlanningError


class TrialsError(PlanningError):
    """The study cannot be run as asked (storage locked or missing, another model, ...)."""


def file_name(study_name: str) -> str:
    """`study_name` as one file or folder name (the study's lock file, its trials' run folder): what is not
    a letter, digit, '.', '_' or '-' becomes '_' (a study named after a hardware file, or by --study-name,
    may hold '/')."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", study_name).lstrip(".") or "_"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie is dead
    except OSError:
        return True


class StudyLock:
    """One titan-plan per study: a second one on the same study is refused in one line.

    SQLite storage: an flock on ``<db>.<study>.lock`` next to the database (the kernel drops it when the
    holder dies, however it dies, so a stale lock is taken over). Other storages: the study's user attribute
    ``in_use_by`` (host, pid); a holder on this host that is no longer alive is taken over.
    """

    def __init__(self, study, url: str):
        self.study, self.fd = study, None
        name = study.study_name
        if url.startswith("sqlite:///"):
            path = Path(url[len("sqlite:///"):]).resolve()
            lock = path.with_name(f"{path.name}.{file_name(name)}.lock")
            try:
                self.fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise TrialsError(f"--storage {url}: cannot create the study lock '{lock}': {e.strerror}") from None
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(self.fd)
                self.fd = None
                raise TrialsError(f"study '{name}' in {url} is in use by pid {holder} (lock file {lock})") from None
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, str(os.getpid()).encode(), 0)
            return
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        other = study.user_attrs.get("in_use_by")
        if other and other != me and (other.get("host") != me["host"] or _pid_alive(int(other.get("pid", 0)))):
            raise TrialsError(f"study '{name}' in {url} is in use by pid {other.get('pid')} on {other.get('host')}")
        study.set_user_attr("in_use_by", me)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)          # drops the flock; the file stays (removing it would race a new holder)
            self.fd = None
        elif self.study.user_attrs.get("in_use_by") == {"host": socket.gethostname(), "pid": os.getpid()}:
            self.study.set_user_attr("in_use_by", None)
