"""Score every candidate, drop the infeasible ones (with the reason), rank, Pareto front."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from cost_models.coefficients import Coefficients
from cost_models.estimate import Estimates, capacity_bytes, estimate
from cost_models.layout import take
from cost_models.specs import HardwareSpec, ModelSpec
from cost_models.workload import Workload
from search_spaces import constraints as C
from search_spaces.enumerate import Enumeration, Rejection, enumerate_plans
from search_spaces.plan import backend_unrunnable, grad_sync_unrunnable, tp_shards_unrunnable
from search_spaces.space import SearchSpace
from search_spaces.table import CandidateTable
from search_spaces.typed import MAX_WORLD_SIZE, InputError


RANK_BY = ("time", "p90")   # the point estimate, or the conservative (one-sided p90) bounds


class PlanningError(InputError):
    """The question has no answer (no layout fits, ...); the message says why."""


@dataclass
class PlanningResult:
    table: CandidateTable           # every enumerated candidate
    est: Estimates                  # their estimates (same order)
    order: np.ndarray               # indices of feasible candidates, best first
    pareto: np.ndarray              # indices on the tokens/s vs peak-memory front, by memory
    rejected: list[Rejection] = field(default_factory=list)
    n_layouts: int = 0
    model: ModelSpec | None = None       # what the candidates were scored with
    hw: HardwareSpec | None = None
    workload: Workload | None = None
    coeffs: Coefficients | None = None
    rank_by: str = "time"
    # pipeline split searched (`plan_candidates(pp_splits=...)`): each split's best step time in seconds (None:
    # nothing fits under it); the chosen split is ``workload.pp_split``.  Empty when one split was scored.
    split_best: dict[str, float | None] = field(default_factory=dict)
    # likewise the TP activation regimes searched (`plan_candidates(tp_activations=...)`): the chosen one is
    # ``workload.tp_activations``
    tp_best: dict[str, float | None] = field(default_factory=dict)
    # and the gradient-sync regimes (`plan_candidates(grad_syncs=...)`): the chosen one is ``workload.pp_grad_sync``
    sync_best: dict[str, float | None] = field(default_factory=dict)
    # and the selective-checkpointing policies (`plan_candidates(selective_acs=...)`): ``workload.selective_ac``
    policy_best: dict[str, float | None] = field(default_factory=dict)
    enumeration: Enumeration | None = field(default=None, repr=False)   # what `table` came from
    # (step time, peak memory) the ranking used, as `step_time` / `peak_memory` give them (else read from `est`)
    ranked: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def step_time(self) -> np.ndarray:
        """The step time the ranking uses (seconds per step, every candidate)."""
        if self.ranked is not None:
            return self.ranked[0]
        return self.est.step_time_p90_s if self.rank_by == "p90" else self.est.step_time_s

    def peak_memory(self) -> np.ndarray:
        """The peak memory feasibility is judged by (bytes per device, every candidate)."""
        if self.ranked is not None:
            return self.ranked[1]
        return self.est.peak_memory_p90_bytes if self.rank_by == "p90" else self.est.peak_memory_bytes

    @property
    def n_candidates(self) -> int:
        return len(self.table)

    @property
    def n_feasible(self) -> int:
        return len(self.order)

    def best(self) -> int:
        if not len(self.order):
            raise PlanningError(self.why_nothing_fits())
        return int(self.order[0])

    def why_nothing_fits(self) -> str:
        if self.n_candidates == 0:
            reasons = sorted(self.rejected, key=lambda r: -r.count)
            top = "; ".join(f"{r.count} {r.unit}: {r.reason}" for r in reasons[:3]) or "empty search space"
            return f"no layout is legal for this world size and model ({top})"
        peak = self.peak_memory()
        i = int(np.argmin(peak))
        bound = " (p90 bound)" if self.rank_by == "p90" else ""
        return (f"no layout fits in memory: the smallest needs {peak[i] / 2**30:.1f} GiB{bound} "
                f"per device, {self.est.capacity_bytes / 2**30:.1f} GiB usable "
                f"(try more devices, a longer pipeline, or a smaller micro-batch/global batch)")


def plan_candidates(space: SearchSpace, model: ModelSpec, hw: HardwareSpec, workload: Workload, *,
                    world_size: int, gpus_per_node: int | None = None, coeffs: Coefficients | None = None,
                    memory_margin: float = 0.0, rank_by: str = "time",
                    pp_splits: tuple[str, ...] | None = None,
                    tp_activations: tuple[str, ...] | None = None,
                    grad_syncs: tuple[str, ...] | None = None,
                    selective_acs: tuple[str, ...] | None = None) -> PlanningResult:
    """Enumerate and score everything; feasible = legal and peak memory within capacity*(1-margin).

    ``rank_by="p90"`` ranks by the conservative step time (`Estimates.step_time_p90_s`) and judges
    feasibility by the conservative peak memory (`Estimates.peak_memory_p90_bytes`).

    `pp_splits` (workload ``pp_split`` values; default: the workload's own) are the pipeline splits to search:
    each is scored as a workload of its own and the result is the one whose best candidate has the shortest step
    (then the least memory; the first split on a tie).  A split changes nothing without a pipeline, so the
    others are scored only when the first has candidates with ``pp > 1``.  `tp_activations` (workload
    ``tp_activations`` values, e.g. ``("auto", "sharded")``; default: the workload's own) likewise, each with every
    split, only when there are candidates with ``tp > 1``: under ``sharded`` the candidates titan-run cannot keep
    sequence shards on (`plan.tp_shards_unrunnable`) are rejected, so that regime wins only where keeping
    shards lets a faster layout fit.  `grad_syncs` (workload ``pp_grad_sync`` values, e.g. ``("auto",
    "every_microbatch")``) likewise, only when there are candidates with ``pp > 1``: under ``every_microbatch`` the
    split-backward pipelines are rejected (`plan.grad_sync_unrunnable`), and the regime wins only where it lets a
    faster layout fit (it is estimated on the candidates that do not fit under the default regimes only).
    `selective_acs` (workload ``selective_ac`` values, e.g. ``("auto", "op")``: every matmul output kept, or
    TorchTitan's per-op policy) likewise, only when there are candidates with ``ac: selective``: the per-op policy
    is estimated on the selective candidates that do not fit under the default regimes only (and could, their
    activations freed), and wins only where it lets a faster layout fit; it is scored with the first TP regime and
    gradient sync only: titan-run keeps no TP sequence shards under selective checkpointing, and a sync per
    micro-batch with it would cost the search a third more time for the few layouts that need both.
    ``split_best`` / ``tp_best`` / ``sync_best`` / ``policy_best`` give each value's best step (over the others).
    """
    if rank_by not in RANK_BY:
        raise PlanningError(f"rank_by must be one of {', '.join(RANK_BY)}, got {rank_by!r}")
    splits = tuple(dict.fromkeys(pp_splits or (workload.pp_split,)))
    tpas = tuple(dict.fromkeys(tp_activations or (workload.tp_activations,)))
    syncs = tuple(dict.fromkeys(grad_syncs or (workload.pp_grad_sync,)))
    pols = tuple(dict.fromkeys(selective_acs or (workload.selective_ac,)))
    kw = dict(world_size=world_size, gpus_per_node=gpus_per_node, coeffs=coeffs, memory_margin=memory_margin,
              rank_by=rank_by)
    first = _plan_one(space, model, hw, dataclasses.replace(workload, pp_split=splits[0], tp_activations=tpas[0],
                                                            pp_grad_sync=syncs[0], selective_ac=pols[0]), **kw)
    splits = splits if (first.table.pp > 1).any() else splits[:1]
    tpas = tpas if (first.table.tp > 1).any() else tpas[:1]
    syncs = syncs if ((first.table.pp > 1) & (first.table.fsdp_size > 1)).any() else syncs[:1]
    pols = pols if first.table.is_ac("selective").any() else pols[:1]
    if len(splits) == 1 and len(tpas) == 1 and len(syncs) == 1 and len(pols) == 1:
        return first
    results, base = [], {}
    for c in pols:
        for g in syncs:
            for a in tpas:
                if c != pols[0] and (a != tpas[0] or g != syncs[0]):
                    continue    # the per-op policy with the default TP regime and sync only (see the docstring)
                for s in splits:
                    wl = dataclasses.replace(workload, pp_split=s, tp_activations=a, pp_grad_sync=g, selective_ac=c)
                    r = (first if (s, a, g, c) == (splits[0], tpas[0], syncs[0], pols[0])
                         else _plan_one(space, model, hw, wl, reuse=base.get(s), **kw))
                    if (r.workload.tp_keeps_gathered and r.workload.pp_defers_grad_sync
                            and r.workload.selective_ac == pols[0]):
                        base[s] = r       # the default regimes of this split: what the others share
                    results.append(r)
    return _choose(results, splits, tpas, syncs, pols)


def _choose(results: list[PlanningResult], splits, tpas, syncs, pols) -> PlanningResult:
    """Of `plan_candidates`' results (one per searched workload), the one whose best candidate is fastest (else
    the smallest peak), with each searched value's best step (``split_best`` ... ``policy_best``)."""
    def best_step(r: PlanningResult) -> float | None:
        return float(r.step_time()[r.order[0]]) if r.n_feasible else None

    def key(r: PlanningResult) -> tuple:
        # the TP regime's rank breaks ties of the step before memory does: keeping shards (the second regime) is
        # taken only where it makes a layout fit that is faster, not for the memory it saves at the same speed
        rank = (pols.index(r.workload.selective_ac), syncs.index(r.workload.pp_grad_sync),
                tpas.index(r.workload.tp_activations))
        if not r.n_feasible:
            return (1, float(r.peak_memory().min(initial=np.inf)), rank, 0.0)
        i = r.order[0]
        return (0, float(r.step_time()[i]), rank, float(r.peak_memory()[i]))

    chosen = min(results, key=key)        # min keeps the first of equal keys

    def best_of(key_name: str, values) -> dict:
        out = {}
        for v in values:
            steps = [b for r in results if getattr(r.workload, key_name) == v and (b := best_step(r)) is not None]
            out[v] = min(steps) if steps else None
        return out
    chosen.split_best = best_of("pp_split", splits) if len(splits) > 1 else {}
    chosen.tp_best = best_of("tp_activations", tpas) if len(tpas) > 1 else {}
    chosen.sync_best = best_of("pp_grad_sync", syncs) if len(syncs) > 1 else {}
    chosen.policy_best = best_of("selective_ac", pols) if len(pols) > 1 else {}
    return chosen


# what a search ranks by and draws its front from (`_plan_one`), of every candidate
_RANKING_FIGURES = ("step_time_s", "step_time_p90_s", "peak_memory_bytes", "peak_memory_p90_bytes", "tokens_per_s")


def _put(base: np.ndarray, idx: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = base.copy()
    out[idx] = values
    return out


class _Overlaid:
    """`_overlay(base, idx, sub)` built on first use: a regime's result that the search does not choose is never
    read beyond what it ranks by (`_RANKING_FIGURES`, taken separately)."""

    __slots__ = ("_parts", "_est")

    def __init__(self, base: Estimates, idx: np.ndarray, sub: Estimates):
        self._parts, self._est = (base, idx, sub), None

    def _built(self) -> Estimates:
        if self._est is None:
            self._est, self._parts = _overlay(*self._parts), None
        return self._est

    def __getattr__(self, name: str):
        if name.startswith("_"):       # an unset slot (copy, pickle): not a field of the estimates
            raise AttributeError(name)
        return getattr(self._built(), name)

    def __len__(self) -> int:
        return len(self._built())


def _overlay(base: Estimates, idx: np.ndarray, sub: Estimates) -> Estimates:
    """`base` with the candidates `idx` replaced by `sub` (their estimates, in that order)."""
    out = {}
    for f in dataclasses.fields(Estimates):
        v, w = getattr(base, f.name), getattr(sub, f.name)
        if isinstance(v, np.ndarray):
            v = _put(v, idx, w)
        elif isinstance(v, dict):        # (`uncovered` holds only the reasons some candidate has)
            n = len(base.step_time_s)
            v = {k: (v[k].copy() if k in v else np.zeros(n, dtype=w[k].dtype)) for k in {**v, **w}}
            for k, a in v.items():
                a[idx] = w[k] if k in w else 0
        out[f.name] = v
    return Estimates(**out)


def _plan_one(space: SearchSpace, model: ModelSpec, hw: HardwareSpec, workload: Workload, *,
              world_size: int, gpus_per_node: int | None, coeffs: Coefficients | None,
              memory_margin: float, rank_by: str, reuse: PlanningResult | None = None) -> PlanningResult:
    """`plan_candidates` for the workload's own pipeline split.  `reuse`: the result of the same split with the
    default regimes (gathered TP inputs, the deferred gradient sync, every matmul output kept), when `workload` keeps
    TP shards, syncs every micro-batch or takes the per-op selective policy: its enumeration is this one's, and only
    the candidates the regimes change (tp > 1, an FSDP-sharded pipeline, or selective checkpointing; runnable under
    them) are estimated again."""
    target = C.Target.of(model, world_size=world_size, seq_len=workload.seq_len,
                         global_batch=workload.global_batch,
                         gpus_per_node=gpus_per_node or hw.gpus_per_node,
                         float8_supported=hw.supports_float8 and hw.device != "cpu",
                         pp_weighted=workload.pp_weighted)
    shards = workload.state_layout == "fsdp2" and not workload.tp_keeps_gathered   # titan-run keeps TP shards
    every = workload.state_layout == "fsdp2" and not workload.pp_defers_grad_sync   # a sync per micro-batch
    op = workload.state_layout == "fsdp2" and workload.selective_ac == "op"       # TorchTitan's selective policy
    reuse = reuse if (shards or every or op) and reuse is not None and reuse.enumeration is not None else None
    en: Enumeration = reuse.enumeration if reuse else enumerate_plans(space, target)
    if gpus_per_node and gpus_per_node != hw.gpus_per_node:   # the stated topology decides the links
        hw = dataclasses.replace(hw, gpus_per_node=int(gpus_per_node))
    cannot = tp_shards_unrunnable(en.table) if shards else np.zeros(len(en.table), dtype=bool)
    unsynced = grad_sync_unrunnable(en.table, workload.pp_grad_sync)
    p90 = rank_by == "p90"
    limit = capacity_bytes(hw) * (1.0 - memory_margin)      # time is estimated only where memory fits this
    if reuse:       # what neither regime changes keeps its estimate; what cannot run is rejected below
        t = en.table
        changed = np.zeros(len(t), dtype=bool)
        base_fits = np.zeros(len(t), dtype=bool)
        base_fits[reuse.order] = True
        if shards:
            changed |= (t.tp > 1) & ~cannot
        if every:
            changed |= (t.pp > 1) & (t.fsdp_size > 1) & ~unsynced & ~cannot
            # a sync per micro-batch is searched for the memory it saves: only what does not fit under the
            # default regimes is estimated again (the rest keeps the default's figures, which rank first on a tie)
            # ... and of those, what could fit: the sync saves at most the rank's gradients, gathered parameters and
            # the overhead on them, so a candidate still over the limit without all of them cannot fit
            m = reuse.est.memory
            floor = reuse.est.peak_memory_bytes - m["grads"] - m["fsdp_buffers"] - m["overhead"]
            changed &= ~base_fits & (floor <= limit)
        if op:      # searched for the memory it saves, as the sync: the selective candidates that do not fit, and
            # of those what could: the policy saves activations only (with the sync, its terms too)
            m = reuse.est.memory
            floor = reuse.est.peak_memory_bytes - m["activations"] - m["overhead"] - (
                m["grads"] + m["fsdp_buffers"] if every else 0.0)
            changed |= (t.is_ac("selective") & ~cannot & ~base_fits
                        & (floor <= limit))
        changed = np.flatnonzero(changed)
        sub = estimate(take(en.table, changed), model, hw, workload, coeffs, time_within_bytes=limit, p90=p90)
        est = _Overlaid(reuse.est, changed, sub)     # the whole of it is built only if this result is read
        figures = {k: _put(getattr(reuse.est, k), changed, getattr(sub, k)) for k in _RANKING_FIGURES}
    else:
        est = estimate(en.table, model, hw, workload, coeffs, time_within_bytes=limit, p90=p90)
        figures = {k: getattr(est, k) for k in _RANKING_FIGURES}
    step, peak = ((figures["step_time_p90_s"], figures["peak_memory_p90_bytes"]) if p90
                  else (figures["step_time_s"], figures["peak_memory_bytes"]))
    rejected = list(en.rejected)
    # what titan-run refuses under this workload and backend (executor/config.py's one-line refusals), each
    # candidate counted under the first reason
    refused = np.zeros(len(en.table), dtype=bool)
    for reason, mask in ((C.R_TP_SHARDS, cannot),
                         (C.R_GRAD_SYNC, unsynced),
                         (C.R_BACKEND, backend_unrunnable(en.table))):
        new = mask & ~refused
        if new.any():
            rejected.append(Rejection(reason, int(new.sum()), "candidates"))
        refused |= new
    fits = (peak <= limit) & ~refused
    n_oom = int(((peak > limit) & ~refused).sum())
    if n_oom:
        rejected.append(Rejection(C.R_MEMORY + (" (p90 bound)" if p90 else ""), n_oom, "candidates"))
    idx = np.flatnonzero(fits)
    # best first: shortest step (the global batch is fixed, so = most tokens/s), then least memory
    order = idx[np.lexsort((peak[idx], step[idx]))]
    return PlanningResult(table=en.table, est=est, order=order,
                          pareto=_front(figures["peak_memory_bytes"], figures["tokens_per_s"], idx),
                          rejected=rejected, n_layouts=en.n_layouts, model=model, hw=hw, workload=workload,
                          coeffs=coeffs, rank_by=rank_by, enumeration=en, ranked=(step, peak))


def smallest_fitting_world(space: SearchSpace, model: ModelSpec, hw: HardwareSpec, workload: Workload, *,
                           world_size: int, gpus_per_node: int | None = None, coeffs: Coefficients | None = None,
                           memory_margin: float = 0.0, rank_by: str = "time",
                           max_world: int = MAX_WORLD_SIZE,
                           pp_splits: tuple[str, ...] | None = None,
                           tp_activations: tuple[str, ...] | None = None,
                           grad_syncs: tuple[str, ...] | None = None,
                           selective_acs: tuple[str, ...] | None = None) -> tuple[int, PlanningResult] | None:
    """When nothing fits on `world_size` devices: the smallest power-of-two multiple of it (up to `max_world`)
    on which some layout of `space` fits, with its planning result, or None.  The global batch stays the
    question's; multiples of the world keep the node shape."""
    k = 2 * world_size
    while k <= max_world:
        res = plan_candidates(space, model, hw, workload, world_size=k, gpus_per_node=gpus_per_node, coeffs=coeffs,
                              memory_margin=memory_margin, rank_by=rank_by, pp_splits=pp_splits,
                              tp_activations=tp_activations, grad_syncs=grad_syncs, selective_acs=selective_acs)
        if res.n_feasible:
            return k, res
        k *= 2
    return None


def pareto_front(est: Estimates, idx: np.ndarray) -> np.ndarray:
    """Candidates in `idx` that no other has both more tokens/s and less peak memory; by memory."""
    return _front(est.peak_memory_bytes, est.tokens_per_s, idx)


def _front(peak: np.ndarray, tokens_per_s: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """`pareto_front` of the candidates' peak memory and tokens/s."""
    if not len(idx):
        return idx
    mem, tps = peak[idx], tokens_per_s[idx]
    by_mem = np.lexsort((-tps, mem))              # memory ascending, then tokens/s descending
    best_so_far = np.maximum.accumulate(tps[by_mem])
    prev_best = np.concatenate(([-np.inf], best_so_far[:-1]))
    keep = tps[by_mem] > prev_best
    return idx[by_mem[keep]]
