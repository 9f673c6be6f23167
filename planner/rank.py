"""Score every candidate, drop the infeasible ones (with the reason), rank, Pareto front."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from cost_models.coefficients import Coefficients
from cost_models.estimate import Estimates, estimate
from cost_models.specs import HardwareSpec, ModelSpec
from cost_models.workload import Workload
from search_spaces import constraints as C
from search_spaces.enumerate import Enumeration, Rejection, enumerate_plans
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

    def step_time(self) -> np.ndarray:
        """The step time the ranking uses (seconds per step, every candidate)."""
        return self.est.step_time_p90_s if self.rank_by == "p90" else self.est.step_time_s

    def peak_memory(self) -> np.ndarray:
        """The peak memory feasibility is judged by (bytes per device, every candidate)."""
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
                    pp_splits: tuple[str, ...] | None = None) -> PlanningResult:
    """Enumerate and score everything; feasible = legal and peak memory within capacity*(1-margin).

    ``rank_by="p90"`` ranks by the conservative step time (`Estimates.step_time_p90_s`) and judges
    feasibility by the conservative peak memory (`Estimates.peak_memory_p90_bytes`).

    `pp_splits` (workload ``pp_split`` values; default: the workload's own) are the pipeline splits to search:
    each is scored as a workload of its own and the result is the one whose best candidate has the shortest step
    (then the least memory; the first split on a tie).  A split changes nothing without a pipeline, so the
    others are scored only when the first has candidates with ``pp > 1``.
    """
    if rank_by not in RANK_BY:
        raise PlanningError(f"rank_by must be one of {', '.join(RANK_BY)}, got {rank_by!r}")
    splits = tuple(dict.fromkeys(pp_splits or (workload.pp_split,)))
    kw = dict(world_size=world_size, gpus_per_node=gpus_per_node, coeffs=coeffs, memory_margin=memory_margin,
              rank_by=rank_by)
    first = _plan_one(space, model, hw, dataclasses.replace(workload, pp_split=splits[0]), **kw)
    if len(splits) == 1 or not (first.table.pp > 1).any():
        return first
    results = [first] + [_plan_one(space, model, hw, dataclasses.replace(workload, pp_split=s), **kw)
                         for s in splits[1:]]

    def best_step(r: PlanningResult) -> float | None:
        return float(r.step_time()[r.order[0]]) if r.n_feasible else None

    def key(r: PlanningResult) -> tuple:
        if not r.n_feasible:
            return (1, float(r.peak_memory().min(initial=np.inf)), 0.0)
        i = r.order[0]
        return (0, float(r.step_time()[i]), float(r.peak_memory()[i]))

    chosen = min(results, key=key)        # min keeps the first of equal keys
    chosen.split_best = {r.workload.pp_split: best_step(r) for r in results}
    return chosen


def _plan_one(space: SearchSpace, model: ModelSpec, hw: HardwareSpec, workload: Workload, *,
              world_size: int, gpus_per_node: int | None, coeffs: Coefficients | None,
              memory_margin: float, rank_by: str) -> PlanningResult:
    """`plan_candidates` for the workload's own pipeline split."""
    target = C.Target.of(model, world_size=world_size, seq_len=workload.seq_len,
                         global_batch=workload.global_batch,
                         gpus_per_node=gpus_per_node or hw.gpus_per_node,
                         float8_supported=hw.supports_float8 and hw.device != "cpu",
                         pp_weighted=workload.pp_weighted)
    en: Enumeration = enumerate_plans(space, target)
    if gpus_per_node and gpus_per_node != hw.gpus_per_node:   # the stated topology decides the links
        hw = dataclasses.replace(hw, gpus_per_node=int(gpus_per_node))
    est = estimate(en.table, model, hw, workload, coeffs)
    p90 = rank_by == "p90"
    step, peak = (est.step_time_p90_s, est.peak_memory_p90_bytes) if p90 else (est.step_time_s, est.peak_memory_bytes)
    limit = est.capacity_bytes * (1.0 - memory_margin)
    fits = peak <= limit
    rejected = list(en.rejected)
    n_oom = int((~fits).sum())
    if n_oom:
        rejected.append(Rejection(C.R_MEMORY + (" (p90 bound)" if p90 else ""), n_oom, "candidates"))
    idx = np.flatnonzero(fits)
    # best first: shortest step (the global batch is fixed, so = most tokens/s), then least memory
    order = idx[np.lexsort((peak[idx], step[idx]))]
    return PlanningResult(table=en.table, est=est, order=order, pareto=pareto_front(est, idx),
                          rejected=rejected, n_layouts=en.n_layouts, model=model, hw=hw, workload=workload,
                          coeffs=coeffs, rank_by=rank_by)


def smallest_fitting_world(space: SearchSpace, model: ModelSpec, hw: HardwareSpec, workload: Workload, *,
                           world_size: int, gpus_per_node: int | None = None, coeffs: Coefficients | None = None,
                           memory_margin: float = 0.0, rank_by: str = "time",
                           max_world: int = MAX_WORLD_SIZE,
                           pp_splits: tuple[str, ...] | None = None) -> tuple[int, PlanningResult] | None:
    """When nothing fits on `world_size` devices: the smallest power-of-two multiple of it (up to `max_world`)
    on which some layout of `space` fits, with its planning result, or None.  The global batch stays the
    question's; multiples of the world keep the node shape."""
    k = 2 * world_size
    while k <= max_world:
        res = plan_candidates(space, model, hw, workload, world_size=k, gpus_per_node=gpus_per_node, coeffs=coeffs,
                              memory_margin=memory_margin, rank_by=rank_by, pp_splits=pp_splits)
        if res.n_feasible:
            return k, res
        k *= 2
    return None


def pareto_front(est: Estimates, idx: np.ndarray) -> np.ndarray:
    """Candidates in `idx` that no other has both more tokens/s and less peak memory; by memory."""
    if not len(idx):
        return idx
    mem, tps = est.peak_memory_bytes[idx], est.tokens_per_s[idx]
    by_mem = np.lexsort((-tps, mem))              # memory ascending, then tokens/s descending
    best_so_far = np.maximum.accumulate(tps[by_mem])
    prev_best = np.concatenate(([-np.inf], best_so_far[:-1]))
    keep = tps[by_mem] > prev_best
    return idx[by_mem[keep]]
