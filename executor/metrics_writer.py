"""Where per-step records go: ``metrics.jsonl``, a console progress line, TensorBoard.

Rank 0 writes; the records themselves are made by ``train.py`` from the
measurements of ``metrics.py``, ``comm_timer.py`` and ``cpu_memory.py``.  After a
resume (``titan-run --resume``, an elastic restart) the file keeps the records up to the resumed step and the
new ones are appended (:func:`keep_records_up_to`).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def keep_records_up_to(path: Path, step: int) -> int:
    """Rewrite the JSONL file `path` keeping, in order, the records with ``step <= step``; returns how many.

    After a resume from the checkpoint of `step` the steps after it are trained again: their old
    records (written after that checkpoint was saved) are dropped, so no step appears twice and
    nothing logged up to the checkpoint is lost.  A torn last line (a process killed mid-write) is
    dropped too.  The rewrite goes through a temporary file and a rename."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(kept)


class MetricsWriter:
    """Rank 0 only: ``metrics.jsonl``, a console progress line, TensorBoard when available.

    `resume_step`: the step the run continues after (0 for a fresh run).  The records of steps up
    to it are kept and new ones appended; later ones are dropped (:func:`keep_records_up_to`), and
    TensorBoard purges its events after it."""

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, tensorboard: bool,
                 resume_step: int = 0):
        self.enabled, self.total = enabled, total_steps
        self.path = run_dir / "metrics.jsonl"
        self._f = None
        if enabled:
            keep_records_up_to(self.path, resume_step)
            self._f = self.path.open("a")
        self._tb = None
        if enabled and tensorboard:
            try:
                # optional package (tensorboard): imported only when train.tensorboard is on
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)
            except Exception:   # tensorboard not installed: JSONL only
                self._tb = None

    def write(self, rec: dict) -> None:
        if not self.enabled:
            return
        rec = {**rec, "time": time.time()}      # when the step ended (unix seconds)
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time"):
                    self._tb.add_scalar(k, v, rec["step"])
            for axis, v in (rec.get("comm_s") or {}).items():
                self._tb.add_scalar(f"comm_s/{axis}", v, rec["step"])
            for k, v in (rec.get("moe") or {}).items():      # MoE routing / all-to-all figures
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"moe/{k}", v, rec["step"])
        print(progress_line(rec, self.total), flush=True)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tb is not None:
            self._tb.close()


def _fmt_bytes(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}MiB" if b < 2**30 else f"{b / 2**30:.2f}GiB"


def progress_line(rec: dict, total: int) -> str:
    mfu_s = "-" if rec.get("mfu") is None else f"{100 * rec['mfu']:.1f}%"
    comm = rec.get("comm_s") or {}
    comm_s = " ".join(f"{k}={1000 * v:.0f}" for k, v in sorted(comm.items()) if v >= 5e-4)
    return (f"step {rec['step']:>{len(str(total))}}/{total}  loss {rec['loss']:.4f}  gnorm {rec['grad_norm']:.3f}  "
            f"lr {rec['lr']:.2e}  {rec['tokens_per_s']:,.0f} tok/s ({rec['tokens_per_s_per_device']:,.0f}/dev)  "
            f"mfu {mfu_s}  step {1000 * rec['step_time_s']:.0f}ms  data {1000 * rec['data_time_s']:.0f}ms  "
            f"mem {_fmt_bytes(rec.get('peak_memory_bytes_max'))}"
            + (f"  comm ms[{comm_s}]" if comm_s else "") + _moe_part(rec.get("moe")))


def _moe_part(moe: dict | None) -> str:
    if not moe:
        return ""
    out = f"  moe imb {moe['router_imbalance']:.2f}"
    if moe.get("all_to_all_bytes"):
        out += f" a2a {1000 * moe['all_to_all_s']:.0f}ms {_fmt_bytes(moe['all_to_all_bytes'])}"
    return out
