"""Search spaces: the legal values of each knob, read from YAML files.

A space file (``search_spaces/dense.yaml`` and friends, or a user's file)
looks like::

    name: dense
    degrees:                 # which degrees may be tried; 'all' = every divisor of the world size
      dp_replicate: all
      tp: [1, 2, 4, 8]
      pp: all
      cp: [1]
      ep: [1]
    tp_within_node: true     # tp never spans nodes
    knobs:
      microbatch: [1, 2, 4]
      schedule: [1F1B, Interleaved1F1B, ZBVZeroBubble]
      stages_per_rank: [2, 4]   # Interleaved1F1B only; V schedules always use 2
      ac: [none, selective, full]
      reshard_after_forward: [true, false]
      compile: [true]
      float8: [false, true]
      backend: [spmd_types]
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


from .plan import AC_MODES, BACKENDS, SCHEDULES, PlanError
from .typed import MAX_WORLD_SIZE, InputError, check_keys, show
from .yaml_file import read_yaml

SPACE_DIR = Path(__file__).parent
DEGREE_AXES = ("dp_replicate", "pp", "tp", "cp", "ep")  # dp_shard is what remains of the world
KNOB_KEYS = ("microbatch", "schedule", "stages_per_rank", "ac", "reshard_after_forward", "compile",
             "float8", "backend")


class SpaceError(InputError):
    """A search-space file that is malformed or names an illegal value."""


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    name: str
    degrees: Mapping[str, Any]          # axis -> "all" or tuple of ints
    knobs: Mapping[str, tuple]
    tp_within_node: bool = True
    description: str = ""

    def degree_values(self, axis: str, world_size: int) -> tuple[int, ...]:
        spec = self.degrees.get(axis, "all")
        divs = divisors(world_size)
        if spec == "all":
            return divs
        return tuple(v for v in spec if v in divs)


def divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def space_names() -> list[str]:
    return sorted(p.stem for p in SPACE_DIR.glob("*.yaml"))


def load_space(name_or_path: str | os.PathLike) -> SearchSpace:
    s = str(name_or_path)
    path = Path(s)
    if not (s.endswith((".yaml", ".yml")) or os.sep in s):
        path = SPACE_DIR / f"{s}.yaml"
        if not path.is_file():
            raise SpaceError(f"unknown search space '{s}'; known: {', '.join(space_names())}; "
                             "or give the path of a YAML file")
    data = read_yaml(path, error=SpaceError, what="search-space file")
    return space_from_dict(data, where=str(path), default_name=path.stem)


def space_from_dict(data: Any, *, where: str = "space", default_name: str = "custom") -> SearchSpace:
    if not isinstance(data, Mapping):
        raise SpaceError(f"{where}: expected a mapping with keys degrees, knobs")
    check_keys(data, ("degrees", "description", "knobs", "name", "tp_within_node"), where=where, error=SpaceError)
    degrees_in = data.get("degrees") or {}
    if not isinstance(degrees_in, Mapping):
        raise SpaceError(f"{where}: key 'degrees' must be a mapping of {', '.join(DEGREE_AXES)}")
    degrees: dict[str, Any] = {}
    for axis, spec in degrees_in.items():
        if axis not in DEGREE_AXES:
            raise SpaceError(f"{where}: unknown degree 'degrees.{axis}' (allowed: {', '.join(DEGREE_AXES)}; "
                             "dp_shard is whatever remains of the world size)")
        if spec == "all":
            degrees[axis] = "all"
        elif isinstance(spec, list) and spec and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                                      for v in spec):
            degrees[axis] = tuple(sorted(set(spec)))
        else:
            raise SpaceError(f"{where}: 'degrees.{axis}' must be 'all' or a list of positive integers, got {spec!r}")
    knobs_in = data.get("knobs") or {}
    if not isinstance(knobs_in, Mapping):
        raise SpaceError(f"{where}: key 'knobs' must be a mapping of {', '.join(KNOB_KEYS)}")
    knobs: dict[str, tuple] = dict(DEFAULT_KNOBS)
    for key, values in knobs_in.items():
        if key not in KNOB_KEYS:
            raise SpaceError(f"{where}: unknown knob 'knobs.{key}' (allowed: {', '.join(KNOB_KEYS)})")
        if not isinstance(values, list) or not values:
            raise SpaceError(f"{where}: 'knobs.{key}' must be a non-empty list, got {values!r}")
        knobs[key] = tuple(_check_knob(where, key, v) for v in values)
    tpn = data.get("tp_within_node", True)
    if not isinstance(tpn, bool):
        raise SpaceError(f"{where}: key 'tp_within_node' must be true or false")
    return SearchSpace(name=str(data.get("name", default_name)), degrees=degrees, knobs=knobs,
                       tp_within_node=tpn, description=str(data.get("description", "")))


DEFAULT_KNOBS: dict[str, tuple] = {
    "microbatch": (1,),
    "schedule": ("1F1B",),
    "stages_per_rank": (2,),
    "ac": ("none",),
    "reshard_after_forward": (True,),
    "compile": (False,),
    "float8": (False,),
    "backend": ("spmd_types",),
}


def _check_knob(where: str, key: str, v: Any) -> Any:
    choices = {"schedule": SCHEDULES, "ac": AC_MODES, "backend": BACKENDS}
    if key in choices:
        if v not in choices[key]:
            raise SpaceError(f"{where}: 'knobs.{key}' value {v!r} is not one of {', '.join(choices[key])}")
        return v
    if key in ("reshard_after_forward", "compile", "float8"):
        if not isinstance(v, bool):
            raise SpaceError(f"{where}: 'knobs.{key}' values must be true or false, got {v!r}")
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WORLD_SIZE:
        raise SpaceError(f"{where}: 'knobs.{key}' values must be positive integers (at most {MAX_WORLD_SIZE:,}), "
                         f"got {show(v)}")
    return v


__all__ = ["SearchSpace", "SpaceError", "load_space", "space_from_dict", "space_names", "divisors",
           "PlanError"]
