"""Pareto plot of candidates: tokens/s vs peak memory (PNG; needs matplotlib, the 'plot' extra)."""
from __future__ import annotations

import numpy as np

from .rank import PlanningError, PlanningResult


def pareto_plot(res: PlanningResult, path: str, *, title: str = "") -> None:
    try:
        import matplotlib                # optional ('plot' extra)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanningError("--plot needs matplotlib: pip install 'titan-autoplan[plot]'") from None
    est = res.est
    gib = est.peak_memory_bytes / 2 ** 30
    tps = est.tokens_per_s_per_gpu
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    infeasible = ~est.fits
    ax.scatter(gib[infeasible], tps[infeasible], s=4, c="#cccccc", label="does not fit", rasterized=True)
    ok = np.flatnonzero(est.fits)
    ax.scatter(gib[ok], tps[ok], s=5, c="#4c72b0", alpha=0.5, label="feasible", rasterized=True)
    f = res.pareto
    ax.plot(gib[f], tps[f], "-o", c="#dd8452", ms=4, label="Pareto front")
    if len(res.order):
        b = res.order[0]
        ax.scatter([gib[b]], [tps[b]], marker="*", s=220, c="#c44e52", zorder=5, label="chosen")
    ax.axvline(est.capacity_bytes / 2 ** 30, ls="--", c="k", lw=0.8, label="usable memory")
    ax.set_xlabel("predicted peak memory per device (GiB)")
    ax.set_ylabel("predicted tokens/s per device")
    ax.set_title(title or "candidates")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
