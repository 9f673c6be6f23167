"""Run configuration for `titan-run`: a plan file plus command-line overrides.

A plan file is YAML with the keys that `titan-plan` writes::

    model: llama3-8b             # preset name or path of a model YAML
    hardware: h100-sxm           # optional: preset name or path (MFU peak)
    workload: {seq_len: 8192, global_batch: 64}
    plan: {dp_shard: 8, tp: 2, ...}      # a `search_spaces.plan.Plan`
    train: {steps: 100, lr: 3e-4, ...}   # optional: `TrainConfig` keys
    predicted: ...  inputs: ...  provenance: ...   # ignored by the executor

Every section is read by the one typed reader (`search_spaces.typed`): an unknown
key anywhere (a top-level typo such as ``trian:`` too) is an error naming the key
with a "did you mean"; types, choices and ranges come from the dataclasses
(`TrainConfig`, `Workload`, `Plan`), and the run config carries its `Workload`.
``--set key=value`` overrides any of them:
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
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from cost_models.specs import ModelSpec, SpecError, load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.constraints import (Target, check_plan, float8_tp_backend_error, model_build_error,
                                       replicate_split_backward_error, tied_tp_backend_error)
from search_spaces.planfile import TOP_LEVEL_KEYS, read_plan_file as read_checked_plan_file
from search_spaces.plan import Plan, PlanError
from search_spaces.typed import MAX_WORLD_SIZE, InputError, check_fields, check_keys, from_mapping, show
from search_spaces.yaml_file import parse_yaml

from .data import check_corpus
from .tokenizer import check_tokenizer

DEFAULT_MODEL = "llama3-debug"
DEFAULT_SEQ_LEN = 256
DEFAULT_GLOBAL_BATCH = 8
WORKLOAD_KEYS = tuple(f.name for f in dataclasses.fields(Workload))   # what titan-plan writes


class ConfigError(InputError):
    """A run configuration that cannot be used (reported as one line, exit code 2)."""


# range rules of the typed reader (search_spaces.typed, field metadata)
_AT_LEAST_1 = {"min": 1}
_AT_LEAST_0 = {"min": 0}
_FRACTION = {"min": 0, "max": 1}                    # [0, 1]
_BETA = {"min": 0, "max": 1, "open": "right"}       # [0, 1): a moment decay of 1 never forgets
_POSITIVE = {"min": 0, "open": "left"}              # > 0
_NONEMPTY = {"nonempty": True}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train: optimizer, schedule, data, logging.  All keys optional in a plan file.

    Types, choices (``Literal``) and ranges (field metadata) are read by the one typed
    reader, `search_spaces.typed.from_mapping`; numbers must be finite.
    """

    steps: int = field(default=150, metadata=_AT_LEAST_1)
    lr: float = field(default=3e-3, metadata=_AT_LEAST_0)
    min_lr_ratio: float = field(default=0.1, metadata=_FRACTION)   # cosine decays to lr * min_lr_ratio
    warmup: int = field(default=15, metadata=_AT_LEAST_0)          # linear warmup steps
    weight_decay: float = field(default=0.1, metadata=_AT_LEAST_0)  # matrices and embeddings (ndim >= 2) only
    beta1: float = field(default=0.9, metadata=_BETA)
    beta2: float = field(default=0.95, metadata=_BETA)
    eps: float = field(default=1e-8, metadata=_POSITIVE)
    grad_clip: float = field(default=1.0, metadata=_AT_LEAST_0)  # max global grad norm; 0 disables clipping
    seed: int = field(default=0, metadata=_AT_LEAST_0)
    data: str = field(default="stdlib", metadata=_NONEMPTY)  # "stdlib" | a .txt/.jsonl file or a folder of them
    tokenizer: str = field(default="bytes", metadata=_NONEMPTY)  # "bytes" | path of a HF tokenizer.json
    max_corpus_bytes: int = field(default=16_000_000, metadata=_AT_LEAST_1)
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: fp32 on CPU; on GPU workload.dtype if given, else bf16
    optimizer_impl: Literal["auto", "fused", "foreach", "for-loop"] = "auto"  # auto: fused (GPU and CPU)
    log_every: int = field(default=1, metadata=_AT_LEAST_1)
    profile_step: int = field(default=2, metadata=_AT_LEAST_0)  # CPU: step whose peak memory is measured; 0 = never
    tensorboard: bool = True
    spmd_typecheck: bool = False  # spmd_types backend: run every step under the spmd_types checker (debug)
    expert_bias_gamma: float = field(default=1e-3, metadata=_AT_LEAST_0)  # MoE aux-loss-free balancing: bias
    #                                 step per optimizer step (load_balance_bias)
    pg_timeout_s: int = field(default=300, metadata=_AT_LEAST_1)  # collective timeout: a stuck rank fails
    checkpoint_every: int = field(default=0, metadata=_AT_LEAST_0)  # save every K steps and at the end; 0 = never
    keep_checkpoints: int = field(default=3, metadata=_AT_LEAST_0)  # complete checkpoints kept; 0 = keep all
    checkpoint_dir: str = ""        # default <run_dir>/checkpoints
    async_checkpoint: bool = False  # write in a background process while training continues
    async_checkpoint_cpu_share: float = field(default=0.1, metadata={"min": 0, "max": 1, "open": "left"})
    #                                 the background writer pauses so its CPU time stays <= this fraction
    #                                 of wall time (short slices disturb training far less); 1 = no pauses
    resume: str = ""                # "" | "latest" | a checkpoint folder | a folder of them (titan-run --resume)

    def __post_init__(self) -> None:
        v = self.async_checkpoint_cpu_share
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not 0.0 < v <= 1.0:
            raise ConfigError("train key 'async_checkpoint_cpu_share' must be in (0, 1] (a fraction of one core), "
                              f"got {v!r}")
        check_fields(self, where="train", error=ConfigError)   # built in code: the same rules as a file

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"'train' must be a mapping of train keys, got {type(d).__name__}")
        return from_mapping(cls, d, where="train", error=ConfigError)




@dataclass(frozen=True, kw_only=True)
class RunConfig:
    plan: Plan
    model: str                      # preset name or path
    spec: ModelSpec
    hardware: str | None            # preset name or path; None -> chosen from the device
    workload: Workload              # seq_len, global batch (sequences), dtype, ...
    train: TrainConfig
    source: str                     # plan file path, or "default"
    resolved: dict = field(default_factory=dict)   # the plan-file dict after overrides
    # the plan file's ``predicted`` block (titan-plan's figures) when the run is what was predicted: the
    # file's model, hardware, plan and workload, no --set outside train.*; None otherwise
    prediction: dict | None = None

    @property
    def seq_len(self) -> int:
        return self.workload.seq_len

    @property
    def global_batch(self) -> int:
        return self.workload.global_batch

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
        return parse_yaml(raw, error=ConfigError, where="--set") if raw.strip() else ""
    except ConfigError:
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
    parsed = parse_overrides(overrides)
    predicted = raw.get("predicted")
    # titan-plan's prediction holds for the run only while nothing it was made for is overridden
    prediction = (dict(predicted) if isinstance(predicted, Mapping)
                  and all(k.split(".", 1)[0] == "train" for k, _ in parsed) else None)
    raw = apply_overrides(raw, parsed)
    if steps is not None:
        raw = apply_overrides(raw, [("train.steps", steps)])
    check_keys(raw, TOP_LEVEL_KEYS, where=str(plan_path) if plan_path else "config", error=ConfigError)
    for k in ("plan", "train", "workload"):
        if k in raw and raw[k] is not None and not isinstance(raw[k], Mapping):
            raise ConfigError(f"'{k}' must be a mapping, got {type(raw[k]).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ConfigError(f"the world size must be in 1..{MAX_WORLD_SIZE:,}, got {show(world_size)}")
    model_name = DEFAULT_MODEL if raw.get("model") is None else raw["model"]
    if not isinstance(model_name, str):
        raise ConfigError("'model' must be a preset name or the path of a model YAML file, "
                          f"got {show(model_name)}")
    try:
        spec = load_model(model_name)
    except SpecError as e:
        raise ConfigError(str(e)) from None
    hardware = raw.get("hardware")
    if isinstance(hardware, Mapping):   # titan-plan may write the spec inline: use its name
        hardware = hardware.get("name")
    if hardware is not None:
        if not isinstance(hardware, str):
            raise ConfigError(f"'hardware' must be a preset name or the path of a hardware YAML file, "
                              f"got {show(hardware)}")
        try:
            load_hardware(hardware)
        except SpecError as e:
            raise ConfigError(str(e)) from None

    given = dict(raw.get("workload") or {})
    check_keys(given, WORKLOAD_KEYS, where="workload", error=ConfigError)
    plan_dict = dict(raw.get("plan") or {})
    if not plan_path:
        plan_dict = default_plan_dict(plan_dict, world_size, given.get("global_batch", DEFAULT_GLOBAL_BATCH))
    try:
        plan = Plan.from_dict(plan_dict)
    except PlanError as e:
        raise ConfigError(str(e)) from None
    except TypeError as e:
        raise ConfigError(f"plan: {e}") from None
    try:
        workload = from_mapping(Workload, {"seq_len": DEFAULT_SEQ_LEN, "global_batch": plan.global_batch(), **given},
                                where="workload", error=SpecError)
    except SpecError as e:
        raise ConfigError(str(e)) from None
    train = TrainConfig.from_dict(raw.get("train") or {})
    raw["model"], raw["plan"] = model_name, plan.to_dict()
    raw["workload"] = {**given, "seq_len": workload.seq_len, "global_batch": workload.global_batch}
    raw["train"] = dataclasses.asdict(train)
    cfg = RunConfig(plan=plan, model=model_name, spec=spec, hardware=hardware, workload=workload, train=train,
                    source=str(plan_path) if plan_path else "default", resolved=raw, prediction=prediction)
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
# workload keys that describe other frameworks to the planner: (key, titan-run runs it, what titan-run does)
_OTHER_FRAMEWORKS = (
    ("selective_ac", lambda wl: wl.selective_policy in ("matmul", "op"),
     "titan-run's selective checkpointing keeps every matmul output or every other one, TorchTitan's per-op "
     "policy (auto, matmul or op"),
    ("norm_impl", lambda wl: wl.norm_impl == "auto", "titan-run's norm is eager, fused under compile (auto"),
    ("swiglu_impl", lambda wl: wl.swiglu_fused and not wl.swiglu_recomputes_product,
     "titan-run's SwiGLU is one activation Function keeping gate and up (auto or fused"),
    ("gqa_kv", lambda wl: not wl.gqa_kv_expanded,
     "titan-run passes GQA's K and V to SDPA as they are, enable_gqa (auto or native"),
    ("grad_accum", lambda wl: wl.grad_accum_mode == "autograd",
     "titan-run accumulates gradients with autograd (auto or autograd"),
    ("loss_impl", lambda wl: wl.loss_impl != "fused",
     "titan-run's loss is its fused Function or compiled with the blocks under compile at tp 1 (auto), "
     "F.cross_entropy (eager) or that compiled under compile at tp 1 (compiled"),
    ("ep_a2a_overlap", lambda wl: wl.ep_a2a_overlap == "none",
     "titan-run runs each MoE all-to-all in its own micro-batch's forward and backward (none"),
    ("moe_weighting", lambda wl: wl.moe_weighting != "activation",
     "titan-run weights the expert outputs at the combine (auto or combine"),
    ("ep_dispatch", lambda wl: wl.ep_dispatch != "per_node",
     "titan-run sends every routed copy in one all-to-all (auto or every_copy"),
    ("pp_sent_tensors", lambda wl: wl.pp_sent_mode == "released",
     "titan-run's pipelining lets a sent stage output go once its gradient is back and a sent input gradient "
     "once the peer has used it (auto or released"),
    ("pp_recv_buffers", lambda wl: not wl.pp_recv_persistent,
     "titan-run's stages receive into a fresh buffer per micro-batch (auto or per_microbatch"),
    ("tp_comm_overlap", lambda wl: wl.tp_comm_overlap in ("auto", "none"),
     "titan-run runs each TP collective on its own, not pipelined with the matmul (auto or none"),
    ("dp_comm_overlap", lambda wl: wl.dp_comm_overlap != "none",
     "titan-run's FSDP2 prefetches its all-gathers and overlaps its reduce-scatters (auto or full"),
    ("moment_dtype", lambda wl: wl.moment_dtype == "fp32",
     "titan-run's AdamW keeps fp32 moments on its fp32 master parameters (fp32"),
    ("expert_tp", lambda wl: not wl.experts_tp_split,
     "titan-run keeps a MoE layer's experts whole on every TP rank (auto or 1"),
    ("master_dtype", lambda wl: wl.master_dtype == "fp32",
     "titan-run's parameters are the optimizer's fp32 master copy (fp32"),
    ("float8_cache", lambda wl: wl.float8_cache == "auto",
     "titan-run's float8 linears (torchao, tensorwise) keep their high-precision inputs (auto"),
)


def grad_sync_error(plan: Plan, grad_sync: str) -> str | None:
    """Why titan-run's pipeline cannot run workload ``pp_grad_sync`` = `grad_sync` for `plan` (one line), or
    None.  The split-backward (V) schedules compute the weight gradients in a later pass than the input
    gradients, after FSDP's post-backward hook of the micro-batch has run, so a reduce-scatter per
    micro-batch would miss them (``parallel/pipeline.py``)."""
    if grad_sync == "every_microbatch" and plan.pp > 1 and plan.is_v_schedule:
        return (f"workload key 'pp_grad_sync' is 'every_microbatch', but titan-run's schedule {plan.schedule} "
                "computes the weight gradients after the micro-batch's reduce-scatter would run (use GPipe, 1F1B "
                "or Interleaved1F1B, or pp_grad_sync: last_microbatch)")
    return None


def _check_workload_runs(wl, plan: Plan) -> None:
    """Refuse, in one line, a workload key whose value titan-run does not run itself."""
    if wl.state_layout != "fsdp2":
        raise ConfigError(f"workload key 'state_layout' is '{wl.state_layout}', but titan-run keeps its state as "
                          "fsdp2 (the other layouts describe other frameworks to the planner)")
    if wl.attention_impl != "fused" or wl.dropout:
        key = "attention_impl" if wl.attention_impl != "fused" else "dropout"
        raise ConfigError(f"workload key '{key}' is {show(getattr(wl, key))}, but titan-run runs fused attention "
                          "without dropout (that key describes other frameworks to the planner)")
    for key, runs, does in _OTHER_FRAMEWORKS:
        if not runs(wl):
            raise ConfigError(f"workload key '{key}' is {show(getattr(wl, key))}, but {does}; that key describes "
                              "other frameworks to the planner)")
    err = grad_sync_error(plan, wl.pp_grad_sync)
    if err:
        raise ConfigError(err)
    if not wl.tp_keeps_gathered and plan.tp > 1:    # sharded: spmd_tensor_parallel keeps the sequence shards
        for bad, why in (
                (plan.backend != "spmd_types",
                 f"backend {show(plan.backend)}: sequence shards are kept on backend spmd_types only (set backend: "
                 "spmd_types, or"),
                (plan.compile, "compile: sequence shards are kept in eager mode only (set compile: false, or"),
                (plan.float8, "float8: float8 linears save their own inputs, the gathered ones (set float8: "
                              "false, or"),
                (plan.ac == "selective", "ac 'selective': sequence shards are kept with ac none or full (or")):
            if bad:
                raise ConfigError(f"workload key 'tp_activations' is {show(wl.tp_activations)} with {why} set "
                                  "tp_activations: gathered)")


def validate(cfg: RunConfig, world_size: int) -> None:
    """Every check that can run before a process group exists."""
    plan = cfg.plan
    check_plan_runs(plan, cfg.spec, cfg.workload, world_size)
    if plan.pp > 1 and not _module_exists("executor.parallel.pipeline"):
        raise ConfigError("plan key 'pp' > 1 needs executor/parallel/pipeline.py, which is not installed")
    if plan.cp > 1 and not _module_exists("executor.parallel.context_parallel"):
        raise ConfigError("plan key 'cp' > 1 needs executor/parallel/context_parallel.py, which is not installed")
    if plan.float8 and not _module_exists("torchao"):
        raise ConfigError("plan key 'float8' is true but torchao is not installed (pip install torchao)")
    tok = check_tokenizer(cfg.train.tokenizer, cfg.spec)     # it loads, its vocabulary fits (executor/tokenizer.py)
    if cfg.train.data != "stdlib" and not _exists(Path(cfg.train.data)):
        raise ConfigError(f"train key 'data': {show(cfg.train.data)} does not exist (a .txt/.jsonl file, a folder, "
                          "or 'stdlib')")
    check_corpus(cfg.train.data, tok, cfg.train.max_corpus_bytes, seq_len=cfg.seq_len,   # executor/data.py
                 global_batch=cfg.global_batch)


def check_plan_runs(plan: Plan, spec, wl, world_size: int) -> None:
    """Whether titan-run runs `plan` of model `spec` under workload `wl` on `world_size` ranks, whatever this
    machine has installed: the plan's degrees and rules, the model's, the workload keys, the backend's (raises
    ConfigError in one line).  ``titan-plan`` writes only plans that pass (tests/test_written_plans_run.py)."""
    try:
        plan.check_world(world_size)
    except PlanError as e:
        raise ConfigError(str(e)) from None
    target = Target.of(spec, world_size=world_size, seq_len=wl.seq_len, global_batch=wl.global_batch,
                       gpus_per_node=max(world_size, 1), pp_weighted=wl.pp_weighted)
    if plan.ep > 1 and not spec.is_moe:
        raise ConfigError(f"plan key 'ep' is {plan.ep} but model '{spec.name}' is dense (no experts): "
                          "expert parallelism needs a mixture-of-experts model (set ep: 1)")
    err = model_build_error(spec)   # cost-model facts of other frameworks' models (BLOOM's embedding norm, MTP)
    if err:
        raise ConfigError(err)
    problems = check_plan(plan, target, tp_within_node=False)
    if problems:
        reason, msg = problems[0]
        raise ConfigError(f"plan does not fit: {msg} ({reason})")
    if wl.seq_len > spec.max_seq_len:
        raise ConfigError(f"workload key 'seq_len' ({wl.seq_len}) is more than model '{spec.name}' allows "
                          f"(max_seq_len {spec.max_seq_len})")
    _check_workload_runs(wl, plan)
    for err in (replicate_split_backward_error(plan, plan.backend), float8_tp_backend_error(plan, plan.backend),
                tied_tp_backend_error(plan, plan.backend, spec.tie_embeddings)):
        if err:
            raise ConfigError(err)


def _exists(p: Path, *, file: bool = False) -> bool:
    try:
        return p.is_file() if file else p.exists()
    except OSError:             # e.g. a name too long
        return False


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def dump_resolved(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.resolved, sort_keys=False)
