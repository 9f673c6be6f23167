"""Distributed checkpoints: when to save, what is saved, resume (also onto another plan).

The on-disk format, markers, validation and safe loading are in
``checkpoint_files.py``; the asynchronous writer process in
``checkpoint_writer.py``.

What is saved: the model and optimizer state through
``torch.distributed.checkpoint.state_dict.get_state_dict`` (canonical FQNs of
the plain model, so any layout -- FSDP/TP/PP/world size -- can load them and
DCP reshards); with pipeline parallel each rank passes its stage modules
(stages keep the original FQNs, ``layers.N...``), merged into one view when a
rank holds several stages.  Non-tensor state (step, data position, scheduler)
goes to ``meta.json``; only tensors go through DCP.

When: every ``train.checkpoint_every`` steps and at the end; the last
``train.keep_checkpoints`` complete ones are kept.  Each save writes
``step-N.tmp/`` and becomes ``step-N/`` only when complete
(:func:`~executor.checkpoint_files.finalize`).

Synchronous saves run ``dcp.save`` between two steps.  Asynchronous ones
(``train.async_checkpoint``) copy the state into shared memory between two
steps and let this rank's low-priority writer process write it while
training continues (see ``checkpoint_writer.py``); the next save and the end
of the run wait for the pending one, so at most one is in flight.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .checkpoint_files import (FORMAT, CheckpointError, check_compatible, checkpoint_folder, dcp_load, finalize,
                               log, model_fingerprint, newest_good, read_meta, resolve, saved_keys, step_name)
from .checkpoint_writer import BackgroundWriter
from .faults import kill_due, sigkill_self


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
    msd, osd = get_state_dict(model_view(tr.stages), tr.optimizer)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {"model": msd, "optim": osd["state"], "rng": {f"rank{dist.get_rank()}": rng}}
    return state, osd


def head_from_embedding(tr, state: dict, path: Path, load) -> None:
    """`load()` `state`; a tied embedding's head copy on the last pipeline stage (``TiedEmbedding``) takes its
    optimizer state from the embedding's where the checkpoint holds only that one (saved on one stage, where the
    tied weight is one parameter): renamed for the load when this rank holds the head alone, copied from the
    embedding's after it when this rank holds both (the V schedules)."""
    optim = state["optim"]
    tied = getattr(tr, "tied", None)
    if (tied is None or tied.head is None or "output.weight" not in optim
            or any(k.startswith("optim.output.weight.") for k in saved_keys(path))):
        load()
        return
    head = optim.pop("output.weight")
    if "tok_embeddings.weight" in optim:        # both ends here: the embedding's state, copied after the load
        load()
        for k, v in optim["tok_embeddings.weight"].items():
            if isinstance(head[k], torch.Tensor):
                head[k].copy_(v)
            else:
                head[k] = v
    else:
        optim["tok_embeddings.weight"] = head
        load()
        del optim["tok_embeddings.weight"]
    optim["output.weight"] = head


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
        self.every, self.keep = t.checkpoint_every, t.keep_checkpoints
        self.rank = dist.get_rank()
        self.enabled = self.every > 0
        self.events: list[dict] = []
        self._pending: int | None = None          # step of the save the writer is busy with
        self._fingerprint = model_fingerprint(tr.cfg.spec) if self.enabled else None
        if self.enabled and self.rank == 0 and self.folder.is_dir():
            for p in self.folder.glob("step-*.tmp"):   # saves that never completed (a crash)
                log(f"removing {p}: a save that never completed (the run stopped while writing it)")
                shutil.rmtree(p, ignore_errors=True)
        self.writer = None
        self.last_saved: str | None = None
        if self.enabled and t.async_checkpoint:
            self.writer = BackgroundWriter(group=None)   # starts now; resume() waits until it is ready

    # ---- resume
    def resume(self) -> int:
        """Load the checkpoint named by train.resume (or the latest one after an elastic restart); return its step.

        With async saves, also wait until the writer process has started (it started with the
        Checkpointer, so its start-up overlaps the load instead of the first training steps)."""
        step = self._resume()
        if self.writer is not None:
            self.writer.wait_ready()
        return step

    def _resume(self) -> int:
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
            head_from_embedding(tr, state, path, lambda: dcp_load(state, path))
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
            origin = (f"saved by plan {meta['plan_describe']} on world {meta.get('world_size')}"
                      if "plan_describe" in meta else f"weights imported from {meta.get('source', '?')}")
            log(f"resumed from {path} (step {step}, {origin}) in {dt:.2f} s")
        return step

    # ---- save
    def after_step(self, step: int) -> None:
        if self.writer is not None and not self.writer.prepared:
            # the first step created the optimizer state: hand the writer its structure now, so that it
            # rebuilds it while training continues instead of during (and delaying) the first save
            self.writer.prepare(collect(self.tr)[0])
        if self.enabled and step % self.every == 0 and step != self.tr.cfg.train.steps:
            self.save(step)

    def finish(self, step: int) -> None:
        """Final save (when checkpointing is on) and wait for it (and any pending save)."""
        if self.enabled:
            self.save(step)
        self.wait()

    def _meta(self, step: int) -> dict:
        tr = self.tr
        return {"format": FORMAT, "kind": "train", "model": tr.cfg.model, "model_name": tr.cfg.spec.name,
                "fingerprint": self._fingerprint, "plan": tr.cfg.plan.to_dict(),
                "plan_describe": tr.cfg.plan.describe(), "world_size": dist.get_world_size(), "step": step,
                "time": time.time(), "seq_len": tr.cfg.seq_len, "global_batch": tr.cfg.global_batch,
                "scheduler": scheduler_state(tr), "data": tr.batches.state_dict(), "torch": torch.__version__}

    def save(self, step: int) -> None:
        t0 = time.perf_counter()                 # perf_counter is system-wide: the writer process reads it too
        started_at = time.time()
        self.wait()                              # at most one save in flight (its wait counts as blocking)
        tmp = self.folder / (step_name(step) + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        meta = self._meta(step)
        state, _ = collect(self.tr)
        kill = kill_due(self.rank, step, self.run_dir, "save")
        if self.writer is not None:
            self.writer.submit(state, {"tmp": str(tmp), "folder": str(self.folder), "step": step, "meta": meta,
                                       "keep": self.keep, "started": t0, "kill": kill,
                                       "cpu_share": self.tr.cfg.train.async_checkpoint_cpu_share})
            self._pending = step
        else:
            dcp.save(state, storage_writer=FileSystemWriter(str(tmp)))
            if kill:
                sigkill_self()
            if self.rank == 0:
                self._saved(finalize(self.folder, step, tmp, meta, self.keep, t0))
        self.events.append({"event": "save", "step": step, "async": self.writer is not None, "started_at": started_at,
                            "blocking_seconds": time.perf_counter() - t0})

    def _saved(self, line: dict) -> None:
        """One line per completed save (rank 0); the newest is named in the run's summary."""
        self.last_saved = line["path"]
        log(f"checkpoint step {line['step']} saved: {line['path']} ({line['bytes'] / 2**20:.1f} MiB, "
            f"{line['seconds']:.2f} s)")

    def wait(self) -> None:
        """Block until the pending asynchronous save is written (and visible)."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        t0 = time.perf_counter()
        done = self.writer.wait() or {}
        if self.rank == 0 and done.get("checkpoint"):
            self._saved(done["checkpoint"])
        self.events.append({"event": "save_done", "step": step, "wait_seconds": time.perf_counter() - t0,
                            "write_seconds": done.get("write_seconds"), "finished_at": done.get("finished_at"),
                            "writer_cpu_seconds": done.get("cpu_seconds"),
                            "writer_paused_seconds": done.get("paused_seconds"),
                            "total_seconds": (done.get("checkpoint") or {}).get("seconds")})

    def close(self) -> None:
        """Wait for the pending save and stop the writer; after an error, stop it without waiting."""
        failing = sys.exc_info()[0] is not None
        try:
            if not failing:
                self.wait()
        finally:
            if self.writer is not None:
                self.writer.close(abort=failing)
                self.writer = None
            if self.rank == 0 and self.events:      # save/load timings (bench/bench_checkpoint.py reads them)
                with (self.run_dir / "checkpoint_events.jsonl").open("a") as f:
                    f.writelines(json.dumps(e) + "\n" for e in self.events)
