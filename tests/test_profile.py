"""`titan-plan profile`: the alpha-beta fit and a real (quick) run on this machine."""
from __future__ import annotations

import pytest
import yaml

from cost_models.specs import load_hardware
from planner.cli import main
from planner.profile import RING, fit_alpha_beta


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
    # and the planner accepts it
    assert main(["--hardware", str(out), "--gpus", "2", "--no-write"]) == 0


def test_fit_when_latency_hides_bandwidth_still_reports_every_op():
    rows = [{"op": op, "group": 2, "bytes": b, "seconds": 1e-3} for op in RING for b in (4096, 16384, 65536)]
    fits = fit_alpha_beta(rows)
    assert set(fits) == set(RING)
    for f in fits.values():
        assert f["bw_bytes_per_s"] > 0 and f["latency_s"] >= 0
