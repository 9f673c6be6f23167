"""What devices this machine has, found without importing torch.

GPUs are read from ``nvidia-smi`` (or ``rocm-smi``); without them the
"devices" are CPU processes running gloo, one per core.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from dataclasses import dataclass

from cost_models.specs import preset_for_gpu_name, this_host_cores

# what an unknown GPU is planned as (the executor then reports no MFU for it: cost_models.specs
# preset_for_gpu_name is the one name table; this default is the planner's alone)
UNKNOWN_GPU_PRESET = "h100-sxm"


@dataclass(frozen=True)
class LocalDevices:
    hardware: str        # preset name
    count: int
    description: str


def on_this_host(hw, ref: str):
    """`hw` as planned for: the stock ``cpu`` preset (referenced by name) stands for this machine without a
    GPU, so its host_cores are this machine's cores (the preset's figures are one core's, measured on the
    project's build machine); a profiled hardware file states its own host, and GPUs are unchanged."""
    if hw.device != "cpu" or str(ref) != "cpu":
        return hw
    cores = this_host_cores()
    return hw if hw.host_cores == cores else dataclasses.replace(hw, host_cores=cores)


def detect_local_devices() -> LocalDevices:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
            rows = [r.split(",") for r in out.stdout.strip().splitlines() if r.strip()]
        except (OSError, subprocess.SubprocessError):
            rows = []
        if rows:
            name, mem_mib = rows[0][0].strip(), float(rows[0][1])
            preset = preset_for_gpu_name(name, mem_mib / 1024)
            if preset is None:
                return LocalDevices(UNKNOWN_GPU_PRESET, len(rows), f"{len(rows)} x {name} (no hardware preset "
                                    f"lists this GPU: planned as {UNKNOWN_GPU_PRESET}; pass --hardware)")
            return LocalDevices(preset, len(rows), f"{len(rows)} x {name}")
    rsmi = shutil.which("rocm-smi")
    if rsmi:
        try:
            out = subprocess.run([rsmi, "--showproductname"], capture_output=True, text=True, timeout=10)
            cards = [line.split(":")[-1].strip() for line in out.stdout.splitlines() if "Card series" in line]
        except (OSError, subprocess.SubprocessError):
            cards = []
        if cards:
            preset = preset_for_gpu_name(cards[0])
            if preset is None:   # rocm-smi names some cards by series only: the AMD preset this project has
                return LocalDevices("mi300x", len(cards), f"{len(cards)} x {cards[0]} (assumed MI300X)")
            return LocalDevices(preset, len(cards), f"{len(cards)} x {cards[0]}")
    cores = this_host_cores()
    return LocalDevices("cpu", cores, f"{cores} CPU processes (gloo), no GPU found")

