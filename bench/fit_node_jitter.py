"""How much a straggler term would explain: the weak-scaling decline of the published series, fitted.

A synchronous step ends when the slowest node does.  If each node's step time scatters around the
model's with a relative spread sigma, the step is longer by sigma x E[max of N standard normals]
(N = nodes; Blom's approximation of the expected maximum).  The cost model has no such term
(docs/reference_data.md, "DP weak scaling": sigma is stated by no source, so it would be a fitted
constant).  This script measures what the data say about it, without changing the model:

1. Series: rows of both validation sets (bench/validate_reference.py) that share model, hardware,
   sequence length, TP / PP / CP / EP, micro-batch, schedule, AC, float8, state layout and source
   family, at two or more GPU counts.  Within a series, log(measured / predicted) relative to its
   smallest GPU count against E[max](nodes) - E[max](nodes0): least squares through the origin gives
   sigma; per-series fits give how many series decline faster than the model.
2. What the term would do to the headline: every row's prediction slowed by 1 + sigma x E[max](nodes),
   median / worst absolute error per set, as it stands and with each (hardware, float8) group's level
   re-centred (what refitting the presets' GEMM efficiencies would do: they were fitted on these rows),
   against the same re-centring without the term.

    python bench/fit_node_jitter.py

Prints the fit and the comparison; the last line is the fitted sigma and the re-centred medians.
"""
from __future__ import annotations

import collections
import math
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import validate_reference as vr  # noqa: E402


def expected_max(n: int) -> float:
    """E[max of n standard normals] (Blom 1958: the (n - 0.375) / (n + 0.25) quantile); 0 for one."""
    return 0.0 if n <= 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def scored_rows() -> list[dict]:
    rows = []
    for set_name in ("shared", "extra"):
        cases, _ = vr.build_cases(vr.load_set(set_name))
        for c in cases:
            m = c.measured.get("tokens_per_s_per_gpu")
            if m is None or "tokens_per_s_per_gpu" in c.not_counted:
                continue
            p = c.plan
            rows.append({"set": set_name, "id": c.id, "gpus": p.world_size,
                         "nodes": math.ceil(p.world_size / c.hw.gpus_per_node),
                         "group": (c.hw.name, bool(p.float8)),
                         "series": (c.model.name, c.hw.name, c.workload.seq_len, p.tp, p.pp, p.cp, p.ep,
                                    p.microbatch, p.schedule, p.stages_per_rank, p.ac, p.float8,
                                    c.workload.state_layout, c.id.split("_")[0]),
                         "log_err": math.log(vr.predict(c)["tokens_per_s_per_gpu"] / m)})
    return rows


def fit_sigma(rows: list[dict]) -> tuple[float, int, int, int]:
    """(pooled sigma, series, points, series declining faster than the model)."""
    by = collections.defaultdict(list)
    for r in rows:
        by[r["series"]].append(r)
    xs, ys, declining, n_series = [], [], 0, 0
    for members in by.values():
        counts = sorted({r["gpus"] for r in members})
        if len(counts) < 2:
            continue
        n_series += 1
        base = [r for r in members if r["gpus"] == counts[0]]
        y0 = np.mean([-r["log_err"] for r in base])           # log(measured / predicted)
        x0 = expected_max(base[0]["nodes"])
        sx = sy = 0.0
        for r in members:
            if r["gpus"] == counts[0]:
                continue
            x, y = expected_max(r["nodes"]) - x0, -r["log_err"] - y0
            xs.append(x)
            ys.append(y)
            sx, sy = sx + x * x, sy + x * y
        declining += sx > 0 and sy < 0
    x, y = np.array(xs), np.array(ys)
    return float(-(x @ y) / (x @ x)), n_series, len(xs), declining


def headline(rows: list[dict], sigma: float, recentre: bool) -> dict[str, tuple[float, float]]:
    err = np.array([r["log_err"] - math.log1p(sigma * expected_max(r["nodes"])) for r in rows])
    if recentre:
        groups = [r["group"] for r in rows]
        for g in set(groups):
            idx = [i for i, gg in enumerate(groups) if gg == g]
            err[idx] -= err[idx].mean()
    out = {}
    for s in ("shared", "extra"):
        ape = np.array([abs(math.expm1(e)) * 100 for e, r in zip(err, rows) if r["set"] == s])
        out[s] = (float(np.median(ape)), float(ape.max()))
    return out


def main() -> None:
    rows = scored_rows()
    sigma, n_series, n_points, declining = fit_sigma(rows)
    print(f"weak/strong-scaling series: {n_series} ({n_points} points beyond each series' smallest GPU count); "
          f"{declining} decline faster than the model with the node count")
    print(f"pooled fit: sigma = {sigma:.4f} of the step per unit of E[max](nodes) "
          f"(at 8 / 64 / 2,048 nodes: {100 * sigma * expected_max(8):.1f} / {100 * sigma * expected_max(64):.1f} / "
          f"{100 * sigma * expected_max(2048):.1f}% of the step)")
    res = {}
    for recentre in (False, True):
        for s in (0.0, sigma):
            h = headline(rows, s, recentre)
            res[(recentre, s)] = h
            print(f"  {'re-centred' if recentre else 'as is':10s} sigma {s:.4f}: "
                  + " | ".join(f"{k} median {v[0]:.2f}% worst {v[1]:.1f}%" for k, v in h.items()))
    a, b = res[(True, 0.0)], res[(True, sigma)]
    print(f"RESULT sigma {sigma:.4f}; re-centred medians without -> with the term: shared {a['shared'][0]:.2f} -> "
          f"{b['shared'][0]:.2f}%, extra {a['extra'][0]:.2f} -> {b['extra'][0]:.2f}%")


if __name__ == "__main__":
    main()
