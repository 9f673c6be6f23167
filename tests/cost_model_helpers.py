"""Helpers shared by the cost-model tests (tests/test_flops.py, test_memory.py, test_step_time.py, ...)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
