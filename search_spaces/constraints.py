"""The legality rules of a layout, written once per rule.

`Target` is what is being planned: the world and the shape of the model and
workload the rules look at.  `check_plan` applies every rule to one `Plan`
(used for plans given by hand and as the reference the vectorized
enumerator is tested against); `enumerate.py` applies the same rules to whole
arrays.  Each rule has a short reason name used in rejection counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .plan import Plan, interleaved_rounds_ok, min_microbatches

# reason names, in the order the enumerator applies them
R_TP_SHAPE = "tp does not divide heads, kv heads or FFN width"
R_TP_NODE = "tp spans more than one node"
R_PP_LAYERS = "more pipeline stages than layers"
R_SEQ = "seq_len not divisible by 2*cp*tp (cp>1) or tp"
R_EP = "ep does not divide experts and dp_shard*cp"
R_BATCH = "global batch not divisible by dp*microbatch"
R_MICRO = "micro-batch count does not suit the pipeline schedule"
R_FLOAT8 = "float8 not supported by the hardware"
R_WORLD = "degrees do not multiply to the world size"
R_MEMORY = "out of memory"


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

    @classmethod
    def of(cls, model: Any, *, world_size: int, seq_len: int, global_batch: int, gpus_per_node: int,
           float8_supported: bool = True) -> "Target":
        """Build from any object with the `ModelSpec` attributes."""
        return cls(world_size=world_size, gpus_per_node=gpus_per_node, n_layers=model.n_layers,
                   n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, ffn_hidden=model.ffn_hidden,
                   moe_ffn_hidden=getattr(model, "moe_ffn_hidden", 0) or 0,
                   n_experts=getattr(model, "n_experts", 0) or 0, seq_len=seq_len,
                   global_batch=global_batch, float8_supported=float8_supported)


def seq_divisor(cp: int, tp: int) -> int:
    """Sequence length must divide by this: CP's load-balanced split cuts the
    sequence in 2*cp chunks (head-tail pairing), and sequence parallel splits
    each rank's part tp ways."""
    return 2 * cp * tp if cp > 1 else tp


def check_plan(plan: Plan, t: Target, *, tp_within_node: bool = True) -> list[tuple[str, str]]:
    """Every rule `plan` breaks for target `t`, as (reason, message) pairs."""
    out: list[tuple[str, str]] = []
    if plan.world_size != t.world_size:
        out.append((R_WORLD, f"dp_replicate*dp_shard*pp*tp*cp = {plan.world_size}, world size is {t.world_size}"))
    widths = [t.ffn_hidden] + ([t.moe_ffn_hidden] if t.n_experts else [])
    if t.n_heads % plan.tp or t.n_kv_heads % plan.tp or any(w % plan.tp for w in widths):
        out.append((R_TP_SHAPE, f"tp={plan.tp} must divide n_heads={t.n_heads}, n_kv_heads={t.n_kv_heads} "
                                f"and FFN width(s) {widths}"))
    if tp_within_node and plan.tp > t.gpus_per_node:
        out.append((R_TP_NODE, f"tp={plan.tp} > {t.gpus_per_node} devices per node"))
    if plan.pp * plan.stages_per_rank > t.n_layers:
        out.append((R_PP_LAYERS, f"pp*stages_per_rank = {plan.pp * plan.stages_per_rank} > {t.n_layers} layers"))
    if t.seq_len % seq_divisor(plan.cp, plan.tp):
        out.append((R_SEQ, f"seq_len={t.seq_len} must be divisible by {seq_divisor(plan.cp, plan.tp)} "
                           f"(cp={plan.cp}, tp={plan.tp})"))
    if plan.ep > 1 and (t.n_experts == 0 or t.n_experts % plan.ep or (plan.dp_shard * plan.cp) % plan.ep):
        out.append((R_EP, f"ep={plan.ep} must divide n_experts={t.n_experts} and dp_shard*cp="
                          f"{plan.dp_shard * plan.cp}"))
    if plan.global_batch() != t.global_batch:
        out.append((R_BATCH, f"dp*microbatch*n_microbatches = {plan.dp}*{plan.microbatch}*{plan.n_microbatches}"
                             f" = {plan.global_batch()} sequences, global batch is {t.global_batch}"))
    if plan.pp > 1 and plan.n_microbatches < min_microbatches(plan.schedule, plan.pp):
        out.append((R_MICRO, f"n_microbatches={plan.n_microbatches} < {min_microbatches(plan.schedule, plan.pp)}"))
    if plan.pp > 1 and plan.schedule == "Interleaved1F1B" and not interleaved_rounds_ok(plan.n_microbatches, plan.pp):
        out.append((R_MICRO, f"n_microbatches={plan.n_microbatches} is not a multiple of its Interleaved1F1B rounds"))
    if plan.float8 and not t.float8_supported:
        out.append((R_FLOAT8, "float8 requested on hardware without float8 GEMMs"))
    return out
