"""The on-disk checkpoint format: layout, markers, validation, safe loading.

Layout of a checkpoint folder (``<run_dir>/checkpoints/`` or ``train.checkpoint_dir``)::

    checkpoints/
      step-000120/            complete: renamed from step-000120.tmp/ after every rank finished
        __0_0.distcp ...      DCP shards (model, optimizer state, per-rank RNG): tensors only
        .metadata             DCP's index of the shards
        meta.json             ours, JSON: model name + shape fingerprint, plan, world size, step,
                              time, LR-scheduler and data position
        COMPLETE              ours, JSON: size and sha256 of every file above (written last)
      step-000150.tmp/        a save in progress (or one killed midway): never loaded
      checkpoints.jsonl       one line per completed save (step, path, seconds, bytes)

Visibility (:func:`finalize`, run by rank 0 -- or rank 0's background writer --
after DCP's save returned there, i.e. after every rank's shards and DCP's
``.metadata`` are written): ``meta.json``, then ``COMPLETE`` (written as
``COMPLETE.part`` and renamed), then ``step-N.tmp/`` is renamed to
``step-N/`` and the oldest complete ones beyond ``keep`` are removed.  A crash
at any point before the rename leaves the previous checkpoint the newest
complete one; :func:`problem` refuses folders without the marker or whose
files do not match it (truncated, garbled).

Loading never unpickles arbitrary objects: our files are JSON; DCP's shard
data is read with ``torch.load(weights_only=True)`` by DCP itself; DCP's
``.metadata`` is a pickle, which the reader of :func:`dcp_load` decodes with
:mod:`executor.safe_pickle` (an opcode parser that resolves only an exact list
of DCP dataclasses, dtypes and layouts and never calls anything the stream
names); and its planner refuses DCP "bytes" items (which DCP would
``torch.load(weights_only=False)``; we never write any).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from . import safe_pickle
from .config import ConfigError
from .models.llama import Transformer

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
    with torch.device("meta"):
        model = Transformer(spec)
    items = sorted((n, list(p.shape)) for n, p in model.named_parameters())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def checkpoint_folder(cfg, run_dir: Path) -> Path:
    return Path(cfg.train.checkpoint_dir) if cfg.train.checkpoint_dir else Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


# --------------------------------------------------------------------------- validation
def _sha256(path: Path, pace=None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            if pace is not None:
                pace()
    return h.hexdigest()


def manifest(folder: Path, names: list[str] | None = None, pace=None, known: dict | None = None) -> dict:
    """{file: [size, sha256]} for the files `names` of `folder` (default: all but the marker); entries in
    `known` (digests computed elsewhere, e.g. by the rank that wrote the file) are taken as they are.
    `pace`: called between 1 MiB chunks (the background writer's duty cycle)."""
    known = known or {}
    if names is None:
        names = [p.name for p in folder.iterdir() if p.is_file() and p.name != MARKER]
    return {n: known[n] if n in known else [(folder / n).stat().st_size, _sha256(folder / n, pace)]
            for n in sorted(names)}


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


def check_resume(cfg, run_dir: Path) -> Path:
    """Launcher side, before any process starts: the checkpoint to resume exists and is of this model."""
    path = resolve(cfg.train.resume, checkpoint_folder(cfg, run_dir), warn=lambda msg: None)
    meta = read_meta(path)
    check_compatible(meta, cfg, path)
    if meta.get("kind", "train") == "train" and int(meta.get("step", 0)) >= cfg.train.steps:
        raise CheckpointError(f"checkpoint {path} is at step {meta['step']}, train.steps is {cfg.train.steps}: "
                              "nothing to train (raise --steps)")
    return path


# --------------------------------------------------------------------------- making one visible
def finalize(folder: Path, step: int, tmp: Path, meta: dict, keep: int, started: float,
             digests: dict | None = None) -> dict:
    """Rank 0, after every rank's shards and DCP's .metadata are in `tmp`: meta.json, COMPLETE, rename, prune.

    `digests`: manifest entries already computed (each rank's own shard files); the rest are hashed here.
    Returns the line appended to ``checkpoints.jsonl``."""
    folder, tmp = Path(folder), Path(tmp)
    (tmp / META).write_text(json.dumps(meta, indent=1))
    marker = tmp / (MARKER + ".part")
    marker.write_text(json.dumps({"files": manifest(tmp, known=digests), "step": step}))
    os.replace(marker, tmp / MARKER)
    final = folder / step_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    line = {"step": step, "path": str(final), "seconds": time.perf_counter() - started,
            "bytes": sum(p.stat().st_size for p in final.iterdir())}
    with (folder / "checkpoints.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
    done = complete_checkpoints(folder)
    for _, old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return line


# --------------------------------------------------------------------------- safe loading
def safe_unpickle(data: bytes):
    """DCP's ``.metadata`` decoded by :mod:`executor.safe_pickle`, which never calls what the stream names."""
    try:
        return safe_pickle.loads(data)
    except safe_pickle.UnsafePickleError as e:
        raise CheckpointError(f"DCP metadata refused: {e}") from None


def _reader_classes():
    class SafeReader(FileSystemReader):
        """FileSystemReader whose `.metadata` is decoded by safe_pickle (nothing in it is called)."""

        def read_metadata(self, *args, **kwargs):
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


def saved_keys(path: Path) -> set[str]:
    """The flattened keys a DCP checkpoint holds (``optim.output.weight.step``), from its metadata (decoded
    safely, as :func:`dcp_load` reads it)."""
    reader_cls, _ = _reader_classes()
    try:
        return set(reader_cls(str(path)).read_metadata().state_dict_metadata)
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be read: {type(e).__name__}: {e}") from None


def dcp_load(state: dict, path: Path, *, no_dist: bool = False) -> None:
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


