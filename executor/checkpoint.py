"""Distributed checkpoints: save, validate, resume (also onto another plan).

Layout of a checkpoint folder (``<run_dir>/checkpoints/`` or ``train.checkpoint_dir``)::

    checkpoints/
      step-000120/            complete: renamed from step-000120.tmp/ after every rank finished
        __0_0.distcp ...      DCP shards (model, optimizer state, per-rank RNG): tensors only
        .metadata             DCP's index of the shards
        meta.json             ours, JSON: model name + shape fingerprint, plan, world size, step,
                              time, LR-scheduler and data position
        COMPLETE              ours, JSON: size and sha256 of every file above (written last)
      step-000150.tmp/        a save in progress (or one killed midway): never loaded

What is saved: the model and optimizer state through
``torch.distributed.checkpoint.state_dict.get_state_dict`` (canonical FQNs of
the plain model, so any layout -- FSDP/TP/PP/world size -- can load them and
DCP reshards); with pipeline parallel each rank passes its stage modules
(stages keep the original FQNs, ``layers.N...``), merged into one view when a
rank holds several stages.  Non-tensor state (step, data position, scheduler)
goes to ``meta.json``; only tensors go through DCP.

Visibility: each save writes ``step-N.tmp/``; when DCP's save has finished on
every rank (``dcp.save`` returns / the ``async_save`` future resolves; DCP's
coordinator writes ``.metadata`` only after gathering every rank's write
results), rank 0 writes ``meta.json`` and ``COMPLETE`` and renames the folder
to ``step-N/``.  A crash at any point before that leaves the previous
checkpoint the newest complete one.  The last ``train.keep_checkpoints`` are
kept.

Async (``train.async_checkpoint``): ``dcp.async_save`` stages a CPU copy and
writes it in a background thread over a separate gloo process group (so its
collectives never interleave with training's); the next save and the end of
the run wait for it; rank 0 finalizes in its own background thread.

Loading never unpickles arbitrary objects: our files are JSON; DCP's shard
data is read with ``torch.load(weights_only=True)`` by DCP itself; DCP's
``.metadata`` is a pickle, which :class:`SafeReader` reads with an
allow-list unpickler (DCP metadata classes, ``torch.Size``, dtypes,
builtins containers); and :class:`SafeLoadPlanner` refuses DCP "bytes"
items (which DCP would ``torch.load(weights_only=False)``; we never write any).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .config import ConfigError

FORMAT = 1
MARKER = "COMPLETE"
META = "meta.json"
STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (one line; exit 2 when found by the launcher)."""


def log(msg: str) -> None:
    print(f"titan-run: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- identity
def model_fingerprint(spec) -> str:
    """sha256 (16 hex) of the sorted (fqn, shape) list of the plain model: layout-independent."""
    from .models.llama import Transformer
    with torch.device("meta"):
        model = Transformer(spec)
    items = sorted((n, list(p.shape)) for n, p in model.named_parameters())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def checkpoint_folder(cfg, run_dir: Path) -> Path:
    return Path(cfg.train.checkpoint_dir) if cfg.train.checkpoint_dir else Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


# --------------------------------------------------------------------------- validation
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(folder: Path) -> dict:
    return {p.name: [p.stat().st_size, _sha256(p)] for p in sorted(folder.iterdir())
            if p.is_file() and p.name != MARKER}


def problem(path: Path, *, hashes: bool = True) -> str | None:
    """Why the checkpoint folder `path` cannot be loaded, or None if it is complete and intact."""
    if not path.is_dir():
        return "not a folder"
    if not (path / MARKER).is_file():
        return f"no {MARKER} marker (an unfinished or interrupted save)"
    try:
        files = json.loads((path / MARKER).read_text())["files"]
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MARKER} or {META} ({type(e).__name__})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"{META} is not a format-{FORMAT} titan-run checkpoint"
    for name, (size, digest) in files.items():
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        if f.stat().st_size != size:
            return f"file {name} has {f.stat().st_size} bytes, expected {size} (truncated?)"
        if hashes and _sha256(f) != digest:
            return f"file {name} does not match its sha256 (corrupted)"
    if ".metadata" not in files:
        return "no DCP .metadata"
    return None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the folders named step-N that carry a COMPLETE marker, oldest first (not verified)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def newest_good(folder: Path, warn=log) -> Path | None:
    """The newest checkpoint under `folder` that passes :func:`problem`; warns for each one skipped."""
    for _, path in reversed(complete_checkpoints(folder)):
        why = problem(path)
        if why is None:
            return path
        warn(f"warning: skipping checkpoint {path}: {why}")
    return None


def resolve(spec: str, folder: Path, warn=log) -> Path:
    """`spec` = 'latest' (newest good one under `folder`), a checkpoint folder, or a folder of them."""
    if spec == "latest":
        found = newest_good(folder, warn)
        if found is None:
            raise CheckpointError(f"--resume latest: no complete checkpoint under {folder}")
        return found
    p = Path(spec)
    if not p.exists():
        raise CheckpointError(f"--resume: '{p}' does not exist")
    if (p / MARKER).exists() or (p / META).exists() or (p / ".metadata").exists():
        why = problem(p)
        if why is not None:
            raise CheckpointError(f"--resume: checkpoint {p} cannot be loaded: {why}")
        return p
    found = newest_good(p, warn)
    if found is None:
        raise CheckpointError(f"--resume: no complete checkpoint under {p}")
    return found


def check_compatible(meta: dict, cfg, path: Path) -> None:
    """Refuse a checkpoint of another model (shape fingerprint) or another global batch."""
    fp = model_fingerprint(cfg.spec)
    if meta.get("fingerprint") != fp:
        raise CheckpointError(f"checkpoint {path} is of model '{meta.get('model')}' (fingerprint "
                              f"{meta.get('fingerprint')}), this run trains '{cfg.spec.name}' (fingerprint {fp}): "
                              "parameter shapes differ")
    data = meta.get("data") or {}
    if meta.get("kind", "train") == "train" and data.get("global_batch") not in (None, cfg.global_batch):
        raise CheckpointError(f"checkpoint {path} was trained with global batch {data['global_batch']}, this run "
                              f"has {cfg.global_batch} (the data position would not match)")


# --------------------------------------------------------------------------- safe loading
_SAFE_GLOBALS = {
    ("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes",
                              "bool", "slice", "complex", "getattr")
} | {("collections", "OrderedDict"), ("torch", "Size"), ("torch._utils", "_rebuild_tensor_v2"),
     ("copyreg", "_reconstructor"), ("builtins", "object"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "PureWindowsPath")}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        ok = ((module, name) in _SAFE_GLOBALS
              or module.startswith("torch.distributed.checkpoint.")
              or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
              or (module == "enum" and name == "Enum"))
        if not ok:
            raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not allowed")
        return super().find_class(module, name)


def safe_unpickle(data: bytes):
    return _AllowListUnpickler(io.BytesIO(data)).load()


def _reader_classes():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeReader(FileSystemReader):
        """FileSystemReader whose `.metadata` is unpickled with an allow-list (no arbitrary objects)."""

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta
            path = Path(self.path) / ".metadata"
            meta = safe_unpickle(path.read_bytes())
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise CheckpointError(f"checkpoint item '{read_item.dest_index.fqn}' is a pickled object; titan-run "
                                  "checkpoints hold tensors only and refuse to unpickle it")

    return SafeReader, SafeLoadPlanner


def dcp_load(state: dict, path: Path, *, no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    reader_cls, planner_cls = _reader_classes()
    with warnings.catch_warnings():     # no_dist: "torch.distributed is disabled ... single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=reader_cls(str(path)), planner=planner_cls(), no_dist=no_dist)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException (a BaseException) wraps each rank's error
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise CheckpointError(f"checkpoint {path} cannot be loaded: "
                                  f"{(lines[-1] if lines else type(e).__name__)[:400]}") from e


# --------------------------------------------------------------------------- what is saved
def model_view(stages: list[tuple[int, nn.Module]]) -> nn.Module:
    """One module whose named parameters are the plain model's FQNs for what this rank holds."""
    if len(stages) == 1:
        return stages[0][1]
    view = nn.Module()
    view.layers = nn.ModuleDict()
    for _, m in stages:             # stage modules keep the original names (layers.N, tok_embeddings, ...)
        for name, child in m.named_children():
            if name == "layers":
                for k, layer in child.items():
                    view.layers[k] = layer
            elif child is not None:
                setattr(view, name, child)
    return view


def collect(tr) -> tuple[dict, dict]:
    """(DCP state: tensors only, optimizer param_groups) for this rank."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model_view(tr.stages), tr.optimizer)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {"model": msd, "optim": osd["state"], "rng": {f"rank{dist.get_rank()}": rng}}
    return state, osd


def scheduler_state(tr) -> dict:
    return {"last_epoch": tr.scheduler.last_epoch, "step_count": getattr(tr.scheduler, "_step_count", None)}


def restore_scheduler(tr, sd: dict) -> None:
    """Set the LambdaLR position and the groups' lr (recomputed: groups may differ between layouts)."""
    s = tr.scheduler
    s.last_epoch = int(sd["last_epoch"])
    if sd.get("step_count") is not None:
        s._step_count = int(sd["step_count"])
    lrs = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
    for g, lr in zip(tr.optimizer.param_groups, lrs):
        g["lr"] = lr
    s._last_lr = lrs


# --------------------------------------------------------------------------- test hooks
def maybe_kill(rank: int, step: int, run_dir: Path, where: str = "step") -> None:
    """Test hook TITAN_RUN_KILL="rank:step" (SIGKILL before that step) or "rank:step:save" (inside the save
    of that step, after the shards were written, before COMPLETE).  Fires once: a marker file under the
    run dir stops it from firing again after an elastic restart."""
    spec = os.environ.get("TITAN_RUN_KILL")
    if not spec:
        return
    parts = spec.split(":")
    want_where = parts[2] if len(parts) > 2 else "step"
    if (parts[0], parts[1], want_where) != (str(rank), str(step), where):
        return
    marker = Path(run_dir) / f".titan-kill-{rank}-{step}-{where}.done"
    if marker.exists():
        return
    marker.write_text(str(time.time()))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def elastic_restart_count() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


# --------------------------------------------------------------------------- the manager
class Checkpointer:
    """Saves every ``train.checkpoint_every`` steps and at the end; resumes; keeps the last N."""

    def __init__(self, tr, run_dir: Path):
        t = tr.cfg.train
        self.tr, self.run_dir = tr, Path(run_dir)
        self.folder = checkpoint_folder(tr.cfg, run_dir)
        self.every, self.keep, self.use_async = t.checkpoint_every, t.keep_checkpoints, t.async_checkpoint
        self.rank = dist.get_rank()
        self.enabled = self.every > 0
        self.pg = None
        self._pending: tuple | None = None        # (future of this rank, rank-0 finalize future)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-final") if self.rank == 0 else None
        self.events: list[dict] = []
        if self.enabled and self.use_async:
            self.pg = dist.new_group(backend="gloo")    # async collectives never share training's groups
        if self.enabled and self.rank == 0 and self.folder.is_dir():
            for p in self.folder.glob("step-*.tmp"):   # saves that never completed (a crash)
                shutil.rmtree(p, ignore_errors=True)

    # ---- resume
    def resume(self) -> int:
        """Load the checkpoint named by train.resume (or the latest one after an elastic restart); return its step."""
        spec = self.tr.cfg.train.resume
        if not spec and elastic_restart_count() > 0:
            spec = "auto"
        if not spec:
            return 0
        box = [None]
        if self.rank == 0:
            try:
                if spec == "auto":
                    path = newest_good(self.folder)
                    if path is not None:
                        log(f"elastic restart {elastic_restart_count()}: resuming from {path}")
                    else:
                        log(f"elastic restart {elastic_restart_count()}: no checkpoint under {self.folder}, "
                            "starting over")
                else:
                    path = resolve(spec, self.folder)
                if path is not None:
                    meta = read_meta(path)
                    check_compatible(meta, self.tr.cfg, path)
                box[0] = ("ok", None if path is None else str(path))
            except CheckpointError as e:
                box[0] = ("error", str(e))
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise CheckpointError(value)
        if value is None:
            return 0
        return self.load(Path(value))

    def load(self, path: Path) -> int:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        t0 = time.perf_counter()
        tr, meta = self.tr, read_meta(path)
        kind = meta.get("kind", "train")
        state, osd = collect(tr)
        if kind == "weights":                   # an imported checkpoint: weights only, fresh optimizer
            dcp_load({"model": state["model"]}, path)
            set_state_dict(model_view(tr.stages), tr.optimizer, model_state_dict=state["model"],
                           optim_state_dict=osd)
            step = 0
        else:
            if meta.get("world_size") != dist.get_world_size():
                del state["rng"]                # RNG streams are per rank: only meaningful on the same world
            dcp_load(state, path)
            set_state_dict(model_view(tr.stages), tr.optimizer, model_state_dict=state["model"],
                           optim_state_dict={"state": state["optim"], "param_groups": osd["param_groups"]})
            restore_scheduler(tr, meta["scheduler"])
            tr.batches.load_state_dict(meta["data"])
            if "rng" in state:
                rng = state["rng"][f"rank{self.rank}"]
                torch.set_rng_state(rng["cpu"])
                if "cuda" in rng and torch.cuda.is_available():
                    torch.cuda.set_rng_state(rng["cuda"])
            step = int(meta["step"])
        dt = time.perf_counter() - t0
        self.events.append({"event": "load", "step": step, "path": str(path), "seconds": dt})
        if self.rank == 0:
            log(f"resumed from {path} (step {step}, saved by plan {meta.get('plan_describe', '?')} on world "
                f"{meta.get('world_size')}) in {dt:.2f} s")
        return step

    # ---- save
    def after_step(self, step: int) -> None:
        if self.enabled and step % self.every == 0 and step != self.tr.cfg.train.steps:
            self.save(step)

    def finish(self, step: int) -> None:
        """Final save (when checkpointing is on) and wait for every pending save."""
        if self.enabled:
            self.save(step)
        self.wait()

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        self.wait()
        t0 = time.perf_counter()
        tr = self.tr
        tmp = self.folder / (step_name(step) + ".tmp")
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        dist.barrier()
        tmp.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "kind": "train", "model": tr.cfg.model, "model_name": tr.cfg.spec.name,
                "fingerprint": model_fingerprint(tr.cfg.spec), "plan": tr.cfg.plan.to_dict(),
                "plan_describe": tr.cfg.plan.describe(), "world_size": dist.get_world_size(), "step": step,
                "time": time.time(), "seq_len": tr.cfg.seq_len, "global_batch": tr.cfg.global_batch,
                "scheduler": scheduler_state(tr), "data": tr.batches.state_dict(), "torch": torch.__version__}
        state, _ = collect(tr)
        writer = FileSystemWriter(str(tmp))
        if self.use_async:
            fut = dcp.async_save(state, storage_writer=writer, process_group=self.pg)
            if not isinstance(fut, Future) and hasattr(fut, "upload_completion"):   # AsyncSaveResponse
                fut = fut.upload_completion
            final = self._pool.submit(self._finalize_after, fut, step, tmp, meta, t0) if self.rank == 0 else None
            self._pending = (fut, final)
            self.events.append({"event": "save", "step": step, "async": True,
                                "blocking_seconds": time.perf_counter() - t0})
        else:
            dcp.save(state, storage_writer=writer)
            maybe_kill(self.rank, step, self.run_dir, "save")
            if self.rank == 0:
                self._finalize(step, tmp, meta, t0)
            self.events.append({"event": "save", "step": step, "async": False,
                                "blocking_seconds": time.perf_counter() - t0})

    def _finalize_after(self, fut, step, tmp, meta, t0) -> None:
        fut.result()
        self._finalize(step, tmp, meta, t0)

    def _finalize(self, step: int, tmp: Path, meta: dict, t0: float) -> None:
        """Rank 0, after every rank's shards and DCP's .metadata are written: meta.json, COMPLETE, rename, prune."""
        (tmp / META).write_text(json.dumps(meta, indent=1))
        marker = tmp / (MARKER + ".part")
        marker.write_text(json.dumps({"files": manifest(tmp), "step": step}))
        os.replace(marker, tmp / MARKER)
        final = self.folder / step_name(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        total = time.perf_counter() - t0
        with (self.folder / "checkpoints.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "path": str(final), "seconds": total,
                                "bytes": sum(p.stat().st_size for p in final.iterdir())}) + "\n")
        done = complete_checkpoints(self.folder)
        for _, old in done[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        if self._pending is None:
            return
        fut, final = self._pending
        self._pending = None
        fut.result()
        if final is not None:
            final.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self.rank == 0 and self.events:      # save/load timings (bench/bench_checkpoint.py reads them)
                with (self.run_dir / "checkpoint_events.jsonl").open("a") as f:
                    f.writelines(json.dumps(e) + "\n" for e in self.events)


__all__ = ["Checkpointer", "CheckpointError", "check_compatible", "checkpoint_folder", "complete_checkpoints",
           "dcp_load", "maybe_kill", "model_fingerprint", "newest_good", "problem", "read_meta", "resolve",
           "safe_unpickle"]


def check_resume(cfg, run_dir: Path) -> Path:
    """Launcher side, before any process starts: the checkpoint to resume exists and is of this model."""
    path = resolve(cfg.train.resume, checkpoint_folder(cfg, run_dir), warn=lambda msg: None)
    meta = read_meta(path)
    check_compatible(meta, cfg, path)
    if meta.get("kind", "train") == "train" and int(meta.get("step", 0)) >= cfg.train.steps:
        raise CheckpointError(f"checkpoint {path} is at step {meta['step']}, train.steps is {cfg.train.steps}: "
                              "nothing to train (raise --steps)")
    return path
