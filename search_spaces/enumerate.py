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

Each stage applies the predicates of `constraints.py` (the same code `check_plan`
runs on one plan) to its columns.  Rejections are counted per rule, in the unit
of the stage that applies it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from . import constraints as C
from .plan import AC_MODES, BACKENDS, MULTI_STAGE_SCHEDULES, SCHEDULES, V_SCHEDULES
from .space import SearchSpace
from .table import CandidateTable, Columns


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
    rejected: list[Rejection] = []
    d, n_layouts = _layouts(space, t, rejected)
    d = _with_ep(d, space, t, rejected)
    d = _with_microbatch(d, space, t, rejected)
    base = _with_schedules(d, space, t, rejected)
    cols = _with_knobs(base, space, t, rejected)
    good = _keep(Columns(cols), (C.SPLIT_AC,), "candidates", t, rejected)
    cols = {k: v[good] for k, v in cols.items()}
    return Enumeration(table=CandidateTable(cols), rejected=rejected, n_layouts=n_layouts)


def _keep(view: Columns, rules: tuple[C.Rule, ...], unit: str, t: C.Target,
          rejected: list[Rejection]) -> np.ndarray:
    """Mask of the rows of `view` that pass `rules` (the predicates of constraints.py), counting
    the rows each reason rejects first (rules sharing a reason count once) into `rejected`."""
    good = np.ones(len(view), bool)
    for reason, group in itertools.groupby(rules, key=lambda r: r.reason):
        m = np.ones(len(view), bool)
        for r in group:
            m &= r.ok(view, t)
        n = int((good & ~m).sum())
        if n:
            rejected.append(Rejection(reason, n, unit))
        good &= m
    return good


def _layouts(space: SearchSpace, t: C.Target, rejected: list[Rejection]) -> tuple[dict[str, np.ndarray], int]:
    """Stage 1: the degree layouts (dp_replicate, pp, tp, cp; dp_shard what remains) that pass the
    layout rules, and how many degree tuples multiply to the world size."""
    W = t.world_size
    vals = [np.array(space.degree_values(a, W), dtype=np.int64) for a in ("dp_replicate", "pp", "tp", "cp")]
    dpr, pp, tp, cp = (g.ravel() for g in np.meshgrid(*vals, indexing="ij"))
    prod = dpr * pp * tp * cp
    ok = (W % prod) == 0
    d = dict(dp_replicate=dpr[ok], pp=pp[ok], tp=tp[ok], cp=cp[ok])
    d["dp_shard"] = W // (d["dp_replicate"] * d["pp"] * d["tp"] * d["cp"])
    n_layouts = len(d["dp_shard"])
    # one stage per rank for now: the pipeline-length rule is checked again once stages_per_rank is known
    view = Columns({**d, "stages_per_rank": np.ones(n_layouts, dtype=np.int64)})
    stage1 = (C.TP_SHAPE,) + ((C.TP_NODE,) if space.tp_within_node else ()) + (C.PP_LAYERS, C.SEQ)
    good = _keep(view, stage1, "layouts", t, rejected)
    return {k: v[good] for k, v in d.items()}, n_layouts


def _with_ep(d: dict[str, np.ndarray], space: SearchSpace, t: C.Target,
             rejected: list[Rejection]) -> dict[str, np.ndarray]:
    """The layouts x ep, which is carved out of dp_shard * cp."""
    ep_vals = np.array(space.degree_values("ep", t.world_size), dtype=np.int64)
    i, j = _cross(len(d["dp_shard"]), len(ep_vals))
    d = {k: v[i] for k, v in d.items()}
    d["ep"] = ep_vals[j]
    good = _keep(Columns(d), (C.EP_EXPERTS, C.EP_MESH), "layouts", t, rejected)
    return {k: v[good] for k, v in d.items()}


def _with_microbatch(d: dict[str, np.ndarray], space: SearchSpace, t: C.Target,
                     rejected: list[Rejection]) -> dict[str, np.ndarray]:
    """Stage 2: x the micro-batch size, which fixes n_microbatches."""
    mb_vals = np.array(space.knobs["microbatch"], dtype=np.int64)
    i, j = _cross(len(d["dp_shard"]), len(mb_vals))
    d = {k: v[i] for k, v in d.items()}
    d["microbatch"] = mb_vals[j]
    d["n_microbatches"] = t.global_batch // (d["dp_replicate"] * d["dp_shard"] * d["microbatch"])
    good = _keep(Columns(d), (C.BATCH,), "layout x micro-batch choices", t, rejected)
    return {k: v[good] for k, v in d.items()}


def _with_schedules(d: dict[str, np.ndarray], space: SearchSpace, t: C.Target,
                    rejected: list[Rejection]) -> dict[str, np.ndarray]:
    """Stage 3: the pipelined rows x the schedule options; rows without a pipeline canonically 1F1B
    with one stage per rank."""
    opts = schedule_options(space)
    single = d["pp"] == 1
    base_single = {k: v[single] for k, v in d.items()}
    n_single = int(single.sum())
    base_single["schedule"] = np.full(n_single, SCHEDULES.index("1F1B"), dtype=np.int64)
    base_single["stages_per_rank"] = np.ones(n_single, dtype=np.int64)
    multi = ~single
    parts = [base_single]
    if opts and multi.any():
        m_idx = np.flatnonzero(multi)
        sc = np.array([o[0] for o in opts], dtype=np.int64)
        vv = np.array([o[1] for o in opts], dtype=np.int64)
        i, j = _cross(len(m_idx), len(opts))
        dm = {k: v[m_idx[i]] for k, v in d.items()}
        dm["schedule"], dm["stages_per_rank"] = sc[j], vv[j]
        good = _keep(Columns(dm), (C.PP_LAYERS,) + C.MICRO_RULES, "layout x micro-batch x schedule choices",
                     t, rejected)
        parts.append({k: v[good] for k, v in dm.items()})
    elif multi.any():
        rejected.append(Rejection("no pipeline schedule in the space", int(multi.sum()),
                                  "layout x micro-batch choices"))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _with_knobs(base: dict[str, np.ndarray], space: SearchSpace, t: C.Target,
                rejected: list[Rejection]) -> dict[str, np.ndarray]:
    """Stage 4: `base` x the free knobs (activation checkpointing, reshard, compile, float8, backend)."""
    ac = np.array([AC_MODES.index(a) for a in space.knobs["ac"]], dtype=np.int64)
    rs = np.array(space.knobs["reshard_after_forward"], dtype=bool)
    co = np.array(space.knobs["compile"], dtype=bool)
    f8_all = np.array(space.knobs["float8"], dtype=bool)
    f8 = f8_all[C.FLOAT8.ok(Columns({"float8": f8_all}), t)]
    be = np.array([BACKENDS.index(b) for b in space.knobs["backend"]], dtype=np.int64)
    knob_grid = [g.ravel() for g in np.meshgrid(ac, rs, co, f8, be, indexing="ij")]
    n_base, n_knob = len(base["dp_shard"]), len(knob_grid[0])
    if len(f8) < len(f8_all):
        n_f8_dropped = n_base * len(ac) * len(rs) * len(co) * len(be) * (len(f8_all) - len(f8))
        rejected.append(Rejection(C.R_FLOAT8, n_f8_dropped, "candidates"))
    i, j = _cross(n_base, n_knob)
    cols = {k: v[i] for k, v in base.items()}
    for k, g in zip(("ac", "reshard_after_forward", "compile", "float8", "backend"), knob_grid):
        cols[k] = g[j]
    return cols


def _cross(n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays for the cross product of n rows with m options (row-major)."""
    return np.repeat(np.arange(n), m), np.tile(np.arange(m), n)
