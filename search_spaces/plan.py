"""`Plan`: one point of the search space (mesh degrees plus knobs).

The mesh is ``world = dp_replicate * dp_shard * pp * tp * cp``.  Expert
parallelism does not add a mesh axis of its own: as in TorchTitan and
Megatron-LM, the ``ep`` ranks are carved out of the ``dp_shard * cp`` ranks
(the ranks that hold different tokens), so ``ep`` must divide
``dp_shard * cp``.  Expert weights are sharded ``ep`` ways and FSDP-sharded
over the remaining ``dp_shard * cp / ep`` ranks; dense weights are
FSDP-sharded over all ``dp_shard * cp`` ranks.

``microbatch`` is the number of sequences one rank processes in one forward
pass; ``n_microbatches`` is how many such micro-batches each data-parallel
rank runs per optimizer step (pipeline micro-batches when ``pp > 1``,
gradient-accumulation steps otherwise), so that
``global_batch = dp_replicate * dp_shard * microbatch * n_microbatches``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass
from typing import Any, Mapping

from . import constraints as C
from .typed import INT_LIMIT, InputError, check_keys, show

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # exactly 2 stages per rank, V placement
AC_MODES = ("none", "selective", "full")
BACKENDS = ("spmd_types", "dtensor")

DEGREE_KEYS = ("dp_replicate", "dp_shard", "pp", "tp", "cp", "ep")
# the device mesh, outermost -> innermost (consecutive ranks share tp, then cp, ...); ep has no axis of
# its own: it is carved out of dp_shard x cp.  The cost model's link choice and the executor's mesh use this.
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
BATCH_KEYS = ("microbatch", "n_microbatches")

# re-exported for titan-run's callers: the micro-batch rules live with the other layout rules in constraints.py
min_microbatches = C.min_microbatches


class PlanError(InputError):
    """A plan (or a plan file) that is malformed or does not fit its world."""


class PlanFacts:
    """Facts derived from a layout, as TorchTitan's ParallelDims has them.

    Written once for both one `Plan` (plain ints) and a `CandidateTable` (numpy columns, one
    entry per candidate): the subclass provides the fields as attributes and `is_schedule`.
    """

    __slots__ = ()

    @property
    def world_size(self):
        return self.dp_replicate * self.dp_shard * self.pp * self.tp * self.cp

    @property
    def dp(self):
        """Ranks holding different sequences (the batch is split this many ways)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self):
        """Ranks holding different tokens: the loss and gradient-norm reductions span them."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def fsdp_size(self):
        """Ranks one dense parameter is FSDP-sharded over (dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def expert_fsdp_size(self):
        """Ranks one expert's weights are FSDP-sharded over: dp_shard*cp/ep (the expert divide factor); 1 where
        ep folds over the TP ranks too (ep > dp_shard*cp: a what-if of Megatron's layout, `constraints.EP_FOLD`)."""
        return (self.dp_shard * self.cp // self.ep) + (self.dp_shard * self.cp < self.ep)

    @property
    def n_stages(self):
        return self.pp * self.stages_per_rank

    @property
    def seq_divisor(self):
        """The sequence length must divide by this: CP's load-balanced split cuts the sequence in
        2*cp chunks (head-tail pairing), and sequence parallel splits each rank's part tp ways;
        so 2*cp*tp when cp > 1, else tp (written without a branch so that it also works on columns)."""
        return self.tp * (1 + (self.cp > 1) * (2 * self.cp - 1))

    @property
    def is_v_schedule(self):
        """Two stages per rank in V placement (ZBVZeroBubble, DualPipeV)."""
        return self.is_schedule("ZBVZeroBubble") | self.is_schedule("DualPipeV")

    @property
    def is_multi_stage(self):
        """More than one pipeline stage per rank (Interleaved1F1B and the V schedules)."""
        return self.is_schedule("Interleaved1F1B") | self.is_v_schedule

    def global_batch(self):
        """Sequences per optimizer step."""
        return self.dp * self.microbatch * self.n_microbatches

    def is_schedule(self, name: str):
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class Plan(PlanFacts):
    """One layout.  ``runnable=False`` (not a field) skips the rules that only titan-run's
    pipeline runtime imposes (micro-batch counts, `constraints.RUNTIME_RULES`), for what-if
    estimates of layouts other frameworks ran; `constraints.check_plan` still reports them."""

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    microbatch: int = 1
    n_microbatches: int = 1
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    ac: str = "none"
    reshard_after_forward: bool = True
    compile: bool = False
    float8: bool = False
    backend: str = "spmd_types"
    runnable: InitVar[bool] = True

    def __post_init__(self, runnable: bool = True) -> None:
        self.validate(runnable=runnable)

    def is_schedule(self, name: str) -> bool:
        return self.schedule == name

    def is_ac(self, name: str) -> bool:
        return self.ac == name

    # -- validation ----------------------------------------------------------
    def validate(self, *, runnable: bool = True) -> None:
        """Field types and choices, then the rules a plan must meet whatever it is run on
        (`constraints.PLAN_RULES`), then, when `runnable`, titan-run's runtime rules."""
        for key in DEGREE_KEYS + BATCH_KEYS + ("stages_per_rank",):
            _check_positive_int(key, getattr(self, key))
        for key in ("reshard_after_forward", "compile", "float8"):
            v = getattr(self, key)
            if not isinstance(v, bool):
                raise PlanError(f"plan key '{key}' must be true or false, got {v!r}")
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("ac", self.ac, AC_MODES)
        _check_choice("backend", self.backend, BACKENDS)
        for rule in C.PLAN_RULES + (C.LAYOUT_LIMITS + C.RUNTIME_RULES if runnable else ()):
            if not rule.ok(self, None):
                raise PlanError(rule.plan_message(self))

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise PlanError(
                f"plan degrees dp_replicate*dp_shard*pp*tp*cp = {self.dp_replicate}*{self.dp_shard}*"
                f"{self.pp}*{self.tp}*{self.cp} = {self.world_size}, but the world size is {world_size}")

    # -- completing a partial plan ----------------------------------------------
    @classmethod
    def complete(cls, partial: Mapping[str, Any], *, world_size: int, global_batch: int | None = None,
                 fewest_microbatches: bool = False, runnable: bool = True, where: str = "plan") -> "Plan":
        """The one way to complete a partial plan for `world_size` ranks and `global_batch` sequences.

        * unknown keys are refused (as in `from_dict`); degree values are checked before use;
        * ``dp_replicate, pp, tp, cp, ep`` default to 1 and ``dp_shard`` takes what remains of the world;
        * ``schedule`` defaults to 1F1B and ``stages_per_rank`` to 2 for a multi-stage schedule, else 1;
        * the batch split: a given ``microbatch`` and ``n_microbatches`` are kept; when one is given
          the other is derived from `global_batch`; when neither is, ``microbatch`` is 1 and
          ``n_microbatches`` derived, or with `fewest_microbatches` ``n_microbatches`` is the fewest the
          schedule accepts (titan-run's default layout) and ``microbatch`` derived.  Without a
          `global_batch` (or a malformed one) nothing is derived.
        """
        d = dict(_checked_mapping(partial, where))
        for key in DEGREE_KEYS + BATCH_KEYS + ("stages_per_rank",):
            if key in d:
                _check_positive_int(key, d[key])
        for key in ("dp_replicate", "pp", "tp", "cp", "ep"):
            d.setdefault(key, 1)
        d.setdefault("schedule", "1F1B")
        _check_choice("schedule", d["schedule"], SCHEDULES)
        d.setdefault("stages_per_rank", 2 if d["schedule"] in MULTI_STAGE_SCHEDULES else 1)
        if "dp_shard" not in d:
            fixed = d["dp_replicate"] * d["pp"] * d["tp"] * d["cp"]
            if world_size % fixed:
                raise PlanError(f"the given degrees dp_replicate*pp*tp*cp = {d['dp_replicate']}*{d['pp']}*"
                                f"{d['tp']}*{d['cp']} = {fixed} do not divide the world size {world_size}")
            d["dp_shard"] = world_size // fixed
        gb_ok = isinstance(global_batch, int) and not isinstance(global_batch, bool) and global_batch > 0
        if gb_ok and not ("microbatch" in d and "n_microbatches" in d):
            dp = d["dp_replicate"] * d["dp_shard"]
            if "microbatch" not in d and ("n_microbatches" in d or fewest_microbatches):
                d.setdefault("n_microbatches", min_microbatches(d["schedule"], d["pp"]))
                per, given = dp * d["n_microbatches"], f"dp*n_microbatches = {dp}*{d['n_microbatches']}"
                derived = "microbatch"
            else:
                d.setdefault("microbatch", 1)
                per, given = dp * d["microbatch"], f"dp*microbatch = {dp}*{d['microbatch']}"
                derived = "n_microbatches"
            if global_batch % per:
                raise PlanError(f"global batch {global_batch} sequences is not divisible by {given}")
            d[derived] = global_batch // per
        elif fewest_microbatches and "n_microbatches" not in d:
            d["n_microbatches"] = min_microbatches(d["schedule"], d["pp"])
        return cls(**d, runnable=runnable)

    # -- wire format ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "plan", runnable: bool = True) -> "Plan":
        return cls(**_checked_mapping(d, where), runnable=runnable)

    # -- the one printer ------------------------------------------------------
    def layout_str(self) -> str:
        """Degrees, e.g. ``rep2·fsdp64·pp16·tp8``."""
        parts = [f"rep{self.dp_replicate}"] if self.dp_replicate > 1 else []
        parts.append(f"fsdp{self.dp_shard}")
        parts += [f"{k}{getattr(self, k)}" for k in ("pp", "tp", "cp", "ep") if getattr(self, k) > 1]
        return "·".join(parts)

    def knobs_str(self) -> str:
        """Everything else, e.g. ``mb1x16 Interleaved1F1B/v2 ac:full compile``."""
        s = f"mb{self.microbatch}x{self.n_microbatches}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f"/v{self.stages_per_rank}" if self.stages_per_rank > 1 else "")
        s += f" ac:{self.ac}"
        if not self.reshard_after_forward:
            s += " noreshard"
        if self.compile:
            s += " compile"
        if self.float8:
            s += " fp8"
        return s

    def describe(self) -> str:
        return f"{self.layout_str()} {self.knobs_str()}"


PLAN_KEYS = tuple(f.name for f in dataclasses.fields(Plan))


def _checked_mapping(d: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise PlanError(f"{where} must be a mapping of plan keys, got {type(d).__name__}")
    check_keys(d, sorted(PLAN_KEYS), where=where, error=PlanError)     # one line, with a "did you mean"
    return d


def _check_positive_int(key: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= INT_LIMIT:
        raise PlanError(f"plan key '{key}' must be a positive integer (at most 2**53), got {show(v)}")


def _check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise PlanError(f"plan key '{key}' must be one of {', '.join(allowed)}; got {value!r}")


def grad_sync_unrunnable(t, grad_sync: str) -> Any:
    """Candidates (a `Plan` or table columns) on which titan-run cannot reduce-scatter the gradients after
    every micro-batch (workload ``pp_grad_sync`` = `grad_sync`): a pipeline under a split-backward (V)
    schedule computes the weight gradients in a later pass, after the micro-batch's FSDP post-backward has
    run.  ``executor/config.py`` `grad_sync_error` refuses the same plans in one line
    (``constraints.R_GRAD_SYNC``)."""
    return (t.pp > 1) & t.is_v_schedule & (grad_sync == "every_microbatch")


def backend_unrunnable(t) -> Any:
    """Candidates (a `Plan` or table columns) titan-run refuses on their backend: on dtensor, float8 with tp > 1
    (`constraints.float8_tp_backend_error`) and a split-backward (V) pipeline whose data parallelism is
    replicas only (`constraints.replicate_split_backward_error`); ``constraints.R_BACKEND``."""
    backend = t.backend
    dtensor = backend == "dtensor" if isinstance(backend, str) else backend == BACKENDS.index("dtensor")
    v_replicas = (t.pp > 1) & t.is_v_schedule & (t.dp_replicate > 1) & (t.fsdp_size == 1)
    return dtensor & ((t.float8 & (t.tp > 1)) | v_replicas)


def tp_shards_unrunnable(t) -> Any:
    """Candidates (a `Plan` or table columns) with tp > 1 on which titan-run cannot keep the TP blocks'
    sequence shards (workload ``tp_activations: sharded``, ``executor/parallel/spmd_tensor_parallel.py``):
    only the spmd_types backend runs that regime, in eager blocks, with ac none or full (a selective policy
    saves the gathered tensors) and without float8 (float8 linears save their own, gathered, inputs).
    ``executor/config.py`` refuses the same cases in one line each (``constraints.R_TP_SHARDS``)."""
    backend = t.backend
    other = backend != "spmd_types" if isinstance(backend, str) else backend != BACKENDS.index("spmd_types")
    return (t.tp > 1) & (other | t.compile | t.float8 | t.is_ac("selective"))
