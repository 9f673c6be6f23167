"""`Coefficients`: the fittable knobs of the cost model, with their YAML wire format.

Hardware presets carry the efficiency of each unit (GEMM, attention, memory, links);
these coefficients are corrections on top, fitted by calibration from measured
trials.  The defaults mean "no correction" (scales 1.0, no extra overhead) except
where a physical default is needed; those are marked "physical".
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from search_spaces.typed import InputError, check_keys, from_mapping
from search_spaces.yaml_file import read_yaml, write_text


class CoefficientsError(InputError):
    """A calibration file or mapping that cannot be used."""


@dataclass(frozen=True, kw_only=True)
class Coefficients:
    # -- compute: multiply the hardware preset's efficiency of each unit
    gemm_efficiency_scale: float = 1.0
    fp8_gemm_efficiency_scale: float = 1.0
    attention_efficiency_scale: float = 1.0
    memory_bound_efficiency_scale: float = 1.0
    # -- links: multiply the preset's bandwidth*efficiency and latency, per link level
    intra_bw_scale: float = 1.0
    inter_bw_scale: float = 1.0
    intra_latency_scale: float = 1.0
    inter_latency_scale: float = 1.0
    # -- overlap: fraction of the concurrent compute that can hide a collective
    dp_overlap: float = 1.0        # physical: FSDP2 prefetches the next block's all-gather and
    #                                overlaps reduce-scatter with the previous block's backward
    tp_overlap: float = 0.0        # 0 = plain TP (collectives on the critical path); >0 = async TP
    async_tp_overlap: float = 0.33  # measured: the tp_overlap of TorchTitan's async TP (workload
    #   tp_comm_overlap: async; torch's micro_pipeline_tp fused ops): least squares of the paired
    #   vanilla/async log error over TorchTitan's six published pairs (docs/reference_data.md, "How much
    #   async TP hides")
    cp_overlap: float = 1.0        # physical: ring attention overlaps each K/V step with compute
    ep_overlap: float = 0.0        # 0 = all-to-alls exposed (DualPipeV overlaps them by design)
    ep_imbalance: float = 1.0      # max/mean tokens per EP rank; 1.0 = perfectly balanced routing
    # -- fixed costs
    host_overhead_scale: float = 1.0  # multiplies the hardware preset's host (CPU) time per kernel
    #                                launch, `kernel_launch_us`: a platform figure (CPU + framework)
    kernel_launch_s: float = 0.0   # > 0: replaces the preset's host time per launch (seconds); 0 = use
    #   the preset (calibration files written before the figure moved into the presets carry it)
    launch_overlap_sharpness: float = field(default=4.0, metadata={"allow_inf": True})  # p of the smooth
    #   maximum (gpu^p + host^p)^(1/p) that combines GPU and host time of a block (compute.launch_bound;
    #   inf = plain maximum)
    kernel_latency_s: float = 3e-6  # physical: GPU-side fixed cost per kernel (launch latency, ramp and
    #                                tail of the wave) added to its work
    step_overhead_s: float = 0.0   # per optimizer step (data loading, logging, ...)
    microbatch_overhead_s: float = 0.0
    # -- memory
    memory_overhead_bytes: float = 0.0       # extra per-rank bytes on top of the modelled terms
    allocator_fragmentation: float = 0.05    # physical: reserved/allocated - 1 of PyTorch's caching
    #   allocator, applied to activations, logits and FSDP buffers (peaks are compared with
    #   torch.cuda.max_memory_reserved, which TorchTitan reports); `estimate` takes it from the hardware
    #   spec (HardwareSpec.allocator_fragmentation), this figure only when memory is modelled without one
    activation_memory_scale: float = 1.0
    pipeline_buffer_memory_scale: float = 1.0  # multiplies the P2P send buffers the multi-stage pipeline
    #   schedules keep until the end of the step (memory.pipeline_extra_bytes 'sends')
    memory_scale: float = 1.0      # multiplies the whole modelled per-rank peak (the excess is shown as
    #   overhead); calibration sets it so that every measured trial lies at or under its prediction
    float8_saved_input_fraction: float = 1.0  # bytes of a saved linear input under float8 relative to
    #   bf16: 1.0 = torchao keeps the high-precision input (TorchTitan tables: float8 changes peak
    #   memory by <0.5%); 0.5 = Transformer Engine saves the fp8 copy

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CoefficientsError(f"coefficient '{f.name}' must be a number, got {v!r}")
            v = float(v)
            object.__setattr__(self, f.name, v)
            if v < 0:
                raise CoefficientsError(f"coefficient '{f.name}' must be >= 0, got {v}")
            if f.name.endswith("_scale") and v == 0:
                raise CoefficientsError(f"coefficient '{f.name}' must be > 0, got {v}")
            if f.name.endswith("_overlap") and v > 1:
                raise CoefficientsError(f"coefficient '{f.name}' must be in [0, 1], got {v}")
        if self.launch_overlap_sharpness == 0:
            raise CoefficientsError("coefficient 'launch_overlap_sharpness' must be > 0 (inf: plain maximum)")
        if self.ep_imbalance < 1:
            raise CoefficientsError(f"coefficient 'ep_imbalance' must be >= 1, got {self.ep_imbalance}")

    # -- wire format ---------------------------------------------------------------
    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "coefficients") -> "Coefficients":
        check_keys(d, [f.name for f in dataclasses.fields(cls)], where=where, error=CoefficientsError)
        for k, v in d.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CoefficientsError(f"{where}: coefficient '{k}' must be a number, got {v!r}")
        try:
            return cls(**dict(d))
        except CoefficientsError as e:
            raise CoefficientsError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Coefficients":
        """Read a calibration file: the coefficients, either at the top level or under 'coefficients:'.

        Read by the one typed reader: unknown names, non-numbers and non-finite values (NaN, and
        infinity except where a coefficient allows it) are refused in one line naming the file.
        """
        p = Path(path)
        data = read_yaml(p, error=CoefficientsError, what="calibration file")
        if isinstance(data, Mapping) and "coefficients" in data:
            data = data["coefficients"]
        if data is None:
            raise CoefficientsError(f"{p}: an empty calibration file (expected coefficient names and numbers, "
                                    "as written by 'titan-plan calibrate')")
        if not isinstance(data, Mapping):
            raise CoefficientsError(f"{p}: expected a mapping of coefficient names to numbers, "
                                    f"got {type(data).__name__}")
        return from_mapping(cls, data, where=str(p), error=CoefficientsError)

    def save(self, path: str | os.PathLike, *, meta: Mapping[str, Any] | None = None) -> None:
        """Write as YAML; `meta` (provenance, fit residuals, ...) goes next to 'coefficients:'."""
        doc: dict[str, Any] = dict(meta or {})
        doc["coefficients"] = self.to_dict()
        write_text(path, yaml.safe_dump(doc, sort_keys=False), error=CoefficientsError,
                   what="calibration file")   # atomic, through a symlink, never over a device

    def replace(self, **changes: float) -> "Coefficients":
        return dataclasses.replace(self, **changes)
