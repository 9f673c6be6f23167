"""`plan.yaml`: the one hand-off from the planner to the executor.

Shape (top-level keys)::

    model: llama3-70b              # preset name or path of a model YAML
    hardware: h100-sxm             # preset name or path (optional for the executor)
    workload: {seq_len: 8192, global_batch: 512, dtype: bf16, state_layout: fsdp2}
    plan: {dp_replicate: 1, dp_shard: 32, pp: 1, tp: 8, ...}   # a `Plan`
    train: {steps: 100, lr: 3e-4, ...}                           # optional, executor settings
    predicted: {...}               # the planner's figures (informational)
    measured: {...}                # trial figures, when trials ran
    inputs: {...}                  # what the planner was asked
    provenance: {...}              # tool, version, time

Only ``plan`` and ``model`` are required; unknown top-level keys are refused
by name so a typo does not silently drop a setting.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import yaml

from .plan import Plan, PlanError
from .typed import check_keys
from .yaml_file import read_yaml, write_text

TOP_LEVEL_KEYS = ("model", "hardware", "workload", "plan", "train", "predicted", "measured", "inputs",
                  "provenance")


def read_plan_file(path: str | os.PathLike, *, parse_plan: bool = True,
                   error: type[ValueError] = PlanError) -> dict[str, Any]:
    """Read and check a plan file: the one reader, for titan-plan and titan-run.

    Returns its mapping, with ``plan`` as a `Plan` when `parse_plan`; titan-run reads it with
    ``parse_plan=False`` (``plan`` stays a mapping) because its ``--set`` overrides apply before the
    plan is built.  Errors are one line, raised as `error` (titan-run passes its ConfigError).
    """
    data = read_yaml(path, error=error, what="plan file")
    try:
        return plan_file_from_dict(data, where=str(path), parse_plan=parse_plan)
    except PlanError as e:
        if error is PlanError:
            raise
        raise error(str(e)) from None


def plan_file_from_dict(data: Any, *, where: str = "plan file", parse_plan: bool = True) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise PlanError(f"{where}: expected a mapping with keys {', '.join(TOP_LEVEL_KEYS)} "
                        f"(got {type(data).__name__})")
    check_keys(data, TOP_LEVEL_KEYS, where=where, error=PlanError)   # one line, with a "did you mean"
    if "plan" not in data:
        raise PlanError(f"{where}: missing key 'plan'")
    if "model" not in data:
        raise PlanError(f"{where}: missing key 'model'")
    out = dict(data)
    for key in ("workload", "train", "predicted", "measured", "inputs", "provenance"):
        if key in out and out[key] is not None and not isinstance(out[key], Mapping):
            raise PlanError(f"{where}: key '{key}' must be a mapping")
    if parse_plan:
        out["plan"] = Plan.from_dict(data["plan"], where=f"{where}: plan")
    elif out["plan"] is not None and not isinstance(out["plan"], Mapping):
        raise PlanError(f"{where}: key 'plan' must be a mapping of plan keys")
    return out


def write_plan_file(path: str | os.PathLike, contents: Mapping[str, Any]) -> None:
    """Write atomically (temp file then rename) so a reader never sees half a plan."""
    data = dict(contents)
    if isinstance(data.get("plan"), Plan):
        data["plan"] = data["plan"].to_dict()
    plan_file_from_dict({**data, "plan": data["plan"]}, where="plan to write")
    ordered = {k: data[k] for k in TOP_LEVEL_KEYS if k in data}
    write_text(path, yaml.safe_dump(_plain(ordered), sort_keys=False, default_flow_style=False),
               error=PlanError, what="plan file")   # atomic, through a symlink, never over a device


def _plain(x: Any) -> Any:
    """numpy scalars and tuples -> plain YAML types."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x
