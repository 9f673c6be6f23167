"""Starting the worker processes of one node, through torchrun where a run is elastic or multi-node.

``titan-run`` started by hand on one node without restarts starts its N workers itself
(:func:`run_local`: ``python -m executor.cli <same arguments>`` with the environment
``torchrun --standalone`` gives them); with ``--max-restarts``, ``--nnodes`` or a
rendezvous endpoint it runs torchrun's agent in titan-run's own process (``torchrun
--nproc-per-node N -m executor.cli <same arguments>``, wrapped by :func:`torchrun_main`;
``python -m executor.launch torchrun ...`` runs the same wrapper on its own).  Either way
every worker is stopped when one fails and the run exits non-zero, so a failing rank
never leaves the others hanging (each process group also has a timeout), and on a host
without a GPU the launcher of a non-elastic run never imports torch (:func:`local_gpu_count`).

Every worker dies with its parent (``prctl(PR_SET_PDEATHSIG, SIGKILL)``,
:func:`die_with_parent`): titan-run (the launcher or agent) -> workers (each in its own
session, so a process-group kill does not reach them).  A killed ``titan-plan`` or
``titan-run`` leaves nothing running.

Failures end in one line: workers that exit with the bad-input code (2) have printed
their one line already (rank 0, :mod:`executor.faults`), so the launcher exits 2 without
torchrun's error dump; any other failure is one line naming the first failed rank and
its exit code or signal.  A multi-node rendezvous waits at most ``RDZV_JOIN_TIMEOUT_S``
(``TITAN_RUN_RDZV_TIMEOUT_S``) for the other nodes, then says what it waited for.  Started by torchrun (``RANK``/``WORLD_SIZE`` set) or by ``srun``
(``SLURM_PROCID``/``SLURM_NTASKS``, with ``MASTER_ADDR``/``MASTER_PORT``
exported by the job script), the process is a worker itself.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from search_spaces.lifetime import die_with_parent

from .faults import EXIT_PEER_FAILED, clear_error_markers

REPO_ROOT = Path(__file__).resolve().parent.parent
EXIT_BAD_INPUT = 2                # as executor.cli: the workers printed the one line already
RDZV_JOIN_TIMEOUT_S = 60.0        # how long a node waits for the others at the rendezvous (default)


def is_worker() -> bool:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and "MASTER_ADDR" in os.environ:
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE",
                                                                 os.environ["SLURM_NTASKS"]).split("(")[0])
        os.environ.setdefault("MASTER_PORT", "29500")
        return True
    return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """Make this process rank 0 of a world of 1 (no torchrun needed)."""
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                            if p])
    return env


def run_torchrun(nproc: int, cli_args: list[str], *, max_restarts: int = 0, nnodes: str | None = None,
                 rdzv_backend: str | None = None, rdzv_endpoint: str | None = None, rdzv_id: str | None = None
                 ) -> int:
    """Run `executor.cli` with `cli_args` in `nproc` local worker processes; return the exit code.

    ``max_restarts``/``nnodes``/``rdzv_*`` go to torchrun as given (elastic training: after a failure
    torchrun restarts every worker, which resume from the latest checkpoint); without an endpoint
    the job is ``--standalone`` (one node, local rendezvous).
    """
    rdzv = ["--standalone"]
    if rdzv_endpoint:
        rdzv = [f"--rdzv-backend={rdzv_backend or 'c10d'}", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-conf=join_timeout={rdzv_timeout_s():g}"]
        if rdzv_id:
            rdzv.append(f"--rdzv-id={rdzv_id}")
    elastic = [f"--max-restarts={max_restarts}"] if max_restarts else []
    if nnodes:
        elastic.append(f"--nnodes={nnodes}")
    argv = [*rdzv, *elastic, f"--nproc-per-node={nproc}", "-m", "executor.cli", *cli_args]
    # torchrun's agent runs in this process (the launcher has torch loaded already; a separate agent process
    # cost one more interpreter and torch import, ~1.5 s a run); the workers inherit child_env()
    saved, env = dict(os.environ), child_env()
    # the agent installs its own handlers (a signal stops the workers, then raises); put the launcher's back after
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    os.environ.clear()
    os.environ.update(env)
    try:
        return torchrun_main(argv, own_process=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


LOCAL_STOP_GRACE_S = 30.0        # SIGTERM -> SIGKILL for the workers still running when the run stops (torchrun's)
_POLL_S = 0.05


class _Stopped(Exception):
    def __init__(self, sig: int):
        super().__init__(sig)
        self.sig = sig


def launch_workers(nproc: int, cli_args: list[str], *, max_restarts: int = 0, nnodes: str | None = None,
                   rdzv_backend: str | None = None, rdzv_endpoint: str | None = None,
                   rdzv_id: str | None = None) -> int:
    """Run `executor.cli` with `cli_args` in `nproc` worker processes: one node without restarts starts them
    itself (`run_local`: no torchrun agent, so the launcher never imports torch on a host without a GPU); elastic
    or multi-node runs go through torchrun (`run_torchrun`)."""
    if max_restarts or nnodes or rdzv_endpoint:
        return run_torchrun(nproc, cli_args, max_restarts=max_restarts, nnodes=nnodes, rdzv_backend=rdzv_backend,
                            rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
    return run_local(nproc, cli_args)


def local_worker_env(nproc: int, port: int) -> dict:
    """The environment torchrun --standalone gives every worker of one node (rank keys added per worker); the
    store is rank 0's own (no agent store)."""
    env = child_env()
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"):
        env.pop(k, None)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
                "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": f"titan-run-{os.getpid()}"})
    return env


def run_local(nproc: int, cli_args: list[str]) -> int:
    """`executor.cli` with `cli_args` in `nproc` workers of this node, started and watched by this process as
    torchrun's agent would: each in its own session (a terminal's Ctrl-C reaches the launcher only), dying with
    it; the first worker that exits non-zero stops the others (SIGTERM, SIGKILL after LOCAL_STOP_GRACE_S); a
    SIGTERM / SIGINT / SIGHUP / SIGQUIT to the launcher stops them all.  Ends as `torchrun_main` does: 0, 2 when
    the first failed rank exited with the bad-input code (it printed the one line), else one line
    (`failure_line`) and 1; 128 + the signal when stopped."""
    env = local_worker_env(nproc, free_port())
    cmd = [sys.executable, "-m", "executor.cli", *cli_args]
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    handlers = {s: signal.getsignal(s) for s in stops}

    stopping: list[int] = []          # once the workers are being stopped, a further signal changes nothing

    def stop(sig, _frame):
        if not stopping:
            stopping.append(sig)
            raise _Stopped(sig)

    procs: list[subprocess.Popen] = []
    try:
        for s in stops:
            signal.signal(s, stop)
        for rank in range(nproc):
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                    "ROLE_RANK": str(rank)}, start_new_session=True))
        failures = _watch(procs)
    except (_Stopped, KeyboardInterrupt) as e:
        sig = e.sig if isinstance(e, _Stopped) else signal.SIGINT
        stopping.append(sig)
        _stop_workers(procs)
        print(f"titan-run: stopped by {signal.Signals(sig).name}; the workers were stopped", file=sys.stderr,
              flush=True)
        return 128 + int(sig)
    finally:
        stopping.append(0)
        _stop_workers(procs)
        for s, handler in handlers.items():
            if handler is not None:
                signal.signal(s, handler)
        clear_error_markers(os.getpid())
    if not failures:
        return 0
    first = min(failures, key=lambda r: (failures[r][3], r))
    if failures[first][0] == EXIT_BAD_INPUT:
        return EXIT_BAD_INPUT                        # the first failed rank printed the one line
    print(failure_line(failures, nproc), file=sys.stderr, flush=True)
    return 1


def _watch(procs: list) -> dict[int, tuple]:
    """Wait until every worker exited 0 (-> {}) or one did not: the workers that failed by then,
    ``{rank: (exit code, local rank, pid, when)}`` (the rest are stopped by the caller)."""
    while True:
        codes = [p.poll() for p in procs]
        now = time.time()
        failed = {r: (c, r, procs[r].pid, now) for r, c in enumerate(codes) if c not in (None, 0)}
        if failed:
            return failed
        if all(c == 0 for c in codes):
            return {}
        time.sleep(_POLL_S)


def _stop_workers(procs: list) -> None:
    """SIGTERM to every worker still running, SIGKILL to those alive LOCAL_STOP_GRACE_S later; all reaped."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + LOCAL_STOP_GRACE_S
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# device nodes of a GPU driver torch.cuda can use (NVIDIA, AMD ROCm, WSL2's CUDA); without any, no GPU is visible
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def local_gpu_count() -> int:
    """The GPUs torch.cuda sees on this node; on a host without a GPU driver's device node, 0 without importing
    torch (the launcher of a CPU run then never loads it: seconds a run)."""
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return 0
    import_torch_quietly()
    import torch  # torch: launcher path (a GPU host)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def import_torch_quietly() -> None:
    """Import torch with c10's log level at ERROR in this process only: the elastic agent's C++ store warnings
    (a vanished peer's socket) stay off.  c10 reads the level once, when torch loads; the environment is put
    back, so the workers get it as it was.  A no-op when torch is loaded already."""
    if "torch" in sys.modules:
        return
    cpp_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401  torch: launcher path (loaded here so the level above applies to this process)
    finally:
        if cpp_level is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = cpp_level


def rdzv_timeout_s() -> float:
    v = os.environ.get("TITAN_RUN_RDZV_TIMEOUT_S")
    try:
        t = float(v) if v else RDZV_JOIN_TIMEOUT_S
    except ValueError:
        t = -1.0
    if not 0 < t < float("inf"):
        raise SystemExit(f"titan-run: error: TITAN_RUN_RDZV_TIMEOUT_S must be seconds > 0, got {v!r}")
    return t


def _failure_line(e, world: int | None) -> str:
    """One line for torchrun's ChildFailedError (`failure_line` of its failures)."""
    return failure_line({r: (f.exitcode, f.local_rank, f.pid, f.timestamp) for r, f in e.failures.items()}, world)


def failure_line(failures: dict[int, tuple], world: int | None) -> str:
    """One line for failed workers, ``{rank: (exit code, local rank, pid, when)}``: the rank that failed first on
    its own (not one that only lost a peer, exit EXIT_PEER_FAILED), its exit code or signal; if every failed rank
    only lost a peer, the ranks that never failed are the suspects (stopped or hung)."""
    causes = {r: f for r, f in failures.items() if f[0] != EXIT_PEER_FAILED}
    if causes:
        rank, (code, local_rank, pid, _) = min(causes.items(), key=lambda kv: (kv[1][3], kv[0]))
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return (f"titan-run: error: rank {rank} (local rank {local_rank}, pid {pid}) {how}; "
                f"{len(failures)} rank(s) of this node failed")
    rank = min(failures, key=lambda r: (failures[r][3], r))
    silent = sorted(set(range(world)) - set(failures)) if world else []
    who = f"rank(s) {', '.join(map(str, silent))} (stopped or hung?)" if silent else "a rank of another node"
    return (f"titan-run: error: rank {rank} gave up waiting in a collective for {who}: the process-group timeout "
            "(train.pg_timeout_s) ran out or the peer vanished")


def _local_world(args) -> int | None:
    """The world size when it is this node's alone (one node), else None."""
    try:
        nnodes = str(args.nnodes)
        return int(args.nproc_per_node) if nnodes.split(":")[-1] == "1" else None
    except (TypeError, ValueError):
        return None


def torchrun_main(argv: list[str], *, own_process: bool = True) -> int:
    """torchrun in this process: ends every failure in one line (no error dump); `own_process` (``python -m
    executor.launch torchrun``) also dies with its parent, titan-run."""
    if own_process:
        die_with_parent()
    os.environ.setdefault("LOGLEVEL", "ERROR")       # torchrun's info/warning chatter off (its own knob)
    import_torch_quietly()
    from torch.distributed.elastic.multiprocessing.api import SignalException  # torch: launcher path
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # torch: launcher path
    from torch.distributed.elastic.rendezvous.api import (RendezvousConnectionError,  # torch: launcher path
                                                          RendezvousError)
    from torch.distributed.run import parse_args, run  # torch: launcher path
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)   # failures: our one line
    # the agent's log dir (per attempt and rank: error files, the workers' print_once markers): torch makes a
    # torchelastic_* folder in the temp dir and leaves it; this one goes when the run ends
    own_log_dir = None
    if not any(a.split("=", 1)[0] in ("--log-dir", "--log_dir", "--logs-specs", "--logs_specs") for a in argv):
        own_log_dir = tempfile.mkdtemp(prefix="titan-run-elastic-")
        argv = ["--log-dir", own_log_dir, *argv]
    args = parse_args(argv)
    try:
        run(args)
    except (SignalException, KeyboardInterrupt) as e:      # the agent stopped the workers before raising
        sig = e.sigval if isinstance(e, SignalException) else signal.SIGINT
        print(f"titan-run: stopped by {signal.Signals(sig).name}; the workers were stopped", file=sys.stderr,
              flush=True)
        return 128 + int(sig)
    except ChildFailedError as e:
        if e.get_first_failure()[1].exitcode == EXIT_BAD_INPUT:
            return EXIT_BAD_INPUT                    # the first failed rank printed the one line
        print(_failure_line(e, _local_world(args)), file=sys.stderr, flush=True)
        return 1
    except RendezvousConnectionError:
        print(f"titan-run: error: lost the rendezvous store at {args.rdzv_endpoint}: the node hosting it (the "
              "one whose address is the endpoint) is gone; an elastic job survives the loss of the other nodes only",
              file=sys.stderr, flush=True)
        return 1
    except RendezvousError as e:
        what = f"{args.nnodes} node(s) at the rendezvous {args.rdzv_endpoint}"
        print(f"titan-run: error: gave up waiting for {what} after the join timeout "
              f"({rdzv_timeout_s():g} s, TITAN_RUN_RDZV_TIMEOUT_S): "
              f"{': '.join(x for x in (type(e).__name__, ' '.join(str(e).split())[:200]) if x)}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        clear_error_markers(os.getpid())           # the workers' one-line-per-node markers (faults.print_once)
        if own_log_dir is not None:
            shutil.rmtree(own_log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    mode, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if mode == "torchrun":
        sys.exit(torchrun_main(rest))
    sys.exit(f"usage: python -m executor.launch torchrun TORCHRUN-ARGS (got {mode!r})")
