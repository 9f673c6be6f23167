"""cost_models/compute.py: GEMM roofline, launch-bound smooth max, the host time per launch."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.coefficients import Coefficients, CoefficientsError
from cost_models.compute import Rates, gemm_time, launch_bound
from cost_models.specs import load_hardware
from cost_models.workload import Workload


def test_gemm_roofline_tiles_waves_and_alignment():
    hw = load_hardware("a100-80g")
    r = Rates(hw, Workload(seq_len=1024, global_batch=8), Coefficients())
    assert r.sms == 108 and r.gemm == pytest.approx(312e12 * 0.78)
    ideal = lambda m, k, n: 2.0 * m * k * n / r.gemm  # noqa: E731
    # 27 x 16 tiles of 256x128 = 4 full waves on 108 SMs: no loss
    assert gemm_time(6912, 4096, 2048, r.gemm, r.mem, 2, 2, r.sms) == pytest.approx(ideal(6912, 4096, 2048))
    # a 128x128 output is 4 tiles of 64x64 (half rate: half the reuse) for 108 SMs: split-K cuts the
    # k loop 16 ways (slices of 256), one wave, plus writing and summing 15 fp32 partials
    # (NVIDIA GEMM guide, Sec. 2.3, 3.2; CUTLASS split-K)
    expect = 2 * 64 * 64 * 256 / (r.gemm / 108 * 0.5) + 15 * 128 * 128 * 8 / r.mem
    assert gemm_time(128, 4096, 128, r.gemm, r.mem, 2, 2, r.sms) == pytest.approx(expect)
    assert expect > 5 * ideal(128, 4096, 128)
    # a row more than 4 full waves of 256x128 tiles: the best is 55 x 4 = 220 tiles of 128x128 in
    # 3 waves (1.5x the full-wave time); no quantization without an SM count
    t108 = gemm_time(256 * 27, 4096, 512, r.gemm, r.mem, 2, 2, r.sms)
    assert t108 == pytest.approx(ideal(256 * 27, 4096, 512))
    t109 = gemm_time(256 * 27 + 1, 4096, 512, r.gemm, r.mem, 2, 2, r.sms)
    assert t109 == pytest.approx(3 * 2.0 * 128 * 128 * 4096 / (r.gemm / 108))
    assert gemm_time(256 * 27 + 1, 4096, 512, r.gemm, r.mem, 2, 2, 0) == pytest.approx(ideal(256 * 27 + 1, 4096, 512))
    # an odd leading dimension (GPT-2's unpadded 50257) halves the tensor-core rate; 50304 does not
    t_odd = gemm_time(8192, 2048, 50257, r.gemm, r.mem, 2, 2, 0)
    t_pad = gemm_time(8192, 2048, 50304, r.gemm, r.mem, 2, 2, 0)
    assert t_odd / t_pad == pytest.approx(2 * 50257 / 50304)
    assert gemm_time(8192, 2048, 25128, r.gemm, r.mem, 2, 2, 0) == pytest.approx(ideal(8192, 2048, 25128))
    # tiny matmuls are bound by their operand traffic (roofline)
    assert gemm_time(8, 8192, 8192, r.gemm, r.mem, 2, 2, r.sms) == pytest.approx(2 * (8 * 8192 * 2 + 8192 * 8192) / r.mem,
                                                                                rel=1e-3)
    # grouped: 16 experts in one kernel share the waves
    one = gemm_time(256, 2048, 768, r.gemm, r.mem, 2, 2, r.sms)
    grouped = gemm_time(256, 2048, 768, r.gemm, r.mem, 2, 2, r.sms, groups=16)
    assert grouped < 16 * one and grouped >= 16 * ideal(256, 2048, 768)


def test_launch_bound_smooth_max():
    g, h = np.array([1.0, 3.0, 3.0]), np.array([3.0, 1.0, 3.0])
    np.testing.assert_allclose(launch_bound(g, h, float("inf")), [3.0, 3.0, 3.0])
    f = launch_bound(g, h, 4.0)
    assert np.all(f >= 3.0) and f[2] == pytest.approx(3.0 * 2 ** 0.25)
    assert launch_bound(100.0, 1.0, 4.0) == pytest.approx(100.0, rel=1e-6)


def test_host_time_per_launch_comes_from_the_preset_unless_overridden():
    wl = Workload(seq_len=1024, global_batch=8)
    hw = load_hardware("a100-80g")
    assert Rates(hw, wl, Coefficients()).launch == pytest.approx(43e-6)
    assert Rates(hw, wl, Coefficients(host_overhead_scale=0.5)).launch == pytest.approx(21.5e-6)
    assert Rates(hw, wl, Coefficients(kernel_launch_s=4e-6)).launch == pytest.approx(4e-6)   # old calibration files
    with pytest.raises(CoefficientsError, match="launch_overlap_sharpness"):
        Coefficients(launch_overlap_sharpness=0)
