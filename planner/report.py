"""Human and machine readable views of a planning result."""
from __future__ import annotations

import datetime as _dt
from typing import Any

from cost_models.estimate import Estimates
from cost_models.memory import MEMORY_KEYS
from cost_models.step_time import TIME_KEYS
from cost_models.uncertainty import uncovered_at
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable

GiB = 2.0 ** 30


# the one plan printer is Plan's (search_spaces.plan); these names are kept for callers of report
layout_str = Plan.layout_str
knobs_str = Plan.knobs_str


def predicted(est: Estimates, i: int) -> dict[str, Any]:
    """One candidate's figures as plain numbers (the `predicted` block of plan.yaml)."""
    return {
        "step_time_s": round(float(est.step_time_s[i]), 6),
        "tokens_per_s": round(float(est.tokens_per_s[i]), 1),
        "tokens_per_s_per_gpu": round(float(est.tokens_per_s_per_gpu[i]), 2),
        "mfu": round(float(est.mfu[i]), 4),
        "peak_memory_gib": round(float(est.peak_memory_bytes[i]) / GiB, 3),
        "headroom_gib": round((est.capacity_bytes - float(est.peak_memory_bytes[i])) / GiB, 3),
        "memory_gib": {k: round(float(est.memory[k][i]) / GiB, 4) for k in MEMORY_KEYS if k in est.memory},
        "time_s": {k: round(float(est.time[k][i]), 6) for k in TIME_KEYS if k in est.time},
        "step_time_p90_s": round(float(est.step_time_p90_s[i]), 6),          # conservative bounds
        "peak_memory_p90_gib": round(float(est.peak_memory_p90_bytes[i]) / GiB, 3),
        # the terms and regimes this candidate leans on that no published run validates (cost_models/uncertainty.py)
        "not_validated": uncovered_at(est.uncovered, i),
    }


def candidate_rows(table: CandidateTable, est: Estimates, idx) -> list[dict[str, Any]]:
    return [{"plan": table.plan(int(i)).to_dict(), "predicted": predicted(est, int(i))} for i in idx]


def format_table(table: CandidateTable, est: Estimates, idx, *, title: str = "", p90: bool = False) -> str:
    """One line per candidate of `idx`; with `p90` also the conservative step time and peak memory."""
    head = ("#", "layout", "knobs", "step s", "tok/s/dev", "MFU", "peak GiB", "free GiB")
    head += ("p90 step s", "p90 GiB") if p90 else ()
    rows = []
    for r, i in enumerate(idx, 1):
        i = int(i)
        p = table.plan(i)
        rows.append((str(r), p.layout_str(), p.knobs_str(), _num(est.step_time_s[i]),
                     _num(est.tokens_per_s_per_gpu[i]), f"{100 * est.mfu[i]:.1f}%",
                     f"{est.peak_memory_bytes[i] / GiB:.2f}",
                     f"{(est.capacity_bytes - est.peak_memory_bytes[i]) / GiB:.2f}")
                    + ((_num(est.step_time_p90_s[i]), f"{est.peak_memory_p90_bytes[i] / GiB:.2f}") if p90 else ()))
    widths = [max(len(h), *(len(row[c]) for row in rows)) if rows else len(h) for c, h in enumerate(head)]
    right = {0, 3, 4, 5, 6, 7, 8, 9}

    def fmt(row):
        return "  ".join(v.rjust(w) if c in right else v.ljust(w) for c, (v, w) in enumerate(zip(row, widths)))

    lines = ([title] if title else []) + [fmt(head), fmt(tuple("-" * w for w in widths))]
    lines += [fmt(row) for row in rows]
    return "\n".join(lines)


def format_breakdown(est: Estimates, i: int) -> str:
    lines = ["memory per device (GiB):"]
    for k in MEMORY_KEYS:
        if k in est.memory:
            lines.append(f"  {k:<13}{est.memory[k][i] / GiB:10.3f}")
    lines.append(f"  {'peak':<13}{est.peak_memory_bytes[i] / GiB:10.3f}   "
                 f"(usable {est.capacity_bytes / GiB:.1f}, {'fits' if est.fits[i] else 'DOES NOT FIT'})")
    lines.append("time per step (s):")
    for k in TIME_KEYS:
        if k in est.time:
            lines.append(f"  {k:<13}{est.time[k][i]:10.4f}")
    lines.append(f"  {'step':<13}{est.step_time_s[i]:10.4f}")
    lines.append(f"conservative (p90) bounds: step {est.step_time_p90_s[i]:.4f} s, "
                 f"peak {est.peak_memory_p90_bytes[i] / GiB:.3f} GiB")
    if est.fits[i] and est.peak_memory_p90_bytes[i] > est.capacity_bytes:
        lines.append(f"note: the p90 peak is over the usable {est.capacity_bytes / GiB:.1f} GiB: by the memory model's "
                     f"validation residuals, a 1-in-10 chance or more that this layout runs out of memory "
                     f"(titan-plan --rank-by p90 keeps to layouts whose bound fits)")
    gaps = uncovered_at(est.uncovered, i)
    lines.append("validation: " + ("every term and regime it leans on is covered by published runs" if not gaps else
                                   "no published run covers " + "; ".join(gaps)
                                   + " (the p90 bounds were not measured there)"))
    lines.append(f"throughput: {est.tokens_per_s[i]:,.0f} tokens/s, {est.tokens_per_s_per_gpu[i]:,.1f} per device, "
                 f"MFU {100 * est.mfu[i]:.1f}%")
    return "\n".join(lines)


def provenance(command: list[str], n_candidates: int) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version   # imported when used (titan-plan's cold start)
    try:
        v = version("titan-autoplan")
    except PackageNotFoundError:
        v = "unknown"
    return {"tool": "titan-plan", "version": v,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(command), "candidates_scored": int(n_candidates)}


def _num(x: float) -> str:
    x = float(x)
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.1:
        return f"{x:.3f}"
    return f"{x:.2e}"
