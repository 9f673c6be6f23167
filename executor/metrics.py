"""Per-step measurements: where each is taken (``metrics_writer.py`` writes the records).

* Exposed communication time per mesh axis: ``comm_timer.py`` (:class:`~executor.comm_timer.CommTimer`).
* Peak memory per rank: on GPU the CUDA caching allocator's ``max_memory_reserved`` per step
  (what an OOM is about; ``max_memory_allocated`` is reported too); on CPU one profiled step
  replayed from the allocator's events: ``cpu_memory.py``.
* MFU (here) = tokens/s of the world x ``cost_models.flops.flops_per_token`` (the one declared
  formula the planner uses too) / the peak FLOP/s of the *current* world (:func:`world_peak_flops`:
  the hardware spec's bf16 or fp32 peak, matching the compute dtype, times the devices the world
  runs on).  On CPU a "device" of the spec is one core (``presets/hardware/cpu.yaml``: one
  process per core, one thread each); a rank's threads are its cores, capped per host at the
  host's cores.  So when an elastic world shrinks (fewer ranks, each with more threads) the peak
  is the peak of what runs now, never that of a world that is gone.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from cost_models.specs import load_hardware, preset_for_gpu_name, this_host_cores


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


def mfu(tokens_per_s: float, fpt: float | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: `tokens_per_s` and `peak_flops` of the same set of devices (the world's)."""
    if not fpt or not peak_flops:
        return None
    return tokens_per_s * fpt / peak_flops


def world_peak_flops(hw, bf16: bool, device: torch.device) -> float | None:
    """Peak FLOP/s of the current world (collective: every rank calls it): per-device peak x devices.

    GPUs: one device per rank.  CPU: per host, min(sum of its ranks' torch threads, its cores) cores.
    """
    if hw is None:
        return None
    per_device = 1e12 * (hw.peak_tflops_bf16 if bf16 else hw.peak_tflops_fp32)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if device.type != "cpu":
        return per_device * world
    mine = (socket.gethostname(), torch.get_num_threads(), this_host_cores())
    every = [mine] * world
    if world > 1:
        dist.all_gather_object(every, mine)
    threads: dict[str, int] = {}
    cores: dict[str, int] = {}
    for host, n_threads, n_cores in every:
        threads[host] = threads.get(host, 0) + n_threads
        cores[host] = n_cores
    return per_device * sum(min(threads[h], cores[h]) for h in threads)
