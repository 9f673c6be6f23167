"""The dry run's command line and the checks that need no torch (``titan-run --dry-run``: executor/dry_run.py).

Parsing the flags, reading the plan file, resolving the run configuration for the target world and the ranks
to inspect are all torch-free, so a bad ``--world``, plan or ``--ranks`` is answered in one line before torch
and the parallel machinery are imported (a fraction of a second instead of several).
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

from search_spaces.planfile import read_plan_file
from search_spaces.typed import OneLineArgumentParser

from .config import ConfigError, load_run_config

DESCRIPTION = "Dry run: apply a plan for a world of N ranks inside ONE process, on the meta device."


@dataclass
class DryRun:
    """What the dry run executes: the resolved configuration, the world, the ranks to inspect and the flags."""
    cfg: object
    world: int
    ranks: list[int]
    memory: bool
    json: bool
    note: str | None


def build_parser() -> OneLineArgumentParser:
    ap = OneLineArgumentParser(prog="titan-run --dry-run", description=DESCRIPTION)
    ap.add_argument("--plan", required=True, help="plan file")
    ap.add_argument("--world", type=int, help="target world size (default: the plan's degrees' product)")
    ap.add_argument("--ranks", help="comma-separated ranks to inspect (default: first rank of each pp stage)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override plan/workload keys")
    ap.add_argument("--memory", action="store_true", help="also a FakeTensor peak-memory estimate of one step")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    return ap


def _error(message: str) -> int:
    print(f"titan-run: error: {message}", file=sys.stderr)
    return 2


def prepare(argv: list[str] | None = None) -> DryRun | int:
    """The dry run `argv` asks for, or the exit code of a refusal (2, its one line printed)."""
    args = build_parser().parse_args(argv)
    try:
        given = read_plan_file(args.plan)["plan"]
        world = args.world if args.world is not None else given.world_size   # --world 0 is refused
        note = None
        if given.float8 and importlib.util.find_spec("torchao") is None:
            # Float8Linear keeps the high-precision weights: the state bytes do not depend on float8
            args.set.append("plan.float8=false")
            note = "float8 not applied (torchao is not installed); state bytes are the same"
        cfg = load_run_config(args.plan, args.set, world_size=world)
    except (ConfigError, ValueError) as e:
        return _error(str(e))
    per_stage = world // cfg.plan.pp
    try:
        ranks = ([int(r) for r in args.ranks.split(",")] if args.ranks else
                 [s * per_stage for s in range(cfg.plan.pp)])
    except ValueError:
        return _error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        return _error(f"--ranks {bad[0]} is outside the world of {world}")
    return DryRun(cfg=cfg, world=world, ranks=ranks, memory=args.memory, json=args.json, note=note)
