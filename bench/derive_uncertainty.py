"""Derive cost_models/presets/uncertainty.yaml (the term spreads of the error bands) from the published runs.

Every row bench/validate_reference.py can express (its mapping, the same presets and default
coefficients) is predicted; each scored metric gives a residual r = measured / predicted - 1
of step time (= predicted / measured tokens/s - 1) or of memory, and the shares of the
prediction's term groups (cost_models/uncertainty.py: TIME_GROUPS, MEMORY_GROUPS; a
params+optimizer row leans on the state terms only, an activations row on the activation
terms only).  Per kind (time, memory): non-negative least squares |r_i| ~ sum_j w_ij a_j
(scipy.optimize.nnls; Lawson & Hanson 1974, ch. 23), then the smallest factor c with a
fraction `--coverage` of the rows at or under their band (r_i <= c sum_j w_ij a_j); the file
stores q_j = c a_j, how many rows lean on each group, the regimes the rows cover and the
largest validated world size.  `bench/reference_extra.yaml` rows are used as well when
validate_reference.py can load them.

    python bench/derive_uncertainty.py            # print the fit and its coverage
    python bench/derive_uncertainty.py --write    # and write the preset file
"""
from __future__ import annotations

import argparse
import datetime
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import nnls

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import validate_reference as vr  # noqa: E402

from cost_models.coefficients import Coefficients  # noqa: E402
from cost_models.estimate import estimate  # noqa: E402
from cost_models.uncertainty import MEMORY_GROUPS, TIME_GROUPS, UNCERTAINTY_FILE, group_shares, regimes  # noqa: E402
from search_spaces.table import CandidateTable  # noqa: E402

MIN_SHARE = 0.05    # a row "leans on" a term group when the group is >= 5% of its prediction
MIN_ROWS = 3        # a group with fewer such rows is uncovered


def all_cases():
    """(cases, where they came from): the shared reference, plus H6's extra set when it loads."""
    cases, _ = vr.build_cases(vr.load_rows())
    sources = ["../shared/reference/published_runs.yaml"]
    extra = ROOT / "bench" / "reference_extra.yaml"
    load_extra = getattr(vr, "load_extra_rows", None)
    if extra.is_file() and callable(load_extra):
        more, _ = vr.build_cases(load_extra())
        cases += more
        sources.append("bench/reference_extra.yaml")
    return cases, sources


def residual_rows(cases):
    """[(kind, shares {group: w}, residual r, regime names, world)] for every scored metric."""
    out = []
    for c in cases:
        coeffs = Coefficients()
        table = CandidateTable.from_plans([c.plan])
        est = estimate(table, c.model, c.hw, c.workload, coeffs)
        pred = vr.predict(c)
        reg = sorted(regimes(table, c.model, c.hw, c.workload))
        world = int(table.world_size[0])
        for metric, meas in c.measured.items():
            if metric in c.not_counted:
                continue
            if metric == "tokens_per_s_per_gpu":
                w = {g: float(v[0]) for g, v in group_shares(est.time, TIME_GROUPS).items()}
                out.append(("time", w, pred[metric] / meas - 1.0, reg, world))
                continue
            if metric in ("peak_mem_gib", "nvidia_smi_gib"):   # a device's whole peak (nvidia-smi: + CUDA context)
                w = {g: float(v[0]) for g, v in group_shares(est.memory, MEMORY_GROUPS).items()}
            elif metric == "params_opt_gib":
                w = {g: float(g == "states") for g in MEMORY_GROUPS}
            elif metric == "activations_gib":
                w = {g: float(g == "activations") for g in MEMORY_GROUPS}
            else:
                continue
            out.append(("memory", w, meas / pred[metric] - 1.0, reg, world))
    return out


def fit(shares: np.ndarray, r: np.ndarray, coverage: float) -> tuple[np.ndarray, float, float]:
    """(q per group, factor c, achieved coverage) for rows `shares` [rows, groups] and residuals r."""
    a, _ = nnls(shares, np.abs(r))
    band = shares @ a
    ratio = np.where(band > 0, r / np.maximum(band, 1e-300), np.where(r <= 0, -np.inf, np.inf))
    k = max(0, math.ceil(coverage * len(r)) - 1)
    c = float(np.sort(ratio)[k])
    c = c if np.isfinite(c) and c > 0 else 1.0
    q = c * a
    achieved = float(np.mean(r <= shares @ q + 1e-12))
    return q, c, achieved


def bootstrap() -> None:
    """estimate() reads the file it is about to be derived from; the residuals do not depend on it, so a
    missing file is first written with zero spreads (what a first derivation replaces)."""
    if not UNCERTAINTY_FILE.is_file():
        zero = {"p90_relative_error": 0.0, "rows": 0}
        UNCERTAINTY_FILE.write_text(yaml.safe_dump(
            {"time": {g: zero for g in TIME_GROUPS}, "memory": {g: zero for g in MEMORY_GROUPS},
             "covered_regimes": [], "max_world": 1, "min_share": MIN_SHARE, "min_rows": MIN_ROWS}))


def derive(coverage: float = 0.9) -> dict:
    bootstrap()
    cases, sources = all_cases()
    rows = residual_rows(cases)
    doc = {"derived_by": "bench/derive_uncertainty.py", "sources": sources, "coverage": coverage,
           "min_share": MIN_SHARE, "min_rows": MIN_ROWS}
    for kind, groups in (("time", TIME_GROUPS), ("memory", MEMORY_GROUPS)):
        sel = [x for x in rows if x[0] == kind]
        names = list(groups)
        w = np.array([[x[1][g] for g in names] for x in sel])
        r = np.array([x[2] for x in sel])
        q, c, achieved = fit(w, r, coverage)
        n_rows = (w >= MIN_SHARE).sum(axis=0)
        doc[kind] = {g: {"p90_relative_error": round(float(q[j]), 4), "rows": int(n_rows[j])}
                     for j, g in enumerate(names)}
        doc[f"{kind}_fit"] = {"rows": len(sel), "scale": round(c, 4), "achieved_coverage": round(achieved, 4),
                              "median_abs_residual": round(float(np.median(np.abs(r))), 4),
                              "max_residual": round(float(r.max()), 4), "min_residual": round(float(r.min()), 4)}
    doc["covered_regimes"] = sorted({name for x in rows for name in x[3]})
    doc["max_world"] = max(x[4] for x in rows)
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coverage", type=float, default=0.9)
    ap.add_argument("--write", action="store_true", help=f"write {UNCERTAINTY_FILE.relative_to(ROOT)}")
    args = ap.parse_args()
    doc = derive(args.coverage)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    head = (f"# Term spreads of the cost model's error bands (cost_models/uncertainty.py).\n"
            f"# Written by `python bench/derive_uncertainty.py --write` on {datetime.date.today()} at model "
            f"commit {commit};\n# do not edit by hand: rerun the script after a change to the cost model.\n")
    text = head + yaml.safe_dump(doc, sort_keys=False)
    print(text)
    for kind in ("time", "memory"):
        f = doc[f"{kind}_fit"]
        print(f"RESULT {kind}: {f['rows']} rows, coverage {f['achieved_coverage']:.0%} (target {args.coverage:.0%}), "
              + ", ".join(f"{g} q={v['p90_relative_error']:.3f} ({v['rows']} rows)" for g, v in doc[kind].items()))
    if args.write:
        UNCERTAINTY_FILE.write_text(text)
        print(f"wrote {UNCERTAINTY_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
