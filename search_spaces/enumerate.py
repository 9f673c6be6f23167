"""Enumerate every legal point of a search space, vectorized with numpy.

Points are built in stages, each a cross product followed by the rules that
can be checked at that stage (see `constraints.py` for the rules themselves):

1. layouts ``(dp_replicate, pp, tp, cp)`` over the allowed divisors of the
   world size, ``dp_shard`` being what remains; then ``ep`` (which must divide
   both the expert count and ``dp_shard * cp``);
2. x micro-batch size (the global batch must split evenly over
   ``dp * microbatch``; that fixes ``n_microbatches``);
3. x pipeline schedule and stages per rank (only when ``pp > 1``; with
   ``pp == 1`` the schedule is meaningless and the point is recorded
   canonically as ``1F1B`` with one stage);
4. x the free knobs (activation checkpointing, FSDP reshard, compile,
   float8, backend).

Rejections are counted per rule, in the unit of the stage that applies it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import constraints as C
from .plan import AC_MODES, BACKENDS, MULTI_STAGE_SCHEDULES, SCHEDULES, V_SCHEDULES
from .space import SearchSpace
from .table import CandidateTable


@dataclass
class Rejection:
    reason: str
    count: int
    unit: str


@dataclass
class Enumeration:
    table: CandidateTable
    rejected: list[Rejection] = field(default_factory=list)
    n_layouts: int = 0          # degree tuples whose product is the world size

    def rejected_total(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rejected:
            out[r.reason] = out.get(r.reason, 0) + r.count
        return out


def schedule_options(space: SearchSpace) -> list[tuple[int, int]]:
    """(schedule code, stages_per_rank) pairs the space allows for pp > 1."""
    out = []
    for s in space.knobs["schedule"]:
        if s in V_SCHEDULES:
            out.append((SCHEDULES.index(s), 2))
        elif s in MULTI_STAGE_SCHEDULES:
            out.extend((SCHEDULES.index(s), v) for v in space.knobs["stages_per_rank"] if v >= 2)
        else:
            out.append((SCHEDULES.index(s), 1))
    return sorted(set(out))


def enumerate_plans(space: SearchSpace, t: C.Target) -> Enumeration:
    W = t.world_size
    rejected: list[Rejection] = []

    def reject(mask_bad: np.ndarray, reason: str, unit: str) -> None:
        n = int(mask_bad.sum())
        if n:
            rejected.append(Rejection(reason, n, unit))

    # -- stage 1: degree layouts ----------------------------------------------------------
    vals = [np.array(space.degree_values(a, W), dtype=np.int64) for a in ("dp_replicate", "pp", "tp", "cp")]
    dpr, pp, tp, cp = (g.ravel() for g in np.meshgrid(*vals, indexing="ij"))
    prod = dpr * pp * tp * cp
    ok = (W % prod) == 0
    dpr, pp, tp, cp = dpr[ok], pp[ok], tp[ok], cp[ok]
    dps = W // (dpr * pp * tp * cp)
    n_layouts = len(dps)

    good = np.ones(len(dps), bool)
    shape_ok = (t.n_heads % tp == 0) & (t.n_kv_heads % tp == 0) & (t.ffn_hidden % tp == 0)
    if t.n_experts:
        shape_ok &= (t.moe_ffn_hidden % tp == 0)
    rules = [(shape_ok, C.R_TP_SHAPE)]
    if space.tp_within_node:
        rules.append((tp <= t.gpus_per_node, C.R_TP_NODE))
    rules.append((pp <= t.n_layers, C.R_PP_LAYERS))
    seqdiv = np.where(cp > 1, 2 * cp * tp, tp)
    rules.append(((t.seq_len % seqdiv) == 0, C.R_SEQ))
    for m, reason in rules:
        reject(good & ~m, reason, "layouts")
        good &= m
    dpr, pp, tp, cp, dps = dpr[good], pp[good], tp[good], cp[good], dps[good]

    # ep: carved out of dp_shard * cp
    ep_vals = np.array(space.degree_values("ep", W), dtype=np.int64)
    i, j = _cross(len(dps), len(ep_vals))
    dpr, pp, tp, cp, dps, ep = dpr[i], pp[i], tp[i], cp[i], dps[i], ep_vals[j]
    if t.n_experts:
        ep_ok = (ep == 1) | (((t.n_experts % ep) == 0) & (((dps * cp) % ep) == 0))
    else:
        ep_ok = ep == 1
    reject(~ep_ok, C.R_EP, "layouts")
    dpr, pp, tp, cp, dps, ep = dpr[ep_ok], pp[ep_ok], tp[ep_ok], cp[ep_ok], dps[ep_ok], ep[ep_ok]

    # -- stage 2: micro-batch size ----------------------------------------------------------
    mb_vals = np.array(space.knobs["microbatch"], dtype=np.int64)
    i, j = _cross(len(dps), len(mb_vals))
    dpr, pp, tp, cp, dps, ep, mb = dpr[i], pp[i], tp[i], cp[i], dps[i], ep[i], mb_vals[j]
    per = dpr * dps * mb
    ok = (t.global_batch % per) == 0
    reject(~ok, C.R_BATCH, "layout x micro-batch choices")
    dpr, pp, tp, cp, dps, ep, mb, per = dpr[ok], pp[ok], tp[ok], cp[ok], dps[ok], ep[ok], mb[ok], per[ok]
    nmb = t.global_batch // per

    # -- stage 3: pipeline schedule ------------------------------------------------------------
    opts = schedule_options(space)
    single = pp == 1
    base_single = {k: v[single] for k, v in dict(dpr=dpr, pp=pp, tp=tp, cp=cp, dps=dps, ep=ep, mb=mb, nmb=nmb).items()}
    n_single = int(single.sum())
    base_single["sched"] = np.full(n_single, SCHEDULES.index("1F1B"), dtype=np.int64)
    base_single["v"] = np.ones(n_single, dtype=np.int64)
    multi = ~single
    parts = [base_single]
    if opts and multi.any():
        m_idx = np.flatnonzero(multi)
        sc = np.array([o[0] for o in opts], dtype=np.int64)
        vv = np.array([o[1] for o in opts], dtype=np.int64)
        i, j = _cross(len(m_idx), len(opts))
        rows = m_idx[i]
        d = {k: v[rows] for k, v in dict(dpr=dpr, pp=pp, tp=tp, cp=cp, dps=dps, ep=ep, mb=mb, nmb=nmb).items()}
        d["sched"], d["v"] = sc[j], vv[j]
        ok_l = d["pp"] * d["v"] <= t.n_layers
        reject(~ok_l, C.R_PP_LAYERS, "layout x micro-batch x schedule choices")
        dual = d["sched"] == SCHEDULES.index("DualPipeV")
        inter = d["sched"] == SCHEDULES.index("Interleaved1F1B")
        rounds = np.maximum(1, d["nmb"] // d["pp"])
        ok_m = (d["nmb"] >= np.where(dual, 2 * d["pp"], d["pp"])) & (~inter | (d["nmb"] % rounds == 0))
        reject(ok_l & ~ok_m, C.R_MICRO, "layout x micro-batch x schedule choices")
        keep = ok_l & ok_m
        parts.append({k: v[keep] for k, v in d.items()})
    elif multi.any():
        reject(multi, "no pipeline schedule in the space", "layout x micro-batch choices")
    base = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    # -- stage 4: free knobs ------------------------------------------------------------------
    ac = np.array([AC_MODES.index(a) for a in space.knobs["ac"]], dtype=np.int64)
    rs = np.array(space.knobs["reshard_after_forward"], dtype=bool)
    co = np.array(space.knobs["compile"], dtype=bool)
    f8_list = list(space.knobs["float8"])
    if not t.float8_supported and True in f8_list:
        f8_list = [False] if False in f8_list else []
    f8 = np.array(f8_list, dtype=bool)
    be = np.array([BACKENDS.index(b) for b in space.knobs["backend"]], dtype=np.int64)
    knob_grid = [g.ravel() for g in np.meshgrid(ac, rs, co, f8, be, indexing="ij")]
    n_base, n_knob = len(base["dps"]), len(knob_grid[0])
    if not t.float8_supported and True in space.knobs["float8"]:
        n_f8_dropped = n_base * len(ac) * len(rs) * len(co) * len(be)
        rejected.append(Rejection(C.R_FLOAT8, n_f8_dropped, "candidates"))
    i, j = _cross(n_base, n_knob)
    cols = {
        "dp_replicate": base["dpr"][i], "dp_shard": base["dps"][i], "pp": base["pp"][i], "tp": base["tp"][i],
        "cp": base["cp"][i], "ep": base["ep"][i], "microbatch": base["mb"][i], "n_microbatches": base["nmb"][i],
        "schedule": base["sched"][i], "stages_per_rank": base["v"][i],
        "ac": knob_grid[0][j], "reshard_after_forward": knob_grid[1][j], "compile": knob_grid[2][j],
        "float8": knob_grid[3][j], "backend": knob_grid[4][j],
    }
    return Enumeration(table=CandidateTable(cols), rejected=rejected, n_layouts=n_layouts)


def _cross(n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays for the cross product of n rows with m options (row-major)."""
    return np.repeat(np.arange(n), m), np.tile(np.arange(m), n)
