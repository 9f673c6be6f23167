"""What devices this machine has, found without importing torch.

GPUs are read from ``nvidia-smi`` (or ``rocm-smi``); without them the
"devices" are CPU processes running gloo, one per core.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

# substrings of the device name -> hardware preset (checked in order)
_NVIDIA_PRESETS = (("B200", "b200"), ("H200", "h200"), ("H100", "h100-sxm"), ("H800", "h100-sxm"),
                   ("A100", None))


@dataclass(frozen=True)
class LocalDevices:
    hardware: str        # preset name
    count: int
    description: str


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
            return LocalDevices(_nvidia_preset(name, mem_mib), len(rows), f"{len(rows)} x {name}")
    rsmi = shutil.which("rocm-smi")
    if rsmi:
        try:
            out = subprocess.run([rsmi, "--showproductname"], capture_output=True, text=True, timeout=10)
            n = sum(1 for line in out.stdout.splitlines() if "Card series" in line)
        except (OSError, subprocess.SubprocessError):
            n = 0
        if n:
            return LocalDevices("mi300x", n, f"{n} x AMD Instinct (assumed MI300X)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return LocalDevices("cpu", cores, f"{cores} CPU processes (gloo), no GPU found")


def _nvidia_preset(name: str, mem_mib: float) -> str:
    for key, preset in _NVIDIA_PRESETS:
        if key in name:
            if preset is None:  # A100: by memory size
                return "a100-80g" if mem_mib > 50_000 else "a100-40g"
            return preset
    return "h100-sxm"
