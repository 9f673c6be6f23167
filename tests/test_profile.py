"""`titan-plan profile`: the alpha-beta fit and a real (quick) run on this machine."""
from __future__ import annotations

import pytest
import yaml

from cost_models.specs import load_hardware, this_host_cores
from planner.cli import main
from planner.profile import RING, fit_alpha_beta, thread_scalings


def test_fit_recovers_alpha_beta():
    alpha, bw = 20e-6, 5e9
    rows = []
    for op, (traffic, steps) in RING.items():
        for g in ((2,) if op == "p2p" else (2, 4, 8)):
            for nbytes in (4096, 65536, 2 ** 20, 2 ** 24):
                rows.append({"op": op, "group": g, "bytes": nbytes,
                             "seconds": steps(g) * alpha + traffic(g) * nbytes / bw})
    fits = fit_alpha_beta(rows)
    assert set(fits) == set(RING)
    for f in fits.values():
        assert f["latency_s"] == pytest.approx(alpha, rel=1e-6)
        assert f["bw_bytes_per_s"] == pytest.approx(bw, rel=1e-6)


@pytest.mark.slow
def test_profile_quick_run_writes_usable_spec(tmp_path, capsys):
    out = tmp_path / "hw.yaml"
    assert main(["profile", "--nproc", "2", "--quick", "--out", str(out), "--base", "cpu", "--name", "cpu-here"]) == 0
    text, err = capsys.readouterr()
    assert "all_gather" in text and "wrote" in text
    # progress without a terminal: one line per finished stage, in order (no bar)
    stages = [ln for ln in err.splitlines() if ln.startswith("[titan-plan profile] ") and "elapsed" in ln]
    assert [ln.split()[2:4] for ln in stages] == [["1/2", "gemm"], ["2/2", "collectives:"]], err
    hw = load_hardware(str(out))
    assert hw.name == "cpu-here" and hw.device == "cpu" and hw.gpus_per_node == 2
    assert 0 < hw.peak_tflops_fp32 < 10 and hw.intra_node_bw_gbs > 0
    assert "measured by `titan-plan profile`" in yaml.safe_load(out.read_text())["source"]
    if this_host_cores() > 1:      # the threaded pass: one process on every core
        assert "one process on all" in text
        assert 0 < hw.thread_gemm_scaling <= 1 and 0 < hw.thread_memory_scaling <= 1
        assert hw.host_cores == this_host_cores()
    # and the planner accepts it
    assert main(["--hardware", str(out), "--gpus", "2", "--no-write"]) == 0


def test_fit_when_latency_hides_bandwidth_still_reports_every_op():
    rows = [{"op": op, "group": 2, "bytes": b, "seconds": 1e-3} for op in RING for b in (4096, 16384, 65536)]
    fits = fit_alpha_beta(rows)
    assert set(fits) == set(RING)
    for f in fits.values():
        assert f["bw_bytes_per_s"] > 0 and f["latency_s"] >= 0


def test_thread_scalings_from_one_and_all_cores():
    gemm1 = [{"tflops": 0.05}, {"tflops": 0.06}]
    m = {"gemm": gemm1, "memory_bw_gbs": 10.0,
         "threaded": {"threads": 4, "gemm": [{"tflops": 0.2}, {"tflops": 0.21}], "memory_bw_gbs": 25.0}}
    # the best shape at each count: 0.21 / 0.06 = 3.5 = 1 + 3 x 0.833; memory 2.5 = 1 + 3 x 0.5
    assert thread_scalings(m) == {"thread_gemm_scaling": 0.833, "thread_memory_scaling": 0.5}
    # no speedup at all is clipped to the smallest allowed scaling, a super-linear one to 1
    m["threaded"]["memory_bw_gbs"], m["threaded"]["gemm"] = 9.0, [{"tflops": 0.5}]
    assert thread_scalings(m) == {"thread_gemm_scaling": 1.0, "thread_memory_scaling": 0.05}
    assert thread_scalings({"gemm": gemm1, "memory_bw_gbs": 10.0}) == {}      # one core, or an older profile
