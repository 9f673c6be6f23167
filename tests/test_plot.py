"""The Pareto plot (planner/plot.py): the x-axis spans the feasible region, the usable memory is drawn,
candidates far beyond it are clipped at the edge, the chosen plan is marked (read back from the PNG)."""
from __future__ import annotations

import json

import pytest

from cost_models.specs import load_hardware
from planner.cli import main
from planner.plot import METADATA_KEY, X_BEYOND_USABLE


def test_plot_axis_spans_the_feasible_region(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from PIL import Image                     # matplotlib's own dependency

    png = tmp_path / "front.png"
    assert main(["--model", "llama3-8b", "--gpus", "32", "--hardware", "h100-sxm", "--global-batch", "128",
                 "--seq-len", "4096", "--no-write", "--json", "--plot", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 500
        info = json.loads(im.text[METADATA_KEY])
    hw = load_hardware("h100-sxm")
    usable = hw.memory_gib - hw.memory_reserved_gib
    assert info["usable_gib"] == pytest.approx(usable, rel=1e-6)
    x0, x1 = info["xlim_gib"]
    assert x0 == 0.0 and x1 == pytest.approx(X_BEYOND_USABLE * usable, rel=1e-6)   # not 2,000 GiB
    assert 0 < info["clipped"] < info["candidates"]            # llama3-8b has layouts far over 80 GiB
    chosen = info["chosen"]
    assert chosen["peak_gib"] <= usable
    assert chosen["peak_gib"] == pytest.approx(doc["top"][0]["predicted"]["peak_memory_gib"], abs=1e-3)
    assert chosen["tokens_per_s_per_device"] == pytest.approx(doc["top"][0]["predicted"]["tokens_per_s_per_gpu"],
                                                              rel=1e-3)
    assert info["ylim"][0] == 0.0 and info["ylim"][1] >= chosen["tokens_per_s_per_device"]
