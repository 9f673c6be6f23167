"""The legality rules of a layout, each written once.

A rule is a predicate over the fields (and the derived facts, `plan.PlanFacts`) of a
layout and a `Target`, written with operators that work both on one `Plan` (ints) and on
columns of numpy arrays: `check_plan` applies every rule to one plan (for plans given by
hand, and as the reference the enumerator is tested against), `enumerate.py` applies the
same predicates to whole arrays, stage by stage.  Each rule has a short reason name used
in rejection counts.

Three groups:

* `PLAN_RULES`: what any plan must satisfy (the mesh can be built, the schedule's stage
  count); `Plan` refuses to exist otherwise; `LAYOUT_LIMITS` (titan-run's expert mesh) likewise, unless
  ``runnable=False``;
* `RUNTIME_RULES`: what torch.distributed.pipelining, hence titan-run, needs of the
  micro-batch count (`MICRO_RULES`) and of checkpointing under a split backward (`SPLIT_AC`); `Plan` refuses by default, ``Plan(..., runnable=False)`` lets a
  what-if estimate of another framework's layout through, and `check_plan` reports it;
* `TARGET_RULES`: the plan against the world, the model and the workload.

`TITAN_RUN_LIMITS` are the rules (the runtime's micro-batch rules among them) that only titan-run
imposes; ``check_plan(..., runnable=False)`` leaves them out and `titan_run_limits` lists them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# reason names, in the order the enumerator applies them
R_TP_SHAPE = "tp does not divide heads, kv heads or FFN width"
R_TP_NODE = "tp spans more than one node"
R_PP_RANKS = "more pipeline ranks than layers"
R_PP_LAYERS = "more pipeline stages than layers"
R_SEQ = "seq_len not divisible by 2*cp*tp (cp>1) or tp"
R_EP = "ep does not divide experts and dp_shard*cp"
R_BATCH = "global batch not divisible by dp*microbatch"
R_MICRO = "micro-batch count does not suit the pipeline schedule"
R_STAGES = "stages per rank do not suit the pipeline schedule"
R_SPLIT_AC = "selective checkpointing under a split-backward schedule"
R_FLOAT8 = "float8 not supported by the hardware"
R_WORLD = "degrees do not multiply to the world size"
R_MEMORY = "out of memory"
R_GRAD_SYNC = "pp_grad_sync every_microbatch under a split-backward schedule"
R_BACKEND = ("backend dtensor: float8 with tp > 1, or a split-backward pipeline with replicate-only data "
             "parallelism")
R_TP_SHARDS = ("tp_activations sharded: titan-run keeps TP sequence shards on backend spmd_types, eager, "
               "with ac none or full and no float8")


@dataclass(frozen=True, kw_only=True)
class Target:
    world_size: int
    gpus_per_node: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    moe_ffn_hidden: int = 0
    n_experts: int = 0
    seq_len: int
    global_batch: int             # sequences per step
    float8_supported: bool = True
    tie_embeddings: bool = False
    pp_extra_units: int = 0       # 2 under workload pp_split: weighted (the embedding and the head count as layers)

    @classmethod
    def of(cls, model: Any, *, world_size: int, seq_len: int, global_batch: int, gpus_per_node: int,
           float8_supported: bool = True, pp_weighted: bool = False) -> "Target":
        """Build from any object with the `ModelSpec` attributes (`pp_weighted`: workload ``pp_split: weighted``)."""
        return cls(world_size=world_size, gpus_per_node=gpus_per_node, n_layers=model.n_layers,
                   n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, ffn_hidden=model.ffn_hidden,
                   moe_ffn_hidden=getattr(model, "moe_ffn_hidden", 0) or 0,
                   n_experts=getattr(model, "n_experts", 0) or 0, seq_len=seq_len,
                   global_batch=global_batch, float8_supported=float8_supported,
                   tie_embeddings=bool(getattr(model, "tie_embeddings", False)),
                   pp_extra_units=2 if pp_weighted else 0)


@dataclass(frozen=True)
class Rule:
    reason: str
    ok: Callable[[Any, Target | None], Any]        # (layout or columns, target) -> bool or bool array
    message: Callable[[Any, Target | None], str]   # for one plan that breaks it

    def plan_message(self, plan: Any) -> str:
        return self.message(plan, None)


# --------------------------------------------------------------------------- micro-batch counts
def min_microbatches_of(pp, dualpipev):
    """Fewest micro-batches a schedule accepts with `pp` pipeline ranks (ints or arrays).

    torch.distributed.pipelining (2.11, 2.14): 1F1B needs >= pp; DualPipeV
    needs >= its 2*pp stages; GPipe, Interleaved1F1B and ZBVZeroBubble would
    run fewer but leave stages idle, so we require >= pp for them too.
    """
    return np.where(pp > 1, pp * (1 + dualpipev), 1)


def min_microbatches(schedule: str, pp: int) -> int:
    return int(min_microbatches_of(pp, schedule == "DualPipeV"))


def interleaved_rounds_ok(n_microbatches, pp):
    """torch's Interleaved1F1B runs the micro-batches in rounds of max(1, n // pp): n must divide evenly."""
    return n_microbatches % np.maximum(1, n_microbatches // pp) == 0


def _not(x):
    return np.logical_not(x)


# --------------------------------------------------------------------------- the rules
EP_MESH = Rule(
    R_EP, lambda p, t: p.fsdp_size % p.ep == 0,
    lambda p, t: (f"plan key 'ep' ({p.ep}) must divide dp_shard*cp ({p.dp_shard}*{p.cp}={p.fsdp_size}): "
                  "expert parallelism is carved out of dp_shard x cp"))
# Megatron-core folds the expert layer's parallelism over all of a stage's tp x cp x dp ranks ("MoE parallel
# folding", Liu et al. 2025, arXiv:2504.14960; parallel_state's expert RankGenerator, order tp-cp-ep-dp-pp with
# the expert TP size in the tp slot): with whole experts (expert_tensor_parallel_size 1) ep may span the TP
# ranks, e.g. Megatron-Bridge's Qwen3-235B-A22B on 256 H100s, TP 2 x PP 8 x DP 16 with EP 32.  Any plan must meet
# this; EP_MESH, titan-run's stricter rule, is a titan-run limit (a what-if estimate predicts past it)
EP_FOLD = Rule(
    R_EP, lambda p, t: (p.fsdp_size * p.tp) % p.ep == 0,
    lambda p, t: (f"plan key 'ep' ({p.ep}) must divide dp_shard*cp*tp ({p.dp_shard}*{p.cp}*{p.tp}="
                  f"{p.fsdp_size * p.tp}): expert parallelism is carved out of a stage's data-parallel and TP ranks"))
V_STAGES = Rule(
    R_STAGES, lambda p, t: _not(p.is_v_schedule) | (p.stages_per_rank == 2),
    lambda p, t: f"plan key 'stages_per_rank' must be 2 for schedule {p.schedule}, got {p.stages_per_rank}")
INTERLEAVED_STAGES = Rule(
    R_STAGES, lambda p, t: _not(p.is_schedule("Interleaved1F1B")) | (p.stages_per_rank >= 2),
    lambda p, t: ("plan key 'stages_per_rank' must be >= 2 for schedule Interleaved1F1B, "
                  f"got {p.stages_per_rank}"))
SINGLE_STAGES = Rule(
    R_STAGES, lambda p, t: p.is_multi_stage | (p.stages_per_rank == 1),
    lambda p, t: f"plan key 'stages_per_rank' must be 1 for schedule {p.schedule}, got {p.stages_per_rank}")
MICRO_COUNT = Rule(
    R_MICRO, lambda p, t: p.n_microbatches >= min_microbatches_of(p.pp, p.is_schedule("DualPipeV")),
    lambda p, t: (f"plan key 'n_microbatches' ({p.n_microbatches}) is too small for schedule {p.schedule} "
                  f"with pp={p.pp}: needs at least {min_microbatches(p.schedule, p.pp)}"))
MICRO_ROUNDS = Rule(
    R_MICRO, lambda p, t: ((p.pp == 1) | _not(p.is_schedule("Interleaved1F1B"))
                           | interleaved_rounds_ok(p.n_microbatches, p.pp)),
    lambda p, t: (f"plan key 'n_microbatches' ({p.n_microbatches}) must be a multiple of "
                  f"max(1, n_microbatches // pp) = {max(1, p.n_microbatches // p.pp)} for Interleaved1F1B"))
# torch's selective activation checkpoint replays its saved outputs once, but the V schedules' split backward
# (torch.distributed.pipelining: input gradients, then weight gradients, each its own autograd pass) recomputes
# a checkpointed region once per pass: the second raises "Trying to backward an extra time ... selective
# activation checkpoint" (full checkpointing just recomputes twice)
SPLIT_AC = Rule(
    R_SPLIT_AC, lambda p, t: _not(p.is_v_schedule) | (p.pp == 1) | _not(p.is_ac("selective")),
    lambda p, t: (f"schedule {p.schedule} with ac 'selective': the schedule's split backward recomputes a "
                  "checkpointed block once for the input gradients and again for the weight gradients, and "
                  "torch's selective checkpoint allows one recompute; use ac 'full' or 'none'"))

WORLD = Rule(
    R_WORLD, lambda p, t: p.world_size == t.world_size,
    lambda p, t: f"dp_replicate*dp_shard*pp*tp*cp = {p.world_size}, world size is {t.world_size}")
TP_SHAPE = Rule(
    R_TP_SHAPE, lambda p, t: ((t.n_heads % p.tp == 0) & (t.n_kv_heads % p.tp == 0) & (t.ffn_hidden % p.tp == 0)
                              & ((t.n_experts == 0) | (t.moe_ffn_hidden % p.tp == 0))),
    lambda p, t: (f"tp={p.tp} must divide n_heads={t.n_heads}, n_kv_heads={t.n_kv_heads} "
                  f"and FFN width(s) {[t.ffn_hidden] + ([t.moe_ffn_hidden] if t.n_experts else [])}"))
TP_NODE = Rule(
    R_TP_NODE, lambda p, t: p.tp <= t.gpus_per_node,
    lambda p, t: f"tp={p.tp} > {t.gpus_per_node} devices per node")
def _units(t) -> str:
    return " (+2 units: pp_split weighted counts the embedding and the head)" if t is not None and t.pp_extra_units else ""


PP_RANKS = Rule(
    R_PP_RANKS, lambda p, t: p.pp <= t.n_layers + t.pp_extra_units,
    lambda p, t: f"pp = {p.pp} > {t.n_layers} layers{_units(t)}: a pipeline rank would hold no layer")
# titan-run's split gives every virtual stage a layer, or under pp_split weighted a unit (a layer, the
# embedding or the head: Zero Bubble's interleaved 1F1B and the Llama 3 paper run chunks holding only the
# embedding or the head)
PP_LAYERS = Rule(
    R_PP_LAYERS, lambda p, t: p.n_stages <= t.n_layers + t.pp_extra_units,
    lambda p, t: f"pp*stages_per_rank = {p.n_stages} > {t.n_layers} layers{_units(t)}")
SEQ = Rule(
    R_SEQ, lambda p, t: t.seq_len % p.seq_divisor == 0,
    lambda p, t: f"seq_len={t.seq_len} must be divisible by {p.seq_divisor} (cp={p.cp}, tp={p.tp})")
EP_EXPERTS = Rule(
    R_EP, lambda p, t: (p.ep == 1) | ((t.n_experts > 0) & (t.n_experts % p.ep == 0)),
    lambda p, t: f"ep={p.ep} must divide n_experts={t.n_experts} and dp_shard*cp={p.fsdp_size}")
BATCH = Rule(
    R_BATCH, lambda p, t: p.global_batch() == t.global_batch,
    lambda p, t: (f"dp*microbatch*n_microbatches = {p.dp}*{p.microbatch}*{p.n_microbatches}"
                  f" = {p.global_batch()} sequences, global batch is {t.global_batch}"))
FLOAT8 = Rule(
    R_FLOAT8, lambda p, t: _not(p.float8) | t.float8_supported,
    lambda p, t: "float8 requested on hardware without float8 GEMMs")
PLAN_RULES = (EP_FOLD, V_STAGES, INTERLEAVED_STAGES, SINGLE_STAGES)
MICRO_RULES = (MICRO_COUNT, MICRO_ROUNDS)       # the runtime's micro-batch rules (ac is a later knob)
RUNTIME_RULES = MICRO_RULES + (SPLIT_AC,)
TARGET_RULES = (WORLD, TP_SHAPE, TP_NODE, PP_RANKS, PP_LAYERS, SEQ, EP_EXPERTS, BATCH, FLOAT8)
LAYOUT_LIMITS = (EP_MESH,)      # titan-run's limits of a layout that `Plan` refuses unless runnable=False
# the rules that are titan-run's limits, not laws of the layout, with what they limit: a what-if
# estimate of another framework's layout predicts past them, saying so in one line
TITAN_RUN_LIMITS = {MICRO_COUNT: "schedule", MICRO_ROUNDS: "schedule", SPLIT_AC: "schedule",
                    PP_LAYERS: "layout", EP_MESH: "layout"}


CHECK_ORDER = (WORLD, TP_SHAPE, TP_NODE, PP_RANKS, PP_LAYERS, SEQ, EP_EXPERTS, EP_FOLD, EP_MESH, BATCH, MICRO_COUNT,
               MICRO_ROUNDS, FLOAT8, V_STAGES, INTERLEAVED_STAGES, SINGLE_STAGES, SPLIT_AC)
assert set(CHECK_ORDER) == set(PLAN_RULES + LAYOUT_LIMITS + RUNTIME_RULES + TARGET_RULES)


def replicate_split_backward_error(plan: Any, backend: str) -> str | None:
    """Why titan-run refuses `plan` on `backend`, or None: the V schedules (split backward) with replicate-only
    data parallelism (dp_replicate > 1, dp_shard * cp = 1) train exactly on spmd_types, but on the dtensor
    fallback their gradients do not match one process (tests/distributed/test_spmd_pp.py: the loss 1.2% off
    by the fifth step)."""
    if (backend == "dtensor" and plan.pp > 1 and bool(plan.is_v_schedule) and plan.dp_replicate > 1
            and plan.fsdp_size == 1):
        return (f"schedule {plan.schedule} with dp_replicate > 1 and dp_shard * cp = 1 runs on backend spmd_types "
                "only: on dtensor its split backward's gradients do not match one process; set backend: "
                "spmd_types, or shard the data-parallel ranks (dp_shard > 1)")
    return None


def float8_tp_backend_error(plan: Any, backend: str) -> str | None:
    """Why titan-run refuses `plan` on `backend` for float8, or None: its float8 linears with tp > 1 are
    torchao's float8 over the spmd_types TP styles; torchao's DTensor float8 TP styles are not wired."""
    if bool(plan.float8) and plan.tp > 1 and backend == "dtensor":
        return ("plan key 'float8' with tp > 1 runs on backend spmd_types only (torchao's float8 TP styles for "
                "DTensor are not wired here): set backend: spmd_types, or tp: 1")
    return None


def model_build_error(spec: Any) -> str | None:
    """Why titan-run cannot build model `spec`, or None: cost-model facts of other frameworks' models that its
    model code lacks (the executor refuses such a plan in this one line; `titan-plan` writes it as a what-if)."""
    if getattr(spec, "embed_norm", False):   # BLOOM's --embed-layernorm
        return "model key 'embed_norm' is true, but titan-run's models have no embedding norm (set it false)"
    if getattr(spec, "mtp_layers", 0):       # DeepSeek-V3's multi-token prediction
        return (f"model key 'mtp_layers' is {spec.mtp_layers}, but titan-run's models have no multi-token "
                "prediction module (set it 0)")
    return None


def tied_tp_backend_error(plan: Any, backend: str, tied: bool) -> str | None:
    """Why titan-run refuses a model with tied embeddings (`tied`) under `plan` on `backend`, or None: the head is
    vocab-sharded under tp, and the dtensor backend leaves the embedding replicated under compile."""
    if tied and plan.tp > 1 and bool(plan.compile) and backend == "dtensor":
        return ("plan key 'compile' with tp > 1 and tied embeddings runs on backend spmd_types only (the dtensor "
                "backend keeps the embedding replicated under compile, the head vocab-sharded): set backend: "
                "spmd_types, or compile: false")
    return None


def rules(*, tp_within_node: bool = True, runnable: bool = True) -> tuple[Rule, ...]:
    """Every rule, in the order `check_plan` reports them."""
    return tuple(r for r in CHECK_ORDER if (tp_within_node or r is not TP_NODE)
                 and (runnable or r not in TITAN_RUN_LIMITS))


def check_plan(plan: Any, t: Target, *, tp_within_node: bool = True,
               runnable: bool = True) -> list[tuple[str, str]]:
    """Every rule `plan` breaks for target `t`, as (reason, message) pairs.

    With ``runnable=False`` titan-run's own limits (`TITAN_RUN_LIMITS`) are left out (what-if estimates).
    """
    return [(r.reason, r.message(plan, t)) for r in rules(tp_within_node=tp_within_node, runnable=runnable)
            if not r.ok(plan, t)]


def titan_run_limits(plan: Any, t: Target) -> list[tuple[str, str]]:
    """The `TITAN_RUN_LIMITS` `plan` breaks for target `t`, as (what is limited: 'schedule' or 'layout',
    message) pairs, in `check_plan`'s order."""
    return [(TITAN_RUN_LIMITS[r], r.message(plan, t)) for r in CHECK_ORDER
            if r in TITAN_RUN_LIMITS and not r.ok(plan, t)]
