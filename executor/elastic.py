"""Elastic restarts: which plan a restarted job runs when its world size changed.

torchrun (``titan-run --max-restarts N --nnodes MIN:MAX``) restarts every
worker after a failure or a membership change; the workers resume from the
latest complete checkpoint of the run (executor/checkpoint.py), and DCP
reshards it onto whatever layout the new world runs.  When the new world is
not the plan's world size:

* ``--fallback-plan FILE``: that plan file (its own world size must match), or
* :func:`replan`: keep tp, pp, cp and ep when ``tp*pp*cp`` divides the new
  world; every remaining rank goes to ``dp_shard`` (dp_replicate becomes 1);
  the global batch is unchanged: ``microbatch`` is kept when possible and
  ``n_microbatches`` absorbs the change in dp, otherwise the largest
  micro-batch that divides the per-rank batch (and leaves the schedule
  enough micro-batches) is taken.

Because every layout computes the same math (layout-independent init, global
mean loss), the loss curve continues as if nothing happened, up to fp32
rounding of the different reduction order.
"""
from __future__ import annotations

import os
import socket
import sys

from search_spaces.constraints import EP_MESH, MICRO_RULES
from search_spaces.plan import SCHEDULES, Plan, PlanError, min_microbatches
from search_spaces.table import Columns

from .config import ConfigError, apply_overrides, load_run_config, parse_overrides, read_plan_file


def nnodes_range(nnodes: str | None) -> tuple[int, int]:
    if not nnodes:
        return 1, 1
    try:
        lo, _, hi = str(nnodes).partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nnodes must be N or MIN:MAX, got '{nnodes}'") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '{nnodes}'")
    return lo, hi


def launcher_world(args, nproc: int) -> int:
    """The world size the launcher validates the plan against: nproc per node times the most nodes.

    More than one node needs a rendezvous every node can reach: without ``--rdzv-endpoint`` (or with a
    host that does not resolve) torchrun would wait for the other nodes forever, so that is refused here.
    """
    nnodes = getattr(args, "nnodes", None)
    hi = nnodes_range(nnodes)[1]
    endpoint = getattr(args, "rdzv_endpoint", None)
    if hi > 1 and not endpoint:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the rendezvous every node joins; "
                          "the same on every node)")
    if endpoint:
        check_endpoint(endpoint)
    return nproc * hi


def check_endpoint(endpoint: str) -> None:
    """`HOST:PORT` with a port in 1..65535 and a host that resolves (one line otherwise)."""
    host, sep, port = str(endpoint).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got '{endpoint}'")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"--rdzv-endpoint {endpoint}: host '{host}' does not resolve ({e})") from None


def replan(plan: Plan, world: int, global_batch: int | None = None) -> Plan:
    """A plan for `world` ranks that keeps tp/pp/cp/ep and the global batch (see the module docstring)."""
    gb = plan.global_batch() if global_batch is None else global_batch
    fixed = plan.tp * plan.pp * plan.cp
    if world % fixed:
        raise ConfigError(f"cannot re-plan for world {world}: tp*pp*cp = {plan.tp}*{plan.pp}*{plan.cp} = {fixed} "
                          "does not divide it (give --fallback-plan)")
    dp = world // fixed
    if gb % dp:
        raise ConfigError(f"cannot re-plan for world {world}: global batch {gb} is not divisible by dp = {dp} "
                          "(give --fallback-plan)")
    per_rank = gb // dp
    choices = [mb for mb in range(min(plan.microbatch, per_rank), 0, -1)
               if per_rank % mb == 0 and _schedule_accepts(plan, per_rank // mb)]
    need = min_microbatches(plan.schedule, plan.pp)
    if not choices:
        raise ConfigError(f"cannot re-plan for world {world}: {per_rank} sequences per dp rank is fewer than the "
                          f"{need} micro-batches schedule {plan.schedule} needs (give --fallback-plan)")
    ep = plan.ep     # halved until the mesh rule accepts it: ep is carved out of dp_shard*cp (dp_shard = dp here)
    while ep > 1 and not EP_MESH.ok(Columns({"dp_shard": dp, "cp": plan.cp, "ep": ep}), None):
        ep //= 2
    keep = {k: v for k, v in plan.to_dict().items() if k not in ("dp_shard", "n_microbatches")}
    try:
        return Plan.complete({**keep, "dp_replicate": 1, "microbatch": choices[0], "ep": ep}, world_size=world,
                             global_batch=gb)
    except PlanError as e:
        raise ConfigError(f"cannot re-plan for world {world}: {e} (give --fallback-plan)") from None


def _schedule_accepts(plan: Plan, n_microbatches: int) -> bool:
    """The pipeline runtime's micro-batch rules (constraints.MICRO_RULES) for `plan`'s schedule."""
    cols = Columns({"pp": plan.pp, "schedule": SCHEDULES.index(plan.schedule), "n_microbatches": n_microbatches})
    return all(bool(rule.ok(cols, None)) for rule in MICRO_RULES)


def load_elastic_config(args, world: int):
    """The run config for `world` ranks: the plan if it fits, else --fallback-plan, else :func:`replan`."""
    try:
        return load_run_config(args.plan, args.set, world_size=world, steps=args.steps)
    except ConfigError as first:
        if "world size" not in str(first):
            raise
        if args.fallback_plan:
            return load_run_config(args.fallback_plan, args.set, world_size=world, steps=args.steps)
        original = Plan.from_dict(_plan_dict(read_plan_file(args.plan), args.set))
        base = load_run_config(args.plan, args.set, world_size=original.world_size, steps=args.steps)
        new = replan(base.plan, world, base.global_batch)
        overrides = list(args.set) + [f"plan.{k}={v}" for k, v in new.to_dict().items()]
        cfg = load_run_config(args.plan, overrides, world_size=world, steps=args.steps)
        if os.environ.get("RANK", "0") == "0":
            print(f"titan-run: elastic: world {world} does not fit the plan ({base.plan.describe()}); "
                  f"re-planned to {new.describe()}", file=sys.stderr, flush=True)
        return cfg


def _plan_dict(raw: dict, overrides: list[str]) -> dict:
    return dict(apply_overrides(raw, parse_overrides(overrides)).get("plan") or {})
