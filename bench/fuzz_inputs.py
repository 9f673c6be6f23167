"""Input fuzzer (issue 15): every clearly bad input ends in one line and exit code 2.

    python bench/fuzz_inputs.py                 # long run: every generated case in-process, 240 through the CLIs
    python bench/fuzz_inputs.py --cli 0         # in-process only (a few minutes)
    python bench/fuzz_inputs.py --sample 8      # every 8th case (what tests/test_fuzz_inputs.py runs)

Cases are generated, not recorded: from the shipped presets and plan shapes, each key
of a model spec, a hardware spec, a calibration file, a search space, a plan file's
``plan`` / ``workload`` / ``train`` sections and each count flag gets values that are
wrong by construction (wrong type, bool for a number, NaN, infinity, negative, zero
where a count >= 1 is needed, huge integers, unknown choices, typos of keys), plus
files that are not YAML (binary, NUL bytes, empty, a folder, a device, a pipe, a name
too long, missing, a 919-byte alias bomb, 17 MiB, nested 100,000 deep) and ``--out``
onto a symlink, a device node, a pipe, a folder.  A few valid inputs run as controls
(they must be accepted, so the fuzzer cannot pass by refusing everything).

Targets: ``titan-plan`` (planner/cli.main, in-process) and ``titan-run --dry-run``
(executor/dry_run.main, in-process: it validates exactly like the launcher, before
any process starts); ``--cli N`` runs N of the cases again through the real
console commands in subprocesses.

Outcomes: ``one line + exit 2`` (the only good one for a bad input; ``--out`` onto a
symlink may also write through the link: ``written through link``), ``accepted``
(exit 0), ``several lines`` (exit 2 but more than one line), ``traceback`` (an
exception escaped, or another exit code), ``hang`` (past the timeout), ``clobbered``
(a link, device, pipe or folder given as --out was replaced).  The last line printed
is the headline figure.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models.specs import PRESET_DIR  # noqa: E402

GOOD = "one line + exit 2"
THROUGH = "written through link"
OUTCOMES = (GOOD, THROUGH, "accepted", "several lines", "traceback", "hang", "clobbered")
TIMEOUT_S = 30.0                # in-process; a case past it is a hang
CLI_TIMEOUT_S = 120.0           # subprocess (imports torch on a busy machine)

HUGE = 99999999999999999999999          # the issue's --gpus value
BAD_INT = [-1, HUGE, 2 ** 63, True, "8", 1.5, None, [], {}, float("nan")]
BAD_FLOAT = [float("nan"), float("inf"), float("-inf"), "abc", True, None, [1.0], 10 ** 400]
BAD_BOOL = ["yes", 2, None, [], 1.0]
BAD_STR = [5, None, [], {"a": 1}, True]


@dataclass
class Case:
    group: str
    name: str
    target: str                              # "plan" (titan-plan) | "run" (titan-run --dry-run) | "launch" (titan-run)
    argv: list[str]
    files: dict[str, Any] = field(default_factory=dict)   # name -> YAML object | bytes | special marker
    bad: bool = True                         # False: a control that must be accepted
    out: str | None = None                   # a --out target whose kind must survive


@dataclass
class Result:
    case: Case
    outcome: str
    detail: str
    seconds: float


# --------------------------------------------------------------------------- base documents
def _preset(kind: str, name: str) -> dict:
    return yaml.safe_load((PRESET_DIR / kind / f"{name}.yaml").read_text())


BASE_MODEL = _preset("models", "llama3-debug")
BASE_HW = _preset("hardware", "cpu")
BASE_SPACE = yaml.safe_load((ROOT / "search_spaces" / "dense.yaml").read_text())
BASE_RUN = {"model": "llama3-debug", "workload": {"seq_len": 64, "global_batch": 4},
            "plan": {"dp_shard": 2, "microbatch": 2}, "train": {"steps": 2}}
PLAN_ARGS = ["--gpus", "2", "--hardware", "cpu", "--no-write", "--top", "1"]


def _alias_bomb() -> str:
    """The 919-byte 'billion laughs' of the issue: 9 levels of 9 aliases."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for n in "bcdefghi":
        lines.append(f"{n}: &{n} [" + ",".join(["*" + prev] * 9) + "]")
        prev = n
    return "\n".join(lines) + "\n"


# special files: a marker string names what to create
SPECIAL_FILES = {
    "missing": "@missing", "folder": "@dir", "binary": b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4,
    "nul-bytes": b"dim: 1\x00\x00\n", "latin-1": "dim: 25\xe9\n".encode("latin-1"), "empty": b"",
    "a-list": b"- 1\n- 2\n", "a-scalar": b"42\n", "malformed": b"dim: [1, 2\nn_layers: {\n",
    "tabs": b"dim:\t\t- 1\n\t- x: [\n", "alias-bomb": _alias_bomb().encode(), "recursive-alias": b"a: &a [*a]\n",
    "17MiB": "@big", "deep-nesting": b"[" * 100_000, "name-too-long": "@longname", "pipe": "@fifo",
    "device": "@device", "dangling-link": "@dangling",
}


def _mutations(base: dict, types: dict[str, list]) -> list[tuple[str, dict]]:
    """(label, document) with one key of `base` set to each bad value of its type."""
    out = []
    for key, bads in types.items():
        for v in bads:
            d = copy.deepcopy(base)
            d[key] = v
            out.append((f"{key}={_label(v)}", d))
    return out


def _label(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 24 else s[:21] + "..."


def _typo(key: str) -> str:
    return key[:-1] if len(key) > 3 else key + "x"


# --------------------------------------------------------------------------- generators
MODEL_INT_POSITIVE = ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden", "n_kv_heads", "head_dim",
                      "max_seq_len")
MODEL_INT_COUNT = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                   "n_experts", "top_k", "moe_ffn_hidden", "n_shared_experts", "n_dense_layers")
MODEL_FLOAT_POSITIVE = ("rope_theta", "norm_eps", "route_scale")
MODEL_CHOICES = {"mlp": ["relu", "SwiGLU", ""], "norm": ["batchnorm"], "attention": ["mha", "flash"],
                 "score_func": ["tanh"]}


def model_docs() -> list[tuple[str, dict]]:
    types: dict[str, list] = {}
    for k in MODEL_INT_POSITIVE:
        types[k] = [0] + BAD_INT
    for k in MODEL_INT_COUNT:
        types[k] = BAD_INT
    for k in MODEL_FLOAT_POSITIVE:
        types[k] = [0.0, -1.0] + BAD_FLOAT
    types["aux_loss_coef"] = [-0.5] + BAD_FLOAT
    for k, extra in MODEL_CHOICES.items():
        types[k] = extra + BAD_STR
    for k in ("tie_embeddings", "route_norm", "load_balance_bias"):
        types[k] = BAD_BOOL
    types["name"] = ["", *BAD_STR]
    out = _mutations(BASE_MODEL, types)
    for k in MODEL_INT_POSITIVE[:6]:                   # in range for the reader, absurd for a model
        for v in (2 ** 40, 2 ** 52):
            out.append((f"{k}={_label(v)} (absurd)", {**copy.deepcopy(BASE_MODEL), k: v}))
    for k in BASE_MODEL:
        d = copy.deepcopy(BASE_MODEL)
        d[_typo(k)] = d.pop(k)
        out.append((f"typo {k}", d))
    for k in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden"):
        d = copy.deepcopy(BASE_MODEL)
        del d[k]
        out.append((f"missing {k}", d))
    sem = [("dim 250 with 16 heads", {"dim": 250, "n_heads": 16}), ("n_kv_heads 3 of 8", {"n_kv_heads": 3}),
           ("odd head_dim", {"head_dim": 15}), ("mla without ranks", {"attention": "mla"}),
           ("top_k > n_experts", {"n_experts": 4, "top_k": 5, "moe_ffn_hidden": 64}),
           ("moe without width", {"n_experts": 4, "top_k": 2}),
           ("n_dense_layers > n_layers", {"n_experts": 4, "top_k": 2, "moe_ffn_hidden": 64, "n_dense_layers": 9})]
    out += [(label, {**BASE_MODEL, **ch}) for label, ch in sem]
    return out


HW_FLOAT_POSITIVE = ("peak_tflops_bf16", "peak_tflops_fp32", "memory_gib", "memory_bw_gbs", "intra_node_bw_gbs",
                     "inter_node_bw_gbs")
HW_FLOAT_COUNT = ("peak_tflops_fp8", "intra_node_latency_us", "inter_node_latency_us", "memory_reserved_gib",
                  "kernel_launch_us")


def hardware_docs() -> list[tuple[str, dict]]:
    types: dict[str, list] = {k: [0.0, -1.0] + BAD_FLOAT for k in HW_FLOAT_POSITIVE}
    types.update({k: [-1.0] + BAD_FLOAT for k in HW_FLOAT_COUNT})
    types["memory_reserved_gib"] = [v for v in types["memory_reserved_gib"] if v is not None]  # None: not given
    types["inter_node_bw_gbs"] = [v for v in types["inter_node_bw_gbs"] if v is not None]  # None: from nic_gbps
    types["gpus_per_node"] = [0] + BAD_INT
    types["sm_count"] = [0, -1, HUGE, True, "132", 1.5]
    types["host_cores"] = [0, -1, HUGE, True, "2", 1.5]
    types["device"] = ["tpu", "CUDA", *BAD_STR]
    types["efficiency"] = [{"gemm": 1.5}, {"gemm": 0}, {"gemm": float("nan")}, {"gemm": "x"}, {"gemmm": 0.5},
                           {"gemm": True}, [0.5], "fast"]
    out = _mutations(BASE_HW, types)
    for k in list(BASE_HW)[:12]:
        d = copy.deepcopy(BASE_HW)
        d[_typo(k)] = d.pop(k)
        out.append((f"typo {k}", d))
    return out


def calibration_docs() -> list[tuple[str, dict]]:
    from cost_models.coefficients import Coefficients
    base = Coefficients().to_dict()
    out = []
    for k in base:
        for v in (float("nan"), float("inf") if k != "launch_overlap_sharpness" else float("-inf"), -1.0, "x",
                  True, None):
            out.append((f"{k}={_label(v)}", {"coefficients": {k: v}}))
    for k in list(base)[:8]:
        out.append((f"typo {k}", {"coefficients": {_typo(k): 1.0}}))
    out += [("overlap above 1", {"coefficients": {"dp_overlap": 1.5}}),
            ("imbalance below 1", {"coefficients": {"ep_imbalance": 0.5}}),
            ("coefficients a list", {"coefficients": [1, 2]})]
    return out


def space_docs() -> list[tuple[str, dict]]:
    out = []
    for axis in ("dp_replicate", "pp", "tp", "cp", "ep"):
        for v in ([0], [-2], ["a"], [HUGE], [1.5], [True], "some", 5, [], None, [float("nan")]):
            d = copy.deepcopy(BASE_SPACE)
            d["degrees"][axis] = v
            out.append((f"degrees.{axis}={_label(v)}", d))
    for knob, bads in (("microbatch", ([0], [-1], [HUGE], ["x"], [], [True])),
                       ("schedule", (["1f1b"], [3], [])), ("stages_per_rank", ([0], [HUGE], ["2"])),
                       ("ac", (["some"], [True])), ("compile", (["yes"], [2])), ("backend", (["jax"],))):
        for v in bads:
            d = copy.deepcopy(BASE_SPACE)
            d["knobs"][knob] = list(v)
            out.append((f"knobs.{knob}={_label(v)}", d))
    for k in ("degrees", "knobs", "tp_within_node", "name"):
        d = copy.deepcopy(BASE_SPACE)
        d[_typo(k)] = d.pop(k)
        out.append((f"typo {k}", d))
    out += [("tp_within_node a string", {**copy.deepcopy(BASE_SPACE), "tp_within_node": "yes"}),
            ("degrees a list", {**copy.deepcopy(BASE_SPACE), "degrees": [1, 2]}),
            ("unknown knob", {**copy.deepcopy(BASE_SPACE), "knobs": {**BASE_SPACE["knobs"], "fp4": [True]}})]
    return out


PLAN_FLAG_BADS = {
    "--gpus": ["0", "-1", str(HUGE), str(2 ** 63), str(2 ** 20 + 1)],
    "--gpus-per-node": ["0", "-4", str(HUGE)],
    "--nic-gbps": ["0", "-100", "nan", "inf", "x"],
    "--gpus-per-nic": ["0", "-2", "nan", "inf"],
    "--seq-len": ["0", "-1", str(HUGE)],
    "--global-batch": ["0", "-8", str(HUGE)],
    "--global-batch-tokens": ["abc", "0", "1.5", "-4M", "4X", "99999999999999999999999G", "nan", "inf", "100"],
    "--dry-run": ["-1", "-839"],
    "--memory-margin": ["nan", "inf", "-0.1", "1.0", "7"],
    "--model": ["", " ", "llama9", "/nonexistent/model.yaml", "x" * 5000],
    "--hardware": ["", "tpu-v5", "/nonexistent.yaml", "y" * 5000],
    "--space": ["bogus", "/nonexistent.yaml", "z" * 5000],
    "--calibration": ["/nonexistent.yaml", "/", "q" * 5000],
    "--top": ["0", "-3"],
    "--trials": ["-1"],
    "--trial-steps": ["0", "-2"],
    "--trial-timeout": ["0", "-5", "nan", "inf"],
}
ESTIMATE_FLAG_BADS = {
    "--tp": ["0", "3", "-2", str(HUGE)], "--pp": ["0", "64", str(2 ** 63)], "--cp": ["0", "3"],
    "--ep": ["0", "2"], "--dp-shard": ["0", "3", str(HUGE)], "--dp-replicate": ["0", "5"],
    "--microbatch": ["0", "3", str(HUGE)], "--stages-per-rank": ["0", "9"], "--schedule": ["1f2b", ""],
    "--ac": ["some", ""], "--plan": ["/nonexistent.yaml", "/"],
}


def estimate_plan_docs() -> list[tuple[str, dict]]:
    """Plan files as titan-plan writes them, each with one mistake (titan-plan estimate --plan)."""
    base = {"model": "llama3-debug", "hardware": "cpu", "workload": {"seq_len": 64, "global_batch": 8},
            "plan": {"dp_shard": 2, "microbatch": 4}, "inputs": {"gpus": 2, "gpus_per_node": 2}}
    out = []
    for key, bads in (("gpus", [0, -1, "x", HUGE, True, 1.5]), ("gpus_per_node", [0, "x", HUGE, -2]),
                      ("nic_gbps", [0, "x", -1, True, float("nan")]), ("gpus_per_nic", [0, "x", True])):
        for v in bads:
            d = copy.deepcopy(base)
            d["inputs"][key] = v
            out.append((f"inputs.{key}={_label(v)}", d))
    for key, bads in (("seq_len", [0, "x", HUGE, -5]), ("global_batch", [0, "x", 3, HUGE]),
                      ("dtype", ["fp8", 3]), ("state_layout", ["bogus"]), ("zero", [-1, "x"])):
        for v in bads:
            d = copy.deepcopy(base)
            d["workload"][key] = v
            out.append((f"workload.{key}={_label(v)}", d))
    for top, v in (("model", ""), ("model", 5), ("model", "llama9"), ("hardware", 5), ("hardware", "tpu"),
                   ("hardware", ""), ("inputs", [1]), ("workload", "x"), ("plan", [1]), ("plan", "tp2")):
        d = copy.deepcopy(base)
        d[top] = v
        out.append((f"{top}={_label(v)}", d))
    for k in ("plan", "model"):
        d = copy.deepcopy(base)
        del d[k]
        out.append((f"no {k}", d))
    return out


def plan_cases() -> list[Case]:
    cases = []
    for label, doc in model_docs():
        cases.append(Case("model spec", label, "plan", ["--model", "{f}"] + PLAN_ARGS, {"f": doc}))
    for label, doc in hardware_docs():
        cases.append(Case("hardware spec", label, "plan", ["--gpus", "2", "--hardware", "{f}", "--no-write"],
                          {"f": doc}))
    for label, doc in calibration_docs():
        cases.append(Case("calibration file", label, "plan", PLAN_ARGS + ["--calibration", "{f}"], {"f": doc}))
    for label, doc in space_docs():
        cases.append(Case("search space", label, "plan", PLAN_ARGS + ["--space", "{f}"], {"f": doc}))
    for flag, bads in PLAN_FLAG_BADS.items():
        for v in bads:
            argv = [a for a in PLAN_ARGS]
            if flag in argv:
                i = argv.index(flag)
                del argv[i:i + 2]
            if flag == "--trials":
                argv += ["--storage", "sqlite:///{d}/t.db"]
            cases.append(Case("titan-plan flags", f"{flag} {_label(v)}", "plan", argv + [flag, v]))
    cases.append(Case("titan-plan flags", "--trials 1 --storage bogus://x", "plan",
                      PLAN_ARGS + ["--trials", "1", "--storage", "bogus://x"]))
    cases.append(Case("titan-plan flags", "--trials 1 --storage sqlite in a missing folder", "plan",
                      PLAN_ARGS + ["--trials", "1", "--storage", "sqlite:////nonexistent/dir/t.db"]))
    for label, doc in estimate_plan_docs():
        cases.append(Case("titan-plan estimate --plan", label, "plan",
                          ["estimate", "--plan", "{f}"], {"f": doc}))
    (Path(tempfile.gettempdir()) / "fuzz-not-a-db.db").write_text("hello\n")
    for storage in ("sqlite:////nonexistent/x.db", "sqlite:///" + tempfile.gettempdir() + "/fuzz-not-a-db.db",
                    "sqlite:///" + tempfile.gettempdir(), "bogus", "bogus://x", "sqlite:///{d}/empty.db"):
        cases.append(Case("titan-plan calibrate/profile", f"calibrate --storage {storage}", "plan",
                          ["calibrate", "--storage", storage, "--out", "{d}/cal.yaml"]))
    for argv in (["profile", "--nproc", "0"], ["profile", "--nproc", str(HUGE)], ["profile", "--max-bytes", "0"],
                 ["profile", "--out", ""], ["calibrate", "--out", ""]):
        cases.append(Case("titan-plan calibrate/profile", " ".join(argv), "plan", argv))
    for flag, bads in ESTIMATE_FLAG_BADS.items():
        for v in bads:
            cases.append(Case("titan-plan estimate", f"{flag} {_label(v)}", "plan",
                              ["estimate", "--gpus", "8", "--hardware", "cpu", "--global-batch", "16", flag, v]))
    for kind, flag in (("model", "--model"), ("hardware", "--hardware"), ("space", "--space"),
                       ("calibration", "--calibration")):
        for label, content in SPECIAL_FILES.items():
            argv = (PLAN_ARGS + [flag, "{f}"]) if flag != "--hardware" else ["--gpus", "2", "--no-write", flag, "{f}"]
            cases.append(Case(f"{kind} file, not YAML", label, "plan", argv, {"f": content}))
    for label, marker in (("symlink to a plan file", "@link"), ("dangling symlink", "@dangling"),
                          ("device node", "@device"), ("pipe", "@fifo"), ("folder", "@dir"),
                          ("symlink to a folder", "@link-dir"), ("symlink to a device", "@link-device")):
        argv = ["--gpus", "2", "--hardware", "cpu", "--top", "1", "--out", "{f}"]
        cases.append(Case("--out target", label, "plan", argv, {"f": marker}, out=marker))
    return cases


PLAN_KEY_BADS = {"dp_replicate": [0] + BAD_INT, "dp_shard": [0] + BAD_INT, "pp": [0, 64] + BAD_INT,
                 "tp": [0, 3] + BAD_INT, "cp": [0, 3] + BAD_INT, "ep": [0, 2] + BAD_INT,
                 "microbatch": [0, 3] + BAD_INT, "n_microbatches": [0, 3] + BAD_INT,
                 "stages_per_rank": [0, 2] + BAD_INT, "schedule": ["1f1b", "ZBV", *BAD_STR],
                 "ac": ["some", "Full", *BAD_STR], "backend": ["jax", *BAD_STR],
                 "reshard_after_forward": BAD_BOOL, "compile": BAD_BOOL, "float8": ["yes", 2, None]}
TRAIN_KEY_BADS = {
    "steps": [0, -1] + BAD_INT, "lr": [-1e-3] + BAD_FLOAT, "min_lr_ratio": [5.0, -0.1] + BAD_FLOAT,
    "warmup": [-1, HUGE, True, 1.5], "weight_decay": [-0.1] + BAD_FLOAT, "beta1": [1.0, 2.0, -0.1] + BAD_FLOAT,
    "beta2": [1.0, 2.0, -0.5] + BAD_FLOAT, "eps": [0.0, -1e-8] + BAD_FLOAT, "grad_clip": [-1.0] + BAD_FLOAT,
    "seed": [-1, HUGE, 2 ** 64, True, "0"], "data": ["", "/nonexistent/corpus.txt", 5, None],
    "tokenizer": ["", "/nonexistent/tokenizer.json", "bites", 5], "max_corpus_bytes": [0, -1, HUGE, True],
    "dtype": ["fp16", "float32", "", 16], "optimizer_impl": ["adam", "fused ", 1], "log_every": [0, -1, 1.5],
    "profile_step": [-1, HUGE, "2"], "tensorboard": BAD_BOOL, "expert_bias_gamma": [-1.0] + BAD_FLOAT[:4],
    "pg_timeout_s": [0, -5, HUGE, 1.5], "checkpoint_every": [-1, HUGE, True], "keep_checkpoints": [-1, "all"],
    "checkpoint_dir": [5, []], "async_checkpoint": BAD_BOOL, "async_checkpoint_cpu_share": [0.0, 1.5, -1.0,
                                                                                             float("nan")],
    "resume": [5, True],
}
WORKLOAD_KEY_BADS = {"seq_len": [0, -1, 100000, 1025, HUGE, True, "64", 1.5, None],
                     "global_batch": [0, -4, 3, HUGE, True, "4", 2.5],
                     "dtype": ["fp8", "float16", "", 16, None], "state_layout": ["bogus", "megatron", 1],
                     "zero": [-1, "1", True], "attention_impl": ["sdpa", "materialized"],
                     "dropout": ["no", 1, True], "sequence_parallel": ["no", 1], "selective_ac": ["all", 3],
                     "grad_dtype": ["fp16", "bf16", 2], "loss_impl": ["liger", "fused", 1],
                     "grad_accum": ["deepspeed", "hp_copy", 0]}


def run_docs() -> list[tuple[str, str, dict, list[str]]]:
    """(group, label, plan-file document, extra argv) for titan-run --dry-run."""
    out = []

    def put(group, label, section, key, v):
        d = copy.deepcopy(BASE_RUN)
        d.setdefault(section, {})[key] = v
        out.append((group, label, d, []))

    for k, bads in PLAN_KEY_BADS.items():
        for v in bads:
            put("plan file: plan", f"{k}={_label(v)}", "plan", k, v)
    for k, bads in TRAIN_KEY_BADS.items():
        for v in bads:
            put("plan file: train", f"{k}={_label(v)}", "train", k, v)
    for k, bads in WORKLOAD_KEY_BADS.items():
        for v in bads:
            put("plan file: workload", f"{k}={_label(v)}", "workload", k, v)
    for sec in ("plan", "train", "workload"):
        d = copy.deepcopy(BASE_RUN)
        d[sec] = {**d[sec], "bogus_key": 1}
        out.append(("plan file: keys", f"unknown {sec} key", d, []))
        d = copy.deepcopy(BASE_RUN)
        d[sec] = [1, 2]
        out.append(("plan file: keys", f"{sec} a list", d, []))
    for top in ("trian", "plna", "modle", "workloads", "hardwre", "predicted_", "x"):
        d = copy.deepcopy(BASE_RUN)
        d[top] = {"steps": 3}
        out.append(("plan file: keys", f"top-level '{top}'", d, []))
    for v in ("llama9", "", "/nonexistent.yaml", 5, ["llama3-debug"], {"dim": 3}):
        d = copy.deepcopy(BASE_RUN)
        d["model"] = v
        out.append(("plan file: keys", f"model={_label(v)}", d, []))
    for v in ("tpu-v5", 5, "/nonexistent.yaml"):
        d = copy.deepcopy(BASE_RUN)
        d["hardware"] = v
        out.append(("plan file: keys", f"hardware={_label(v)}", d, []))
    for w in ("3", "4", "1", "0", "-1", str(HUGE), str(2 ** 21)):
        out.append(("world size", f"--world {w} for a plan of 2", copy.deepcopy(BASE_RUN), ["--world", w]))
    for s in ("bogus=1", "plan.tp=abc", "=1", "noequals", "train.lr=nan", "train.steps=0", "tp=0",
              "plans.tp=2", "workload.seq_len=100000", "train.beta1=2.0", "model=", "train.lr=[&a [1], *a]",
              "train.trian=1", f"plan.dp_shard={HUGE}"):
        out.append(("--set", s, copy.deepcopy(BASE_RUN), ["--set", s]))
    return out


def _yaml_scalar(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def set_cases() -> list[Case]:
    """Each bad plan/train/workload value again as a --set override of a good plan file."""
    cases = []
    for sec, pool in (("plan", PLAN_KEY_BADS), ("train", TRAIN_KEY_BADS), ("workload", WORKLOAD_KEY_BADS)):
        for key, bads in pool.items():
            for v in bads:
                if isinstance(v, str) and _yaml_scalar(v) != v:
                    continue                 # a string that YAML reads as something else: not the same case
                cases.append(Case(f"--set {sec}.*", f"{key}={_label(v)}", "run",
                                  ["--plan", "{f}", "--set", f"{sec}.{key}={_yaml_scalar(v)}"], {"f": BASE_RUN}))
    return cases


def launch_cases() -> list[Case]:
    """titan-run itself (the launcher, not --dry-run): refused before torchrun starts."""
    argv = ["--plan", "{f}", "--run-dir", "{d}/run"]
    cases = [Case("titan-run launcher", f"--nproc-per-node {n} for a plan of 2", "launch",
                  argv + ["--nproc-per-node", n], {"f": BASE_RUN}) for n in ("1", "3", "4", "0", "-2", str(HUGE))]
    cases += [Case("titan-run launcher", f"--steps {n}", "launch", argv + ["--steps", n], {"f": BASE_RUN})
              for n in ("0", "-1", str(HUGE))]
    cases += [Case("titan-run launcher", f"--max-restarts {n}", "launch", argv + ["--max-restarts", n],
                   {"f": BASE_RUN}) for n in ("-1",)]
    cases += [Case("titan-run launcher", f"--resume {r}", "launch", argv + ["--resume", r], {"f": BASE_RUN})
              for r in ("/nonexistent/ckpt", "{d}")]
    for label, content in list(SPECIAL_FILES.items())[:10]:
        cases.append(Case("titan-run launcher", f"plan file: {label}", "launch", argv, {"f": content}))
    for k, v in (("lr", float("nan")), ("beta2", 2.0), ("steps", 0), ("grad_clip", float("inf"))):
        cases.append(Case("titan-run launcher", f"train.{k}={v}", "launch", argv,
                          {"f": {**copy.deepcopy(BASE_RUN), "train": {k: v}}}))
    cases.append(Case("titan-run launcher", "seq_len 100000 > max_seq_len", "launch", argv,
                      {"f": {**copy.deepcopy(BASE_RUN), "workload": {"seq_len": 100000, "global_batch": 4}}}))
    cases.append(Case("titan-run launcher", "top-level trian", "launch", argv,
                      {"f": {**copy.deepcopy(BASE_RUN), "trian": {"steps": 1}}}))
    return cases


def run_cases(model_every: int = 1) -> list[Case]:
    cases = set_cases() + launch_cases()
    for group, label, doc, extra in run_docs():
        cases.append(Case(group, label, "run", ["--plan", "{f}"] + extra, {"f": doc}))
    for i, (label, doc) in enumerate(model_docs()):       # the model specs through titan-run too
        if i % model_every == 0:
            cases.append(Case("plan file: model spec", label, "run", ["--plan", "{p}"],
                              {"m": doc, "p": {**copy.deepcopy(BASE_RUN), "model": "{m}"}}))
    for label, content in SPECIAL_FILES.items():
        cases.append(Case("plan file, not YAML", label, "run", ["--plan", "{f}"], {"f": content}))
        cases.append(Case("model file (titan-run), not YAML", label, "run", ["--plan", "{p}"],
                          {"m": content, "p": {**copy.deepcopy(BASE_RUN), "model": "{m}"}}))
    return cases


def combo_cases(n: int, seed: int) -> list[Case]:
    """Random bad plan files with 2-3 mistakes each (still bad: every mistake alone is refused)."""
    rng = random.Random(seed)
    pools = [("plan", PLAN_KEY_BADS), ("train", TRAIN_KEY_BADS), ("workload", WORKLOAD_KEY_BADS)]
    cases = []
    for i in range(n):
        d = copy.deepcopy(BASE_RUN)
        labels = []
        for _ in range(rng.randint(2, 3)):
            sec, pool = rng.choice(pools)
            key = rng.choice(sorted(pool))
            v = rng.choice(pool[key])
            d.setdefault(sec, {})[key] = v
            labels.append(f"{sec}.{key}={_label(v)}")
        cases.append(Case("plan file: combinations", " ".join(labels), "run", ["--plan", "{f}"], {"f": d}))
    return cases


def controls() -> list[Case]:
    return [Case("controls", "titan-plan llama3-debug on 2 cpus", "plan", PLAN_ARGS, bad=False),
            Case("controls", "titan-plan with a model file", "plan", ["--model", "{f}"] + PLAN_ARGS,
                 {"f": BASE_MODEL}, bad=False),
            Case("controls", "titan-plan with a hardware file", "plan",
                 ["--gpus", "2", "--hardware", "{f}", "--no-write", "--top", "1"], {"f": BASE_HW}, bad=False),
            Case("controls", "titan-plan with a space file", "plan", PLAN_ARGS + ["--space", "{f}"],
                 {"f": BASE_SPACE}, bad=False),
            Case("controls", "titan-plan estimate", "plan",
                 ["estimate", "--gpus", "8", "--hardware", "cpu", "--global-batch", "16", "--tp", "2"], bad=False),
            Case("controls", "titan-plan estimate --plan", "plan", ["estimate", "--plan", "{f}"],
                 {"f": {"model": "llama3-debug", "hardware": "cpu", "workload": {"seq_len": 64, "global_batch": 8},
                        "plan": {"dp_shard": 2, "microbatch": 4}, "inputs": {"gpus": 2}}}, bad=False),
            Case("controls", "titan-run --dry-run of a plan file", "run", ["--plan", "{f}"], {"f": BASE_RUN},
                 bad=False)]


def all_cases(*, sample: int = 1, combos: int = 600, seed: int = 0) -> list[Case]:
    cases = plan_cases() + run_cases() + combo_cases(combos, seed)
    if sample > 1:
        cases = cases[::sample]
    return controls() + cases


# --------------------------------------------------------------------------- materializing a case
def materialize(case: Case, d: Path) -> list[str]:
    paths = {}
    for name in case.files:
        paths[name] = str(d / f"{name}.yaml")
    for name, content in case.files.items():
        p = Path(paths[name])
        if isinstance(content, dict):
            text = yaml.safe_dump(_fill(content, paths), sort_keys=False)
            p.write_text(text)
        elif isinstance(content, bytes):
            p.write_bytes(content)
        elif content == "@missing":
            paths[name] = str(d / "no" / "such.yaml")
        elif content == "@dir":
            p.mkdir()
        elif content == "@big":
            with open(p, "wb") as f:
                f.write(b"# " + b"x" * (17 * 2 ** 20) + b"\ndim: 1\n")
        elif content == "@longname":
            paths[name] = str(d / ("n" * 4000 + ".yaml"))
        elif content == "@fifo":
            os.mkfifo(p)
        elif content == "@device":
            _device(p)
        elif content == "@dangling":
            os.symlink(d / "nowhere.yaml", p)
        elif content == "@link":
            (d / "real.yaml").write_text("old: content\n")
            os.symlink(d / "real.yaml", p)
        elif content == "@link-dir":
            (d / "adir").mkdir()
            os.symlink(d / "adir", p)
        elif content == "@link-device":
            _device(d / "dev")
            os.symlink(d / "dev", p)
        else:
            raise AssertionError(content)
    subs = {"{d}": str(d), **{"{" + k + "}": v for k, v in paths.items()}}
    out = []
    for a in case.argv:
        for k, v in subs.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def _device(p: Path) -> None:
    """A character device like /dev/null in the case folder (root), else a pipe stands in for it."""
    try:
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError):
        os.mkfifo(p)


def _fill(x: Any, paths: dict[str, str]) -> Any:
    if isinstance(x, dict):
        return {k: _fill(v, paths) for k, v in x.items()}
    if isinstance(x, list):
        return [_fill(v, paths) for v in x]
    if isinstance(x, str) and x.startswith("{") and x.endswith("}") and x[1:-1] in paths:
        return paths[x[1:-1]]
    return x


def out_intact(marker: str, p: Path) -> tuple[bool, bool]:
    """(kind survived, written through a link) for an --out target."""
    d = p.parent
    if marker in ("@link", "@dangling"):
        if not p.is_symlink():
            return False, False
        target = d / ("real.yaml" if marker == "@link" else "nowhere.yaml")
        return True, target.is_file() and "plan:" in target.read_text()
    if marker == "@link-dir":
        return p.is_symlink() and (d / "adir").is_dir(), False
    if marker == "@link-device":
        return p.is_symlink() and not (d / "dev").is_file(), False
    if marker == "@device":
        return not p.is_file() and not p.is_dir(), False
    if marker == "@fifo":
        return stat.S_ISFIFO(os.lstat(p).st_mode), False
    if marker == "@dir":
        return p.is_dir(), False
    raise AssertionError(marker)


# --------------------------------------------------------------------------- running
class _Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise _Hang()


def classify(case: Case, rc: int | None, err: str, *, through: bool = False) -> tuple[str, str]:
    lines = [x for x in err.splitlines() if x.strip()]
    if rc is None:
        return "hang", ""
    if "Traceback (most recent call last)" in err or rc not in (0, 2):
        tail = lines[-1][:160] if lines else f"exit {rc}"
        return "traceback", tail
    if rc == 0:
        return (THROUGH if through else "accepted"), ""
    errors = [x for x in lines if not x.startswith(("usage:", " "))]
    if len(errors) == 1 and ": error:" in errors[0] and len(errors[0]) <= 2000:
        return GOOD, errors[0][:160]
    return "several lines", " | ".join(lines)[:160]


def run_in_process(case: Case, *, timeout: float = TIMEOUT_S) -> Result:
    from executor.cli import main as run_main
    from executor.dry_run import main as dry_run_main
    from planner.cli import main as plan_main

    entry = {"plan": plan_main, "run": dry_run_main, "launch": run_main}[case.target]

    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        d = Path(tmp)
        argv = materialize(case, d)
        out, err = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        t0 = time.perf_counter()
        rc: int | None
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            os.chdir(d)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = entry(list(argv))
        except _Hang:
            rc = None
        except SystemExit as e:           # argparse refusals
            rc = e.code if isinstance(e.code, int) else 2
        except Exception:                 # noqa: BLE001 - exactly what the fuzzer looks for
            import traceback
            err.write(traceback.format_exc())
            rc = 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            os.chdir(cwd)
        secs = time.perf_counter() - t0
        return _result(case, rc, err.getvalue(), d, secs)


def _result(case: Case, rc, err: str, d: Path, secs: float) -> Result:
    if case.out is not None:
        intact, through = out_intact(case.out, d / "f.yaml")
        if not intact:
            return Result(case, "clobbered", f"--out {case.out} was replaced", secs)
        outcome, detail = classify(case, rc, err, through=through)
        if outcome == "accepted":        # exit 0 but the target was not written through
            outcome = "clobbered" if case.out in ("@link", "@dangling") else "accepted"
        return Result(case, outcome, detail, secs)
    outcome, detail = classify(case, rc, err)
    return Result(case, outcome, detail, secs)


def run_cli(case: Case, *, timeout: float = CLI_TIMEOUT_S) -> Result:
    with tempfile.TemporaryDirectory(prefix="fuzz-cli-") as tmp:
        d = Path(tmp)
        argv = materialize(case, d)
        if case.target == "plan":
            cmd = [sys.executable, "-m", "planner.cli"] + argv
        elif case.target == "launch":
            cmd = [sys.executable, "-m", "executor.cli"] + argv
        else:
            cmd = [sys.executable, "-m", "executor.cli", "--dry-run"] + argv
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
            rc, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired:
            rc, err = None, ""
        return _result(case, rc, err, d, time.perf_counter() - t0)


def passed(r: Result) -> bool:
    if not r.case.bad:
        return r.outcome in ("accepted", THROUGH)
    return r.outcome == GOOD or (r.outcome == THROUGH and r.case.out is not None)


def table(results: list[Result], title: str) -> str:
    groups: dict[str, dict[str, int]] = {}
    for r in results:
        g = groups.setdefault(r.case.group, {o: 0 for o in OUTCOMES})
        g[r.outcome] += 1
    w = max(len(g) for g in groups) if groups else 10
    head = f"{title:<{w}}  {'cases':>6}  " + "  ".join(f"{o:>{max(8, len(o))}}" for o in OUTCOMES)
    rows = [head, "-" * len(head)]
    for name, g in groups.items():
        rows.append(f"{name:<{w}}  {sum(g.values()):>6}  " +
                    "  ".join(f"{g[o]:>{max(8, len(o))}}" for o in OUTCOMES))
    return "\n".join(rows)


def headline(results: list[Result]) -> str:
    bad = [r for r in results if r.case.bad]
    good = sum(passed(r) for r in bad)
    n = {o: sum(r.outcome == o for r in bad) for o in OUTCOMES}
    ctrl = [r for r in results if not r.case.bad]
    return (f"fuzz: {len(bad):,} bad inputs: {good:,} refused in one line with exit 2 or written safely "
            f"({100.0 * good / max(1, len(bad)):.1f}%), {n['accepted']} accepted, {n['traceback']} tracebacks, "
            f"{n['hang']} hangs, {n['clobbered']} clobbered, {n['several lines']} several lines; "
            f"controls accepted {sum(passed(r) for r in ctrl)}/{len(ctrl)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sample", type=int, default=1, help="run every Nth generated case (default all)")
    ap.add_argument("--combos", type=int, default=600, help="random multi-mistake plan files (default 600)")
    ap.add_argument("--cli", type=int, default=240, help="cases also run through the real CLIs (default 240)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every case's outcome here")
    ap.add_argument("--show", type=int, default=30, help="failures to list (default 30)")
    args = ap.parse_args(argv)
    cases = all_cases(sample=args.sample, combos=args.combos, seed=args.seed)
    t0 = time.perf_counter()
    results = [run_in_process(c) for c in cases]
    t_in = time.perf_counter() - t0
    cli_results: list[Result] = []
    if args.cli:
        rng = random.Random(args.seed + 1)
        runs = [c for c in cases if c.target in ("run", "launch") and c.bad]
        plans = [c for c in cases if c.target == "plan" and c.bad]
        pick = controls() + rng.sample(runs, min(len(runs), args.cli * 5 // 6)) + \
            rng.sample(plans, min(len(plans), args.cli - args.cli * 5 // 6))
        t1 = time.perf_counter()
        for i, c in enumerate(pick):
            cli_results.append(run_cli(c))
            if (i + 1) % 20 == 0:
                print(f"[fuzz] {i + 1}/{len(pick)} through the CLIs ({time.perf_counter() - t1:.0f} s)",
                      file=sys.stderr, flush=True)
        t_cli = time.perf_counter() - t1
    fails = [r for r in results + cli_results if not passed(r)]
    print(table(results, f"in-process ({len(results)} cases, {t_in:.0f} s)"))
    if cli_results:
        print()
        print(table(cli_results, f"real CLIs ({len(cli_results)} cases, {t_cli:.0f} s)"))
    if fails:
        print(f"\nnot refused in one line ({len(fails)}; first {args.show}):")
        for r in fails[: args.show]:
            print(f"  [{r.outcome}] {r.case.group}: {r.case.name[:70]}  -> {r.detail[:150]}")
    if args.json:
        Path(args.json).write_text(json.dumps([{"group": r.case.group, "case": r.case.name, "target": r.case.target,
                                                "bad": r.case.bad, "outcome": r.outcome, "detail": r.detail,
                                                "seconds": round(r.seconds, 3)} for r in results + cli_results],
                                              indent=1))
    slow = max(results, key=lambda r: r.seconds)
    print(f"\nslowest in-process case: {slow.seconds:.2f} s ({slow.case.group}: {slow.case.name[:60]})")
    print("in-process " + headline(results))
    if cli_results:
        print("real CLIs  " + headline(cli_results))
    print(headline(results + cli_results))
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
