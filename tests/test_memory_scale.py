"""Memory at production scale (issue 12 item 7) and the GPU-side terms of the hardware presets."""
from __future__ import annotations

import os
import stat

import pytest

from cost_models.specs import SpecError, hardware_from_dict, load_hardware, preset_for_gpu_name, preset_names
from planner.local import UNKNOWN_GPU_PRESET, detect_local_devices


# --------------------------------------------------------------------------- GPU name -> preset
@pytest.mark.parametrize("name, memory_gib, preset", [
    ("NVIDIA H100 80GB HBM3", 79.6, "h100-sxm"),
    ("NVIDIA H100 PCIe", None, "h100-sxm"),
    ("NVIDIA H800", None, "h800"),
    ("NVIDIA H200", 139.8, "h200"),
    ("NVIDIA B200", None, "b200"),
    ("NVIDIA A100-SXM4-40GB", None, "a100-40g"),
    ("NVIDIA A100-SXM4-80GB", None, "a100-80g"),
    ("NVIDIA A100 80GB PCIe", None, "a100-80g"),
    ("NVIDIA A100", 40.0, "a100-40g"),     # the name says no size: the memory decides
    ("NVIDIA A100", 80.0, "a100-80g"),
    ("AMD Instinct MI300X", None, "mi300x"),
    ("Tesla V100-SXM2-32GB", None, None),
    ("NVIDIA GeForce RTX 4090", 24.0, None),
])
def test_preset_for_gpu_name(name, memory_gib, preset):
    assert preset_for_gpu_name(name, memory_gib) == preset
    assert preset_for_gpu_name(name.lower().replace("-", " "), memory_gib) == preset   # case, dashes ignored


def test_every_gpu_name_maps_back_to_its_preset():
    for p in preset_names("hardware"):
        hw = load_hardware(p)
        for n in hw.gpu_names:
            assert preset_for_gpu_name(f"NVIDIA {n}", hw.memory_gib) == p, (p, n)


def test_gpu_names_round_trip_and_refusal():
    hw = load_hardware("h800")
    d = hw.to_dict()
    assert d["gpu_names"] == ["H800"] and hardware_from_dict(d) == hw
    with pytest.raises(SpecError, match="gpu_names"):
        hardware_from_dict({**d, "gpu_names": [""]})


def _fake_smi(tmp_path, monkeypatch, line: str):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\necho '{line}'\necho '{line}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_local_devices_use_the_one_table(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, "NVIDIA H800, 81559")
    d = detect_local_devices()
    assert (d.hardware, d.count) == ("h800", 2)
    _fake_smi(tmp_path, monkeypatch, "NVIDIA A100-PCIE-40GB, 40960")
    assert detect_local_devices().hardware == "a100-40g"
    _fake_smi(tmp_path, monkeypatch, "Tesla V100-SXM2-32GB, 32768")
    d = detect_local_devices()
    assert d.hardware == UNKNOWN_GPU_PRESET and "no hardware preset lists this GPU" in d.description
