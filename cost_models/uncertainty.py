"""Error bands of the predictions, and the regimes no validation data covers.

DESIGN.md, "Predictions carry their uncertainty": a predicted step time or peak memory is an
estimate with the band that validation gives it -- from the residuals of the terms that
dominate it -- and a pick that leans on something nothing has validated says so.

Band.  A prediction is a sum of terms, gathered into groups (step time: `TIME_GROUPS` over
`step_time.TIME_KEYS`; peak memory: `MEMORY_GROUPS` over `memory.MEMORY_KEYS`).  Group j has
a one-sided relative p90 error q_j (how much slower / larger than predicted a run is, at the
90th percentile).  For a candidate whose prediction has shares w_j = term_j / total,

    p90 = total * (1 + sum_j w_j q_j)

-- the term errors add linearly (fully correlated), the conservative bound of a sum (with
independent errors the root-sum-square is smaller).

The q_j are data, ``presets/uncertainty.yaml``, written by ``bench/derive_uncertainty.py``
from the published runs (``../shared/reference/published_runs.yaml``, mapped by
``bench/validate_reference.py``): each row's residual r_i = measured / predicted - 1 is
explained by its shares, |r_i| ~ sum_j w_ij a_j (non-negative least squares, Lawson & Hanson
1974, "Solving Least Squares Problems", ch. 23), and one factor c scales the fit so that a
fraction ``coverage`` of the rows lie at or under their band, r_i <= c sum_j w_ij a_j; then
q_j = c a_j.  The file records how it was derived (rows, coverage, model commit).

Uncovered.  A term group that fewer than ``min_rows`` validation rows lean on (share >=
``min_share``) gets the largest q of the covered groups, and a candidate that leans on it
says so.  Likewise every validation row is described by its `regimes` (pipeline schedule on a
dense or MoE model, activation checkpointing by model size, float8, context / expert parallel
within or across nodes, state layout, hardware); a candidate in a regime no row has, or on
more devices than the largest validated run, is flagged ("DualPipeV on a dense model", "no
activation checkpointing above 100B parameters", ...).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from search_spaces.plan import SCHEDULES
from search_spaces.yaml_file import read_yaml

from .flops import param_counts
from .moe_traffic import a2a_overlap_runs, node_limited, sends_once_per_node
from .specs import SpecError

UNCERTAINTY_FILE = Path(__file__).parent / "presets" / "uncertainty.yaml"

# term groups: the validation residuals are attributed to these (names of the yaml keys)
TIME_GROUPS = {"compute": ("compute", "other"), "tp_comm": ("tp_comm",), "cp_comm": ("cp_comm",),
               "ep_comm": ("ep_comm",), "dp_comm": ("dp_comm",), "pp": ("pp_bubble", "pp_p2p")}
MEMORY_GROUPS = {"states": ("params", "grads", "optimizer"), "activations": ("activations", "logits"),
                 "buffers": ("fsdp_buffers", "overhead")}
LABELS = {"compute": "compute", "tp_comm": "tensor-parallel communication", "cp_comm": "context-parallel "
          "communication", "ep_comm": "expert-parallel all-to-all", "dp_comm": "data-parallel communication",
          "pp": "pipeline bubble and transfers", "states": "parameter/gradient/optimizer memory",
          "activations": "activation memory", "buffers": "buffer and overhead memory"}


def group_shares(parts: dict[str, np.ndarray], groups: dict[str, tuple[str, ...]]) -> dict[str, np.ndarray]:
    """Share of the total of each group of terms (arrays; missing terms count 0)."""
    total = sum(np.asarray(v, dtype=np.float64) for v in parts.values())
    total = np.maximum(total, 1e-300)
    return {g: sum((np.asarray(parts[k], dtype=np.float64) for k in keys if k in parts), np.zeros_like(total))
            / total for g, keys in groups.items()}


def _size_phrase(n_params: float) -> str:
    return "under 10B parameters" if n_params < 10e9 else "at 10-100B parameters" if n_params <= 100e9 \
        else "above 100B parameters"


def regimes(table, model, hw, workload) -> dict[str, np.ndarray]:
    """Regime name -> [n] bool: which candidates are in it (every candidate is in several)."""
    n = len(table)
    kind = "an MoE" if model.is_moe else "a dense"
    size = _size_phrase(param_counts(model)["total"])
    gpn = hw.gpus_per_node
    out: dict[str, np.ndarray] = {}

    def add(name, mask):
        mask = np.asarray(mask, dtype=bool) & np.ones(n, dtype=bool)
        if mask.any():
            out[name] = mask
    for i, s in enumerate(SCHEDULES):
        add(f"{s} on {kind} model", (table.pp > 1) & (table.schedule == i))
    add(f"no pipeline, {kind} model", table.pp == 1)
    add(f"no activation checkpointing {size}", table.is_ac("none"))
    add(f"selective activation checkpointing {size}", table.is_ac("selective"))
    add(f"full activation checkpointing {size}", table.is_ac("full"))
    add("float8 linears", table.float8)
    add("context parallel within a node", (table.cp > 1) & (table.cp * table.tp <= gpn))
    add("context parallel across nodes", (table.cp > 1) & (table.cp * table.tp > gpn))
    ep_span = table.ep * (table.tp if workload.ep_stride_tp else 1)      # the ranks one EP group spans
    add("expert parallel within a node", (table.ep > 1) & (ep_span <= gpn))
    add("expert parallel across nodes", (table.ep > 1) & (ep_span > gpn))
    across = (table.ep > 1) & (ep_span > gpn)
    if node_limited(model):
        add("node-limited expert routing across nodes", across)
    if model.is_moe:
        how = "once per remote node (DeepEP / HybridEP)" if sends_once_per_node(model, workload) \
            else "of every routed copy"
        add("MoE dispatch across nodes " + how, across)
    if workload.selective_ac == "modules":
        add("selective recompute by Megatron submodules", table.is_ac("selective"))
    add("tensor parallel keeping " + ("gathered inputs" if workload.tp_keeps_gathered else "sequence shards"),
        table.tp > 1)
    tp_overlap = "full" if workload.tp_overlap_auto(hw) else workload.tp_comm_overlap
    if tp_overlap in ("full", "async"):
        add("tensor-parallel collectives " + ("under their matmuls (TP overlap)" if tp_overlap == "full"
                                              else "fused by async TP (micro_pipeline_tp)"), table.tp > 1)
    if model.is_moe:
        if workload.ep_a2a_overlap != "none":
            add("MoE all-to-alls under the other micro-batch (combined 1F1B)",
                a2a_overlap_runs(table, workload))
        add("MoE router weights " + ("at the combine" if workload.moe_keeps_expert_outputs
                                     else "in the experts' activation"), table.ep >= 1)
    # the pipeline memory facts only where they depart from the layout's own runtime (the default's rows
    # are the layout's)
    piped = table.pp > 1
    if workload.pp_keeps_sent != (workload.state_layout == "fsdp2"):
        add("pipeline " + ("keeping" if workload.pp_keeps_sent else "freeing") + " the tensors it has sent, "
            f"{workload.state_layout} state layout", piped)
    if not workload.pp_defers_grad_sync:
        add("FSDP gradients reduce-scattered every pipeline micro-batch", piped & (table.n_microbatches > 1))
    add(f"{workload.state_layout} state layout", np.ones(n, dtype=bool))
    add(f"hardware {hw.name}", np.ones(n, dtype=bool))
    return out


class UncertaintyError(SpecError):
    """An uncertainty file that cannot be used."""


@dataclass(frozen=True)
class Spreads:
    """The derived term spreads (see the module docstring) and what the validation covers."""

    time: dict[str, float]           # group -> q (relative p90 error of that term)
    memory: dict[str, float]
    time_rows: dict[str, int]        # group -> validation rows leaning on it (share >= min_share)
    memory_rows: dict[str, int]
    regimes: frozenset[str]          # regimes at least one validation row is in
    max_world: int                   # largest validated run, devices
    min_share: float
    min_rows: int

    @classmethod
    def from_dict(cls, d, where: str = "uncertainty") -> "Spreads":
        try:
            t, m = d["time"], d["memory"]
            return cls(time={g: float(t[g]["p90_relative_error"]) for g in TIME_GROUPS},
                       memory={g: float(m[g]["p90_relative_error"]) for g in MEMORY_GROUPS},
                       time_rows={g: int(t[g]["rows"]) for g in TIME_GROUPS},
                       memory_rows={g: int(m[g]["rows"]) for g in MEMORY_GROUPS},
                       regimes=frozenset(str(x) for x in d["covered_regimes"]),
                       max_world=int(d["max_world"]), min_share=float(d["min_share"]), min_rows=int(d["min_rows"]))
        except (KeyError, TypeError, ValueError) as e:
            raise UncertaintyError(f"{where}: missing or malformed key {e} (written by bench/derive_uncertainty.py)") \
                from None

    def q(self, kind: str) -> dict[str, float]:
        """q per group, uncovered groups at the largest covered q (the fallback)."""
        q, rows = (self.time, self.time_rows) if kind == "time" else (self.memory, self.memory_rows)
        covered = [q[g] for g in q if rows[g] >= self.min_rows]
        fallback = max(covered) if covered else 1.0
        return {g: (q[g] if rows[g] >= self.min_rows else max(q[g], fallback)) for g in q}


@functools.lru_cache(maxsize=4)
def load_spreads(path: str | None = None) -> Spreads:
    p = Path(path) if path else UNCERTAINTY_FILE
    return Spreads.from_dict(read_yaml(p, error=UncertaintyError, what="uncertainty file"), str(p))


@dataclass(frozen=True)
class Bands:
    step_time_p90_s: np.ndarray          # [n]
    peak_memory_p90_bytes: np.ndarray    # [n]
    uncovered: dict[str, np.ndarray]     # reason -> [n] bool: the candidate leans on an unvalidated term/regime


def bands(table, model, hw, workload, time_parts, mem_parts, spreads: Spreads | None = None) -> Bands:
    """p90 step time and peak memory of every candidate, and what no validation covers (vectorized)."""
    sp = spreads or load_spreads()
    n = len(table)
    step = sum(np.asarray(v, dtype=np.float64) for v in time_parts.values()) + np.zeros(n)
    ws, wm = group_shares(time_parts, TIME_GROUPS), group_shares(mem_parts, MEMORY_GROUPS)
    qt = sp.q("time")
    step90 = step * (1.0 + sum(ws[g] * qt[g] for g in TIME_GROUPS))
    peak90 = peak_p90(mem_parts, sp, wm) + np.zeros(n)
    unc: dict[str, np.ndarray] = {}
    for kind, w, rows in (("time", ws, sp.time_rows), ("memory", wm, sp.memory_rows)):
        for g, share in w.items():
            if rows[g] < sp.min_rows:
                mask = share >= sp.min_share
                if mask.any():
                    unc[f"{LABELS[g]} (validated on {rows[g]} published run{'s' if rows[g] != 1 else ''})"] = mask
    for name, mask in regimes(table, model, hw, workload).items():
        if name not in sp.regimes:
            unc[name] = mask
    big = table.world_size > sp.max_world
    if big.any():
        unc[f"more devices than the largest validated run ({sp.max_world})"] = big
    return Bands(step_time_p90_s=step90, peak_memory_p90_bytes=peak90, uncovered=unc)


def peak_p90(mem_parts, spreads: Spreads | None = None, shares: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The p90 peak memory of every candidate (`bands`' ``peak_memory_p90_bytes``): it needs the memory terms
    only, so a search can judge the conservative fit before it estimates any step time."""
    sp = spreads or load_spreads()
    wm = shares if shares is not None else group_shares(mem_parts, MEMORY_GROUPS)
    qm = sp.q("memory")
    peak = sum(np.asarray(v, dtype=np.float64) for v in mem_parts.values())
    return peak * (1.0 + sum(wm[g] * qm[g] for g in MEMORY_GROUPS))


def uncovered_at(uncovered: dict[str, np.ndarray], i: int) -> list[str]:
    """The reasons that apply to candidate i, in a stable order."""
    return [k for k, m in uncovered.items() if bool(m[i])]


__all__ = ["TIME_GROUPS", "MEMORY_GROUPS", "Spreads", "Bands", "bands", "peak_p90", "regimes", "group_shares", "load_spreads",
           "uncovered_at", "UncertaintyError"]
