"""Run configuration for `titan-run`: a plan file plus command-line overrides.

A plan file is YAML with the keys that `titan-plan` writes::

    model: llama3-8b             # preset name or path of a model YAML
    hardware: h100-sxm           # optional: preset name or path (MFU peak)
    workload: {seq_len: 8192, global_batch: 64}
    plan: {dp_shard: 8, tp: 2, ...}      # a `search_spaces.plan.Plan`
    train: {steps: 100, lr: 3e-4, ...}   # optional: `TrainConfig` keys
    predicted: ...  inputs: ...  provenance: ...   # ignored by the executor

Unknown keys inside ``plan`` and ``train`` are errors naming the key; other
top-level keys are ignored.  ``--set key=value`` overrides any of them:
``plan.tp=2``, ``train.lr=1e-3``, ``workload.seq_len=128``, ``model=...``, or
a bare key that belongs to exactly one section (``tp=2``, ``steps=10``).
Values are parsed as YAML scalars.

With no plan file the run trains ``llama3-debug`` (seq_len 256) with a layout
chosen for the local devices: every device is an FSDP rank, unless the
overrides fix some degrees, in which case ``dp_shard`` takes what is left.

Everything here is checked before any process group starts
(:func:`validate`): a bad input is one `ConfigError` line.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from cost_models.specs import ModelSpec, SpecError, Workload, load_hardware, load_model
from search_spaces.constraints import Target, check_plan
from search_spaces.yaml_file import read_yaml
from search_spaces.plan import Plan, PlanError
from search_spaces.planfile import read_plan_file as read_checked_plan_file

DEFAULT_MODEL = "llama3-debug"
DEFAULT_SEQ_LEN = 256
DEFAULT_GLOBAL_BATCH = 8
WORKLOAD_KEYS = tuple(f.name for f in dataclasses.fields(Workload))   # what titan-plan writes
TOP_LEVEL_USED = ("model", "hardware", "workload", "plan", "train")


class ConfigError(ValueError):
    """A run configuration that cannot be used (reported as one line, exit code 2)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train: optimizer, schedule, data, logging.  All keys optional in a plan file."""

    steps: int = 150
    lr: float = 3e-3
    min_lr_ratio: float = 0.1       # cosine decays to lr * min_lr_ratio
    warmup: int = 15                # linear warmup steps
    weight_decay: float = 0.1       # applied to matrices and embeddings (ndim >= 2) only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0          # max global grad norm; 0 disables clipping (norm still reported)
    seed: int = 0
    data: str = "stdlib"            # "stdlib" | path of a .txt/.jsonl file or a folder of them
    tokenizer: str = "bytes"        # "bytes" | path of a HF tokenizer.json
    max_corpus_bytes: int = 16_000_000
    dtype: str = "auto"             # auto: fp32 on CPU; on GPU workload.dtype if given, else bf16 | bf16 | fp32
    optimizer_impl: str = "auto"    # auto (fused on GPU, foreach on CPU) | fused | foreach | for-loop
    log_every: int = 1
    profile_step: int = 2           # CPU: step whose peak memory is measured with the profiler; 0 = never
    tensorboard: bool = True
    expert_bias_gamma: float = 1e-3  # MoE aux-loss-free balancing: bias step per optimizer step (load_balance_bias)
    pg_timeout_s: int = 300         # collective timeout: a stuck rank fails instead of hanging
    checkpoint_every: int = 0       # save a checkpoint every K steps and at the end; 0 = no checkpoints
    keep_checkpoints: int = 3       # complete checkpoints kept (oldest removed); 0 = keep all
    checkpoint_dir: str = ""        # default <run_dir>/checkpoints
    async_checkpoint: bool = False  # write in a background process while training continues
    async_checkpoint_cpu_share: float = 0.1  # the background writer pauses so its CPU time stays <= this
                                    # fraction of wall time (short slices disturb training far less); 1 = no pauses
    resume: str = ""                # "" | "latest" | a checkpoint folder | a folder of them (titan-run --resume)

    def __post_init__(self) -> None:
        for k, lowest in (("steps", 1), ("log_every", 1), ("max_corpus_bytes", 1), ("pg_timeout_s", 1),
                          ("warmup", 0), ("seed", 0), ("profile_step", 0), ("checkpoint_every", 0),
                          ("keep_checkpoints", 0)):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < lowest:
                raise ConfigError(f"train key '{k}' must be an integer >= {lowest}, got {v!r}")
        for k in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "expert_bias_gamma",
                  "async_checkpoint_cpu_share"):
            v = getattr(self, k)
            if isinstance(v, str):          # YAML 1.1 reads 1e-3 (no dot) as a string
                try:
                    v = float(v)
                except ValueError:
                    pass
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"train key '{k}' must be a non-negative number, got {v!r}")
            object.__setattr__(self, k, float(v))
        if not 0.0 < self.async_checkpoint_cpu_share <= 1.0:
            raise ConfigError("train key 'async_checkpoint_cpu_share' must be in (0, 1] (a fraction of one core), "
                              f"got {self.async_checkpoint_cpu_share!r}")
        for k, allowed in (("dtype", ("auto", "bf16", "fp32")),
                           ("optimizer_impl", ("auto", "fused", "foreach", "for-loop"))):
            if getattr(self, k) not in allowed:
                raise ConfigError(f"train key '{k}' must be one of {', '.join(allowed)}; got {getattr(self, k)!r}")
        for k in ("data", "tokenizer", "checkpoint_dir", "resume"):
            if not isinstance(getattr(self, k), str):
                raise ConfigError(f"train key '{k}' must be a string, got {getattr(self, k)!r}")
        for k in ("tensorboard", "async_checkpoint"):
            if not isinstance(getattr(self, k), bool):
                raise ConfigError(f"train key '{k}' must be true or false, got {getattr(self, k)!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"'train' must be a mapping of train keys, got {type(d).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"train: unknown key '{unknown[0]}' (allowed: {', '.join(sorted(known))})")
        return cls(**dict(d))


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    plan: Plan
    model: str                      # preset name or path
    spec: ModelSpec
    hardware: str | None            # preset name or path; None -> chosen from the device
    seq_len: int
    global_batch: int
    train: TrainConfig
    source: str                     # plan file path, or "default"
    resolved: dict = field(default_factory=dict)   # the plan-file dict after overrides

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


# --------------------------------------------------------------------------- loading
def parse_overrides(pairs: list[str] | None) -> list[tuple[str, Any]]:
    out = []
    for item in pairs or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got '{item}'")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"--set expects key=value, got '{item}'")
        value = _scalar(raw)
        out.append((key, value))
    return out


def _scalar(raw: str) -> Any:
    """A --set value: int, float (also '1e-3', which YAML 1.1 reads as a string), or any YAML scalar."""
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def _section_of(key: str) -> str:
    plan_keys = {f.name for f in dataclasses.fields(Plan)}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    owners = [s for s, keys in (("plan", plan_keys), ("train", train_keys), ("workload", set(WORKLOAD_KEYS)))
              if key in keys]
    if key in ("model", "hardware"):
        return ""
    if len(owners) > 1:
        raise ConfigError(f"--set: key '{key}' is ambiguous: write {' or '.join(o + '.' + key for o in owners)}")
    if not owners:
        raise ConfigError(f"--set: unknown key '{key}' (use plan.<key>, train.<key>, workload.<key>, model or "
                          "hardware)")
    return owners[0]


def apply_overrides(raw: dict, overrides: list[tuple[str, Any]]) -> dict:
    raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for key, value in overrides:
        if "." in key:
            section, sub = key.split(".", 1)
            if section not in ("plan", "train", "workload"):
                raise ConfigError(f"--set: unknown section '{section}' in '{key}' (plan, train, workload)")
        else:
            section, sub = _section_of(key), key
        if not section:
            raw[sub] = value
            continue
        sec = raw.get(section)
        if sec is None:
            sec = raw[section] = {}
        if not isinstance(sec, dict):
            raise ConfigError(f"'{section}' must be a mapping, got {type(sec).__name__}")
        sec[sub] = value
    return raw


def read_plan_file(path: str | os.PathLike) -> dict:
    """The plan file as titan-run reads it (search_spaces.planfile's reader and checks), with ``plan``
    still a mapping: the --set overrides apply before the plan is built."""
    return read_checked_plan_file(path, parse_plan=False, error=ConfigError)


def load_run_config(plan_path: str | None, overrides: list[str] | None, *, world_size: int,
                    steps: int | None = None) -> RunConfig:
    """Read the plan file (or the default), apply overrides, build and validate the config."""
    raw = read_plan_file(plan_path) if plan_path else {}
    raw = apply_overrides(raw, parse_overrides(overrides))
    if steps is not None:
        raw = apply_overrides(raw, [("train.steps", steps)])
    for k in ("plan", "train", "workload"):
        if k in raw and raw[k] is not None and not isinstance(raw[k], Mapping):
            raise ConfigError(f"'{k}' must be a mapping, got {type(raw[k]).__name__}")
    model_name = raw.get("model") or DEFAULT_MODEL
    if isinstance(model_name, Mapping):
        raise ConfigError("'model' must be a preset name or the path of a model YAML file")
    try:
        spec = load_model(str(model_name))
    except SpecError as e:
        raise ConfigError(str(e)) from None
    hardware = raw.get("hardware")
    if isinstance(hardware, Mapping):   # titan-plan may write the spec inline: use its name
        hardware = hardware.get("name")
    if hardware is not None:
        try:
            load_hardware(str(hardware))
        except SpecError as e:
            raise ConfigError(str(e)) from None

    workload = dict(raw.get("workload") or {})
    unknown = sorted(set(workload) - set(WORKLOAD_KEYS))
    if unknown:
        raise ConfigError(f"workload: unknown key '{unknown[0]}' (allowed: {', '.join(WORKLOAD_KEYS)})")
    seq_len = workload.get("seq_len", DEFAULT_SEQ_LEN)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"workload key 'seq_len' must be a positive integer, got {seq_len!r}")

    plan_dict = dict(raw.get("plan") or {})
    if not plan_path:
        plan_dict = default_plan_dict(plan_dict, world_size, workload.get("global_batch", DEFAULT_GLOBAL_BATCH))
    try:
        plan = Plan.from_dict(plan_dict)
    except PlanError as e:
        raise ConfigError(str(e)) from None
    except TypeError as e:
        raise ConfigError(f"plan: {e}") from None
    global_batch = workload.get("global_batch", plan.global_batch())
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"workload key 'global_batch' must be a positive integer, got {global_batch!r}")
    train = TrainConfig.from_dict(raw.get("train") or {})
    raw["model"], raw["plan"] = str(model_name), plan.to_dict()
    raw["workload"] = {**workload, "seq_len": seq_len, "global_batch": global_batch}
    raw["train"] = dataclasses.asdict(train)
    cfg = RunConfig(plan=plan, model=str(model_name), spec=spec, hardware=None if hardware is None else str(hardware),
                    seq_len=seq_len, global_batch=global_batch, train=train,
                    source=str(plan_path) if plan_path else "default", resolved=raw)
    validate(cfg, world_size)
    return cfg


def default_plan_dict(given: dict, world_size: int, global_batch: Any) -> dict:
    """A layout for `world_size` local devices: all FSDP, unless degrees are given, with the fewest
    micro-batches the schedule accepts (`Plan.complete`)."""
    try:
        return Plan.complete(given, world_size=world_size, global_batch=global_batch,
                             fewest_microbatches=True).to_dict()
    except PlanError as e:
        raise ConfigError(str(e)) from None


# --------------------------------------------------------------------------- validation
def validate(cfg: RunConfig, world_size: int) -> None:
    """Every check that can run before a process group exists."""
    plan, spec = cfg.plan, cfg.spec
    try:
        plan.check_world(world_size)
    except PlanError as e:
        raise ConfigError(str(e)) from None
    if plan.ep > 1 and not spec.is_moe:
        raise ConfigError(f"plan key 'ep' is {plan.ep} but model '{spec.name}' is dense (no experts): "
                          "expert parallelism needs a mixture-of-experts model (set ep: 1)")
    if plan.ep > 1 and spec.n_experts % plan.ep:
        raise ConfigError(f"plan key 'ep' ({plan.ep}) must divide the number of experts of model "
                          f"'{spec.name}' ({spec.n_experts})")
    target = Target.of(spec, world_size=world_size, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                       gpus_per_node=max(world_size, 1))
    problems = check_plan(plan, target, tp_within_node=False)
    if problems:
        reason, msg = problems[0]
        raise ConfigError(f"plan does not fit: {msg} ({reason})")
    if cfg.train.warmup > cfg.train.steps:
        pass  # allowed: the run stays in warmup
    if plan.pp > 1 and not _module_exists("executor.parallel.pipeline"):
        raise ConfigError("plan key 'pp' > 1 needs executor/parallel/pipeline.py, which is not installed")
    if plan.cp > 1 and not _module_exists("executor.parallel.context_parallel"):
        raise ConfigError("plan key 'cp' > 1 needs executor/parallel/context_parallel.py, which is not installed")
    if plan.float8:
        if not _module_exists("torchao"):
            raise ConfigError("plan key 'float8' is true but torchao is not installed (pip install torchao)")
        if plan.tp > 1:
            raise ConfigError("plan key 'float8' with tp > 1 is not supported by titan-run yet")
    if cfg.train.tokenizer != "bytes":
        tok = Path(cfg.train.tokenizer)
        if not tok.is_file():
            raise ConfigError(f"train key 'tokenizer': file '{tok}' does not exist (or use 'bytes')")
        if not _module_exists("tokenizers"):
            raise ConfigError("train key 'tokenizer' names a tokenizer.json, which needs the 'tokenizers' "
                              "package (pip install tokenizers)")
    if cfg.train.data != "stdlib" and not Path(cfg.train.data).exists():
        raise ConfigError(f"train key 'data': '{cfg.train.data}' does not exist (a .txt/.jsonl file, a folder, "
                          "or 'stdlib')")


def _module_exists(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def dump_resolved(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.resolved, sort_keys=False)
