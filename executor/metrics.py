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

from cost_models.specs import load_hardware

_GPU_NAMES = (("h200", "h200"), ("h100", "h100-sxm"), ("b200", "b200"), ("mi300", "mi300x"),
              ("a100-sxm4-40", "a100-40g"), ("a100-pcie-40", "a100-40g"), ("a100", "a100-80g"))


def hardware_for_device(device: torch.device, override: str | None):
    """The hardware spec for MFU: the override, else the CPU preset or the GPU matched by name."""
    if override:
        return load_hardware(override)
    if device.type == "cpu":
        return load_hardware("cpu")
    name = torch.cuda.get_device_name(device).lower().replace(" ", "-")
    for key, preset in _GPU_NAMES:
        if key in name:
            return load_hardware(preset)
    return None


def mfu(tokens_per_s_per_device: float, fpt: float | None, peak_flops: float | None) -> float | None:
    if not fpt or not peak_flops:
        return None
    return tokens_per_s_per_device * fpt / peak_flops
