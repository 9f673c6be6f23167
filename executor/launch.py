"""Starting the worker processes: torchrun for one node, or an existing launcher.

``titan-run`` started by hand runs ``python -m torch.distributed.run
--standalone --nproc-per-node N -m executor.cli <same arguments>`` and waits
for it.  torchrun stops every worker when one fails and exits non-zero, so a
failing rank never leaves the others hanging (each process group also has a
timeout).  Started by torchrun (``RANK``/``WORLD_SIZE`` set) or by ``srun``
(``SLURM_PROCID``/``SLURM_NTASKS``, with ``MASTER_ADDR``/``MASTER_PORT``
exported by the job script), the process is a worker itself.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


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
        rdzv = [f"--rdzv-backend={rdzv_backend or 'c10d'}", f"--rdzv-endpoint={rdzv_endpoint}"]
        if rdzv_id:
            rdzv.append(f"--rdzv-id={rdzv_id}")
    elastic = [f"--max-restarts={max_restarts}"] if max_restarts else []
    if nnodes:
        elastic.append(f"--nnodes={nnodes}")
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, *elastic, f"--nproc-per-node={nproc}",
           "-m", "executor.cli", *cli_args]
    proc = subprocess.Popen(cmd, env=child_env())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return 130
