"""`estimate`: memory, step time, throughput and MFU of every candidate at once.

All arithmetic is numpy over the columns of a `CandidateTable`; the only Python loops
run over a block's few matmuls and the handful of enum values (AC mode, compile,
float8), never over candidates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .coefficients import Coefficients
from .flops import flops_per_token
from .layout import take
from .memory import MEMORY_KEYS, memory_breakdown
from .step_time import TIME_KEYS, step_time_breakdown
from .uncertainty import bands, peak_p90, uncovered_at

GIB = 2 ** 30


@dataclass(frozen=True)
class Estimates:
    step_time_s: np.ndarray            # [n] seconds per optimizer step
    tokens_per_s: np.ndarray           # [n] global tokens/s
    tokens_per_s_per_gpu: np.ndarray   # [n]
    mfu: np.ndarray                    # [n] flops_per_token * tokens/s / (world * peak)
    peak_memory_bytes: np.ndarray      # [n] per-rank peak (worst rank)
    memory: dict[str, np.ndarray]      # bytes; keys MEMORY_KEYS, sum == peak_memory_bytes
    time: dict[str, np.ndarray]        # seconds per step; keys TIME_KEYS, sum == step_time_s
    capacity_bytes: float              # usable memory per device (memory_gib - memory_reserved_gib)
    fits: np.ndarray                   # [n] bool: peak_memory_bytes <= capacity_bytes
    # error bands from the validation residuals of the terms that dominate each candidate
    # (cost_models/uncertainty.py, presets/uncertainty.yaml): one-sided p90 of the step time
    # and of the peak memory, and what no validation run covers (reason -> [n] bool)
    step_time_p90_s: np.ndarray        # [n] seconds
    peak_memory_p90_bytes: np.ndarray  # [n]
    uncovered: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.step_time_s)

    def row(self, i: int) -> dict:
        """Scalars of candidate i (for reports and plan files)."""
        return {
            "step_time_s": float(self.step_time_s[i]),
            "tokens_per_s": float(self.tokens_per_s[i]),
            "tokens_per_s_per_gpu": float(self.tokens_per_s_per_gpu[i]),
            "mfu": float(self.mfu[i]),
            "peak_memory_gib": float(self.peak_memory_bytes[i] / GIB),
            "memory_gib": {k: float(v[i] / GIB) for k, v in self.memory.items()},
            "time_s": {k: float(v[i]) for k, v in self.time.items()},
            "fits": bool(self.fits[i]),
            "step_time_p90_s": float(self.step_time_p90_s[i]),
            "peak_memory_p90_gib": float(self.peak_memory_p90_bytes[i] / GIB),
            "uncovered": uncovered_at(self.uncovered, i),
        }


def capacity_bytes(hw) -> float:
    """Usable memory per device (`Estimates.capacity_bytes`): memory_gib - memory_reserved_gib."""
    return float((hw.memory_gib - hw.memory_reserved_gib) * GIB)


def time_breakdown(table, model, hw, workload, coeffs: Coefficients | None = None) -> dict[str, np.ndarray]:
    """Seconds per step of every candidate by `TIME_KEYS` (their sum is the step time), the
    workload's overlap switches applied to `coeffs` as `estimate` applies them."""
    coeffs = workload.with_overlaps(coeffs or Coefficients(), hw)     # tp_comm_overlap / dp_comm_overlap
    n = len(table)
    worlds = np.unique(table.world_size) if n else np.zeros(0, dtype=np.int64)
    if len(worlds) <= 1:        # one job size (every search): the device as one of its processes sees it
        hw_run = hw.for_world(int(worlds[0])) if len(worlds) else hw
        tim = step_time_breakdown(table, model, hw_run, workload, coeffs)
        return {k: np.asarray(tim[k], dtype=np.float64) + np.zeros(n) for k in TIME_KEYS}
    out = {k: np.zeros(n) for k in TIME_KEYS}
    for w in worlds:            # plans of several job sizes (a calibration set): each with its own threads
        idx = np.flatnonzero(table.world_size == w)
        tim = step_time_breakdown(table.take(idx), model, hw.for_world(int(w)), workload, coeffs)
        for k in TIME_KEYS:
            out[k][idx] = np.asarray(tim[k], dtype=np.float64) + np.zeros(len(idx))
    return out


def memory_by_key(table, model, hw, workload, coeffs: Coefficients | None = None) -> dict[str, np.ndarray]:
    """Bytes per device of every candidate by `MEMORY_KEYS` (their sum is the peak), the calibrated
    ``memory_scale`` included in ``overhead``."""
    coeffs = workload.with_overlaps(coeffs or Coefficients(), hw)
    mem = memory_breakdown(table, model, workload, coeffs, hw=hw)
    mem = {k: np.asarray(mem[k], dtype=np.float64) + np.zeros(len(table)) for k in MEMORY_KEYS}
    if coeffs.memory_scale != 1.0:          # calibrated safety factor: its share is reported as overhead
        mem["overhead"] = mem["overhead"] + (coeffs.memory_scale - 1.0) * sum(mem[k] for k in MEMORY_KEYS)
    return mem


def estimate(table, model, hw, workload, coeffs: Coefficients | None = None, *,
             time_within_bytes: float | None = None, p90: bool = False) -> Estimates:
    """Score every candidate of `table` for `model` on `hw` under `workload`.

    MFU uses the one declared formula, `cost_models.flops.flops_per_token` (6 N_active +
    causal attention), against the dense bf16 peak (fp32 peak when the workload is fp32),
    also for float8 candidates.

    `time_within_bytes` (a search's memory limit): the step time is estimated only for the candidates whose peak
    memory (its p90 bound with `p90`) is within it; the others get NaN time figures (step, tokens/s, MFU, the
    time terms, the p90 step), as a search rejects them on memory alone -- most of a large search's candidates.
    """
    mem = memory_by_key(table, model, hw, workload, coeffs)
    peak = sum(mem[k] for k in MEMORY_KEYS)
    if time_within_bytes is None:
        tim = time_breakdown(table, model, hw, workload, coeffs)
    else:
        judged = peak_p90(mem) if p90 else peak
        keep = np.flatnonzero(judged <= time_within_bytes)
        part = time_breakdown(take(table, keep), model, hw, workload, coeffs) if len(keep) else {}
        tim = {k: np.full(len(table), np.nan) for k in TIME_KEYS}
        for k, v in part.items():
            tim[k][keep] = v
    step = sum(tim[k] for k in TIME_KEYS)
    world = table.world_size.astype(np.float64)
    tokens_per_s = workload.global_batch_tokens / step
    # a CPU process's peak is its threads' (titan-run's MFU counts a host's threads as its cores)
    peak_flops = ((hw.peak_tflops_fp32 if workload.dtype == "fp32" else hw.peak_tflops_bf16) * 1e12
                  * hw.threads_per_process(table.world_size))
    mfu = flops_per_token(model, workload.seq_len) * tokens_per_s / (world * peak_flops)
    capacity = capacity_bytes(hw)
    band = bands(table, model, hw, workload, tim, mem)
    return Estimates(step_time_s=step, tokens_per_s=tokens_per_s, tokens_per_s_per_gpu=tokens_per_s / world,
                     mfu=mfu, peak_memory_bytes=peak, memory=mem, time=tim, capacity_bytes=float(capacity),
                     fits=peak <= capacity, step_time_p90_s=band.step_time_p90_s,
                     peak_memory_p90_bytes=band.peak_memory_p90_bytes, uncovered=band.uncovered)
