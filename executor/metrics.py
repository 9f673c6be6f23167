"""Per-step measurements: where each is taken (``metrics_writer.py`` writes the records).

* Exposed communication time per mesh axis: ``comm_timer.py`` (:class:`~executor.comm_timer.CommTimer`).
* Peak memory per rank: on GPU the CUDA caching allocator's ``max_memory_reserved`` per step
  (what an OOM is about; ``max_memory_allocated`` is reported too); on CPU one profiled step
  replayed from the allocator's events: ``cpu_memory.py``.
* MFU (here) = tokens/s per device x ``cost_models.flops.flops_per_token`` (the one declared
  formula the planner uses too) / peak FLOP/s of the hardware spec (bf16 or fp32 peak,
  matching the compute dtype).
"""
from __future__ import annotations

import torch

from cost_models.specs import load_hardware, preset_for_gpu_name


def hardware_for_device(device: torch.device, override: str | None):
    """The hardware spec for MFU: the override, else the CPU preset or the GPU's preset by its device name
    and memory (``cost_models.specs.preset_for_gpu_name``, the table ``titan-plan`` uses too); None for a
    GPU no preset lists."""
    if override:
        return load_hardware(override)
    if device.type == "cpu":
        return load_hardware("cpu")
    props = torch.cuda.get_device_properties(device)
    preset = preset_for_gpu_name(props.name, props.total_memory / 2**30)
    return load_hardware(preset) if preset is not None else None


def mfu(tokens_per_s_per_device: float, fpt: float | None, peak_flops: float | None) -> float | None:
    if not fpt or not peak_flops:
        return None
    return tokens_per_s_per_device * fpt / peak_flops
