"""Pareto plot of candidates: tokens/s vs peak memory (PNG; needs matplotlib, the 'plot' extra).

The x-axis covers the feasible region and a little beyond: 0 .. ``X_BEYOND_USABLE`` x the usable memory
(drawn as a dashed line), so a front of 78 GiB plans is not a thin strip next to 2,000 GiB ones.
Candidates further right are drawn at the right edge with a ">" marker (clipped, their count in the
legend). The chosen plan is a star. The axis limits and counts are also written into the PNG's text
metadata (key ``titan-plan``, JSON), so a reader (or a test) can check the plot without looking at it.
"""
from __future__ import annotations

import json

import numpy as np

from cost_models.estimate import estimate

from .rank import PlanningError, PlanningResult

X_BEYOND_USABLE = 1.15          # the x-axis ends this far past the usable memory (or past the widest feasible point)
METADATA_KEY = "titan-plan"


def pareto_plot(res: PlanningResult, path: str, *, title: str = "") -> dict:
    """Draw the plot to `path`; returns what the PNG's metadata says (limits, usable memory, counts)."""
    try:
        import matplotlib                # optional ('plot' extra)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt   # matplotlib: optional ('plot' extra)
    except ImportError:
        raise PlanningError("--plot needs matplotlib: pip install 'titan-autoplan[plot]'") from None
    est = res.est
    gib = est.peak_memory_bytes / 2 ** 30
    tps = est.tokens_per_s_per_gpu
    untimed = np.flatnonzero(np.isnan(tps))
    if len(untimed):        # the search times only what fits its memory limit: the others' time for the plot
        tps = tps.copy()
        tps[untimed] = estimate(res.table.take(untimed), res.model, res.hw, res.workload,
                                res.coeffs).tokens_per_s_per_gpu
    usable = est.capacity_bytes / 2 ** 30
    feasible = np.asarray(res.order, dtype=int)
    widest = float(gib[feasible].max()) if len(feasible) else 0.0
    x_max = X_BEYOND_USABLE * max(usable, widest)
    beyond = gib > x_max
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    near = ~est.fits & ~beyond
    ax.scatter(gib[near], tps[near], s=4, c="#bbbbbb", label="does not fit", rasterized=True)
    if beyond.any():
        ax.scatter(np.full(int(beyond.sum()), x_max), tps[beyond], s=18, marker=">", c="#999999", clip_on=False,
                   label=f"{int(beyond.sum()):,} beyond {x_max:,.1f} GiB (at the edge)", rasterized=True)
    ok = np.flatnonzero(est.fits & ~beyond)
    ax.scatter(gib[ok], tps[ok], s=5, c="#4c72b0", alpha=0.5, label="feasible", rasterized=True)
    f = res.pareto
    ax.plot(gib[f], tps[f], "-o", c="#dd8452", ms=4, label="Pareto front")
    chosen = int(res.order[0]) if len(res.order) else None
    if chosen is not None:
        ax.scatter([min(gib[chosen], x_max)], [tps[chosen]], marker="*", s=220, c="#c44e52", zorder=5,
                   label="chosen")
    ax.axvline(usable, ls="--", c="k", lw=0.8, label=f"usable memory ({usable:,.1f} GiB)")
    ax.set_xlim(0.0, x_max)
    ax.set_ylim(bottom=0.0)
    ax.set_xlabel("predicted peak memory per device (GiB)")
    ax.set_ylabel("predicted tokens/s per device")
    ax.set_title(title or "candidates")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    x0, x1 = ax.get_xlim()
    y0, y1 = ax.get_ylim()
    info = {"xlim_gib": [float(x0), float(x1)], "ylim": [float(y0), float(y1)], "usable_gib": float(usable),
            "clipped": int(beyond.sum()), "candidates": int(len(gib)),
            "chosen": None if chosen is None else {"index": chosen, "peak_gib": float(gib[chosen]),
                                                   "tokens_per_s_per_device": float(tps[chosen])}}
    fig.savefig(path, metadata={METADATA_KEY: json.dumps(info)} if str(path).lower().endswith(".png") else None)
    plt.close(fig)
    return info
