"""Asynchronous checkpoint saves: one low-priority background writer process per rank.

Why a process and not ``dcp.async_save``'s writer thread: the thread shares the
training process's GIL and cores, and DCP's save (planning, serialization, file
writes) plus our sha256 manifest are mostly Python and CPU work.  Measured on
2 cores, world 4, llama3-debug (bench/bench_checkpoint.py): steps overlapping a
threaded save took 1.60x a step without one; with this writer, unthrottled,
1.10-1.14x; paced to 10% of a core (:class:`_Pacer`, the default
``train.async_checkpoint_cpu_share``) 1.06-1.09x, with 5-15 ms of blocking
staging per save.  On that box 4 trainers already fill both cores, so the
writers' CPU (about 0.05-0.1 s per save and rank) comes out of training
whatever their priority; in total a save still costs about half a step there.

How it works:

* Started once per run (spawn), when the :class:`~executor.checkpoint.Checkpointer`
  is created; the trainer waits until it is ready before the first step (so its
  start-up, importing torch at normal priority, overlaps the model load and
  costs no training step).  Then it moves to a session of its own with autogroup
  nice 19 and lowers every thread to nice 19 and ``SCHED_IDLE`` (where the OS
  has them; see :func:`_lower_priority`), so on a saturated machine training
  keeps the cores.  It dies with its trainer (``PR_SET_PDEATHSIG`` on Linux).
* The writers form their own gloo process group (rendezvous through a
  ``TCPStore`` that rank 0's trainer hosts on a free port), so their
  collectives (DCP's plan gather, the ``.metadata`` barrier) never interleave
  with training's.
* Staging (:meth:`BackgroundWriter.submit`, blocking and cheap): every tensor of
  the state is copied into shared-memory CPU buffers -- one flat buffer per
  dtype, allocated once and reused.  The structure (DTensors with
  their meshes and placements around views of the shared buffers) is sent to
  the writer once; later saves send only a small job.  On CUDA the copy goes
  GPU -> shared CPU memory (not pinned: pinned memory cannot be handed to
  another process without registering it).
* The structure is sent after the first training step (:meth:`BackgroundWriter.prepare`),
  so the writer rebuilds it before the first save; the modules a save needs are
  imported at start-up, at normal priority.
* The writer runs ``dcp.save`` on the buffers into ``step-N.tmp/``, pausing
  between items to keep its CPU share, digests its own shard files (sha256),
  gathers the digests on rank 0, whose writer runs
  :func:`~executor.checkpoint_files.finalize` (manifest, ``COMPLETE``, rename,
  prune): a checkpoint becomes visible only after the background write
  finished on every rank (DCP's save returns on rank 0 after every rank's
  shards and the ``.metadata`` are written).  A crash mid-write leaves a
  ``step-N.tmp/`` without a marker; the previous checkpoint stays loadable.
* At most one save is in flight: :meth:`submit` refuses a second one; the
  caller waits (:meth:`wait`) before staging the next save (which overwrites the
  buffers) and at the end of the run.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from .checkpoint_files import CheckpointError, finalize, manifest
from .faults import ExpectedFailure, expected_failure
from .init import local_tensor

NICE = 19
STARTUP_TIMEOUT_S = 900


# --------------------------------------------------------------------------- nested state helpers
def _leaves(state: dict, prefix: tuple = ()):
    for k, v in state.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _put(state: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        state = state.setdefault(k, {})
    state[path[-1]] = value


def _signature(tensors: list[tuple[tuple, torch.Tensor]]) -> tuple:
    return tuple((path, type(t).__name__, tuple(t.shape), tuple(local_tensor(t).shape), str(t.dtype),
                  str(getattr(t, "placements", ""))) for path, t in tensors)


def _shared_buffers(tensors: list[tuple[tuple, torch.Tensor]]) -> list[tuple[tuple, torch.Tensor, object]]:
    """(path, buffer, DTensor spec or None) per tensor: each buffer a view of one shared-memory CPU buffer
    per dtype, shaped like the tensor's local part.

    The writer rebuilds the DTensors (:func:`_state_from`): a DTensor wrapping a view with a storage
    offset crashes (SIGSEGV) when pickled through torch.multiprocessing (torch 2.14), plain views do not."""
    sizes: dict[torch.dtype, int] = {}
    for _, t in tensors:
        sizes[t.dtype] = sizes.get(t.dtype, 0) + local_tensor(t).numel()
    flat = {dt: torch.empty(n, dtype=dt).share_memory_() for dt, n in sizes.items()}
    used = dict.fromkeys(sizes, 0)
    items = []
    for path, t in tensors:
        local = local_tensor(t)
        off = used[t.dtype]
        used[t.dtype] = off + local.numel()
        items.append((path, flat[t.dtype][off:off + local.numel()].view(local.shape), getattr(t, "_spec", None)))
    return items


def _state_from(items: list[tuple[tuple, torch.Tensor, object]]) -> dict:
    """Writer side: the nested state dict of DTensors / tensors around the shared buffers."""
    state: dict = {}
    for path, buf, spec in items:
        # DTensor's own constructor keeps the spec (mesh, placements, global shape) and, unlike
        # from_local, leaves the CPU buffer where it is when the mesh is a CUDA mesh.
        _put(state, path, buf if spec is None else DTensor(buf, spec, requires_grad=False))
    return state


# --------------------------------------------------------------------------- trainer side
class BackgroundWriter:
    """The trainer's handle on its rank's writer process (see the module docstring)."""

    def __init__(self, group):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._store = None                      # rank 0 hosts the writers' rendezvous store
        addr = [None]
        if self.rank == 0:
            single_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world)) == self.world
            host = "127.0.0.1" if single_node else socket.getfqdn()
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
            addr[0] = (host, self._store.port)
        dist.broadcast_object_list(addr, src=0, group=group)
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_writer_main, name=f"titan-ckpt-writer-{self.rank}", daemon=True,
                                 args=(child, self.rank, self.world, *addr[0], os.getpid()))
        self._proc.start()
        child.close()
        self._ready = False
        self._staged: list = []                 # (path, shared buffer, DTensor spec or None)
        self._signature: tuple | None = None
        self._pending = False

    def wait_ready(self) -> None:
        """Block until the writer has started (call before training: its start-up then costs no step)."""
        if not self._ready:
            self._recv("starting")
            self._ready = True

    def _recv(self, doing: str):
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise CheckpointError(f"the background checkpoint writer of rank {self.rank} died (exit code "
                                      f"{self._proc.exitcode}) while {doing}")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise CheckpointError(f"the background checkpoint writer of rank {self.rank} exited while "
                                  f"{doing}") from None
        if kind == "expected":          # a full disk, permissions, ...: one line (executor/faults.py)
            raise ExpectedFailure(f"checkpoint of rank {self.rank}, {doing}: {payload}")
        if kind == "error":
            raise CheckpointError(f"background checkpoint writer of rank {self.rank}, {doing}: {payload}")
        return payload

    @property
    def prepared(self) -> bool:
        return self._signature is not None

    def _stage_structure(self, tensors: list) -> None:
        """Allocate the shared buffers for `tensors` and send their structure, unless already done for the
        same structure (names, shapes, dtypes, placements)."""
        sig = _signature(tensors)
        if sig != self._signature:
            self._staged, self._signature = _shared_buffers(tensors), sig
            self._conn.send(("state", self._staged))

    def prepare(self, state: dict) -> None:
        """Send the structure of `state` ahead of the first save (no copy): the writer rebuilds it in the
        background, so the first save is as cheap as the later ones."""
        self.wait_ready()
        self._stage_structure([(p, v) for p, v in _leaves(state) if isinstance(v, torch.Tensor)])

    def submit(self, state: dict, job: dict) -> None:
        """Stage `state` (blocking: a copy into shared memory) and hand the write of `job` to the writer.

        `job`: tmp (the step-N.tmp folder), cpu_share (the writer's duty cycle, see :class:`_Pacer`), and for
        rank 0's finalize: folder, step, meta, keep, started; kill (test hook: SIGKILL the trainer after the
        shards are written, before COMPLETE)."""
        assert not self._pending, "one save at a time: wait() for the pending one first"
        self.wait_ready()
        leaves = list(_leaves(state))
        tensors = [(p, v) for p, v in leaves if isinstance(v, torch.Tensor)]
        extras = [(p, v) for p, v in leaves if not isinstance(v, torch.Tensor)]
        self._stage_structure(tensors)
        with torch.no_grad():
            for (_, src), (_, dst, _) in zip(tensors, self._staged):
                dst.copy_(local_tensor(src))
        self._conn.send(("save", {**job, "extras": extras}))
        self._pending = True

    def wait(self) -> dict | None:
        """Block until the pending save (if any) is written (and, on rank 0, visible); its timings."""
        if not self._pending:
            return None
        self._pending = False
        return self._recv("saving a checkpoint")

    def close(self, abort: bool = False) -> None:
        """Stop the writer: after the pending save (call :meth:`wait` first to see its errors), or at once
        (`abort`, when training failed: its peers may be gone)."""
        try:
            if self._proc.is_alive() and not abort:
                try:
                    self._conn.send(("stop", None))
                except (BrokenPipeError, OSError):
                    pass
                self._proc.join(timeout=120)
        finally:
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._conn.close()
            self._staged, self._store = [], None


# --------------------------------------------------------------------------- writer side
def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:                  # the trainer died before prctl
        os._exit(1)


def _lower_priority() -> None:
    """A session of its own with the lowest autogroup priority, then nice 19 and SCHED_IDLE for every thread.

    With autogroups (``/proc/sys/kernel/sched_autogroup_enabled``, the default on many distributions) the
    scheduler first shares the CPU between sessions, and nice/SCHED_IDLE only rank threads within one:
    a writer in its trainer's session would take a full share from the *other* trainers whenever its
    own trainer waits for a collective (measured: steps 2.2x longer while writers burnt 0.3 s of CPU
    each).  Hence setsid() (a new autogroup) and nice 19 for that autogroup."""
    try:
        os.setsid()
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(NICE))
    except OSError:
        pass
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, NICE)
        except (OSError, AttributeError):
            pass
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass


class _Pacer:
    """Keeps the writer's CPU use to a duty cycle: after every `slice_s` of CPU time (this thread's) it sleeps
    so that its CPU time stays at most `share` of the wall time (1 = never sleeps).

    Why: on a host whose cores the trainers fill, even SCHED_IDLE work slows training while it runs -- the
    trainers have to preempt it every time they wake from a collective.  Measured with a SCHED_IDLE spinner
    next to llama3-debug at world 4 on 2 cores: running all the time it got 35% of a core and made steps
    10.5% slower; at a 25% duty cycle it got 9% of a core and steps were 0.6% slower.  So the same writer
    work done in short slices with pauses costs training far less than done in one burst."""

    def __init__(self, share: float, slice_s: float = 0.004):
        self.share, self.slice_s = share, slice_s
        self.slept = 0.0
        self._mark = time.thread_time()

    def __call__(self) -> None:
        if self.share >= 1.0:
            return
        used = time.thread_time() - self._mark
        if used >= self.slice_s:
            pause = used * (1.0 - self.share) / self.share
            time.sleep(pause)
            self.slept += pause
            self._mark = time.thread_time()


@functools.cache
def _paced_planner_class():
    class PacedSavePlanner(DefaultSavePlanner):
        """DCP's default planner (global plan cached: the writer saves the same structure every time) that
        lets the pacer pause before each item is serialized (DCP resolves items one by one as it writes)."""

        def __init__(self, pacer: _Pacer):
            super().__init__(enable_plan_caching=True)
            self.pacer = pacer

        def resolve_data(self, write_item):
            self.pacer()
            return super().resolve_data(write_item)

    return PacedSavePlanner


def _write(state: dict, job: dict, rank: int) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    pacer = _Pacer(job.get("cpu_share", 1.0))
    for path, value in job["extras"]:
        _put(state, path, value)
    dcp.save(state, storage_writer=FileSystemWriter(job["tmp"]), planner=_paced_planner_class()(pacer))
    out = {"write_seconds": time.perf_counter() - t0}
    if job.get("kill"):
        sys.stderr.flush()
        os.kill(os.getppid(), signal.SIGKILL)
        os._exit(1)
    # every rank digests the shard files it wrote (spread over the ranks instead of rank 0 reading them all)
    tmp = Path(job["tmp"])
    own = manifest(tmp, names=[p.name for p in tmp.glob(f"__{rank}_*.distcp")], pace=pacer)
    digests = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(own, digests, dst=0)
    if rank == 0:
        known = {k: v for d in digests for k, v in d.items()}
        out["checkpoint"] = finalize(Path(job["folder"]), job["step"], tmp, job["meta"], job["keep"],
                                     job["started"], digests=known)
    out["finished_at"], out["cpu_seconds"] = time.time(), time.process_time() - c0
    out["paused_seconds"] = pacer.slept
    return out


def _writer_main(conn, rank: int, world: int, host: str, port: int, parent: int) -> None:
    _die_with_parent(parent)
    torch.set_num_threads(1)
    # unpickled DeviceMeshes have no process groups here (only their rank layout is needed): quiet
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    try:
        # import now, at normal priority and before training starts: at idle priority on a busy host the first
        # save paid for them (measured: 9 s from the trainer sending the state to its save starting; DTensor's
        # constructor imports torch._dynamo on first use, 1.5 s of CPU)
        for module in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.default_planner",
                       "torch.distributed.checkpoint.filesystem", "torch.distributed.tensor", "torch._dynamo"):
            importlib.import_module(module)
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        dist.init_process_group("gloo", store=dist.PrefixStore("titan-ckpt-writer", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        _lower_priority()
        conn.send(("ready", os.getpid()))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
        conn.send(("error", f"cannot start: {type(e).__name__}: {e}"))
        os._exit(1)
    state: dict = {}
    try:
        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:                    # the trainer is gone
                break
            if kind == "stop":
                break
            if kind == "state":
                state = _state_from(payload)
                continue
            try:
                conn.send(("done", _write(state, payload, rank)))
            except BaseException as e:  # noqa: BLE001
                line = expected_failure(e, payload.get("tmp") if isinstance(payload, dict) else None)
                conn.send(("expected", line) if line else ("error", f"{type(e).__name__}: {str(e).strip()[-800:]}"))
    finally:
        conn.close()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)                             # no interpreter teardown (docs/torch_on_cpu.md §1)
