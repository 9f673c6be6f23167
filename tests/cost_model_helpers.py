"""Helpers shared by the cost-model tests (tests/test_flops.py, test_memory.py, test_step_time.py, ...)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cost_models.estimate import estimate
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from search_spaces import CandidateTable, Plan


def table(*plans: Plan) -> CandidateTable:
    return CandidateTable.from_plans(plans)


def est1(plan: Plan, model="llama3-70b", hw="h100-sxm", wl=None, coeffs=None):
    m = load_model(model) if isinstance(model, str) else model
    wl = wl or Workload(seq_len=8192, global_batch=plan.global_batch())
    return estimate(table(plan), m, load_hardware(hw), wl, coeffs)


def load_bench(name: str):
    """A script of bench/ as a module (loaded once per session: the validation tests share it)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


def planner_cli(*args: str) -> subprocess.CompletedProcess:
    """`titan-plan ARGS` in a fresh interpreter from the repository root (text output captured)."""
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])


def assert_plan_file_value_refused(tmp_path, key: str, value, allowed_word: str, *, model: str = "qwen3-30b-a3b",
                                   plan: dict | None = None) -> None:
    """A plan file whose ``workload: {key: value}`` is bad: `titan-plan estimate` exits 2 with one line naming
    the key, the value and (`allowed_word`) what is allowed."""
    f = tmp_path / "bad_workload.yaml"
    f.write_text(yaml.safe_dump({"model": model, "hardware": "h100-sxm", "plan": plan or {"dp_shard": 16, "ep": 16},
                                 "workload": {"seq_len": 4096, "global_batch": 1024, key: value}}))
    r = planner_cli("estimate", "--plan", str(f))
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert key in err and repr(value) in err and allowed_word in err, err


def assert_titan_run_refuses(tmp_path, key: str, refused, accepted, *, model: str = "llama3-debug",
                             plan: dict | None = None) -> None:
    """titan-run's config refuses ``workload: {key: refused}`` in one line naming the key and the value,
    and accepts each of `accepted`."""
    from executor.config import ConfigError, load_run_config   # lazy: the cost-model tests stay torch-free
    f = tmp_path / "run_plan.yaml"
    plan = plan or {"dp_shard": 2, "microbatch": 2}

    def write(v):
        f.write_text(yaml.safe_dump({"model": model, "plan": plan,
                                     "workload": {"seq_len": 64, "global_batch": 4, key: v}}))
    write(refused)
    with pytest.raises(ConfigError) as ei:
        load_run_config(str(f), [], world_size=2)
    msg = str(ei.value)
    assert msg.startswith(f"workload key '{key}' is {refused!r}, but titan-run") and "\n" not in msg, msg
    for v in accepted:
        write(v)
        assert getattr(load_run_config(str(f), [], world_size=2).workload, key) == v


def run_config_with_model_key(tmp_path, key: str, value):
    """titan-run's config of a one-process plan whose model is llama3-debug with model key `key` set to `value`
    (what a model file describing another framework's model may carry); raises its ConfigError."""
    from executor.config import load_run_config   # lazy: the cost-model tests stay torch-free
    spec = {**load_model("llama3-debug").to_dict(), "name": f"debug-{key}", key: value}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"model": str(tmp_path / "m.yaml"), "plan": {"microbatch": 2},
                                    "workload": {"seq_len": 64, "global_batch": 2}}))
    return load_run_config(str(plan), [], world_size=1)
