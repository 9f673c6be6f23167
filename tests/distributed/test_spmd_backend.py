"""The spmd_types backend is real: FSDP2 storage from spmd-typed params, the checker catches a bad loss, and
data-parallel layouts (FSDP 2, HSDP 2 x 2) with per-block compile match one process on both backends."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from executor.parallel.fsdp import spmd_fsdp_supported
from search_spaces.plan import Plan
from tests.distributed.harness import (assert_backends_agree, assert_close_per_step, assert_matches_single_process,
                                      launch_worker, run_titan)

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))]


def test_spmd_fsdp_typechecks_and_rejects_an_unreduced_loss():
    r = launch_worker("_spmd_worker.py", 2, timeout=300)
    assert "Shard(dim=0)" in r["placements"]
    assert r["typed_backward_ok"]
    assert r["untyped_backward"].startswith("SpmdTypeError") and "Varying loss" in r["untyped_backward"]


# --------------------------------------------------------------------------- compile on the data-parallel layouts
COMPILED = {"fsdp2_compile": Plan(dp_shard=2, microbatch=2, compile=True),
            "hsdp2x2_compile": Plan(dp_replicate=2, dp_shard=2, microbatch=1, compile=True)}
_RUNS: dict = {}


def _run(layout: str, backend: str):
    """The layout on `backend` (no fallback, no note), checked against the single-process run (1e-4)."""
    key = (layout, backend)
    if key not in _RUNS:
        run, _ = assert_matches_single_process(dataclasses.replace(COMPILED[layout], backend=backend))
        assert f"backend {backend}" in run.proc.stdout, run.proc.stdout[-2000:]
        assert "note: backend" not in run.proc.stderr, run.proc.stderr[-2000:]
        _RUNS[key] = run
    return _RUNS[key]


# four processes compiling on a small machine: over a minute
LAYOUT_PARAMS = [pytest.param(name, marks=[pytest.mark.slow] if COMPILED[name].world_size > 2 else [])
                 for name in COMPILED]


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
@pytest.mark.parametrize("backend", ["spmd_types", pytest.param("dtensor", marks=pytest.mark.slow)])
def test_compiled_data_parallel_matches_single_process(layout, backend):
    _run(layout, backend)


@pytest.mark.slow   # compiled on the dtensor fallback: under -m slow (the CI run keeps its eager FSDP and TP)
@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_compiled_backends_match_each_other(layout):
    a, b = _run(layout, "spmd_types"), _run(layout, "dtensor")
    assert_backends_agree(a, b)


# --------------------------------------------------------------------------- float8 on the data-parallel layouts
@pytest.mark.slow       # float8 matmuls are emulated on a CPU: minutes for 3 steps
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="float8 needs torchao (the float8 extra)")
def test_fsdp_float8_runs_on_spmd_types_as_on_dtensor():
    """FSDP 2 with torchao float8 linears: spmd_types (no note) takes the dtensor run's steps (measured: equal)."""
    runs = {}
    for backend in ("spmd_types", "dtensor"):
        runs[backend] = run_titan(Plan(dp_shard=2, microbatch=2, float8=True, backend=backend), steps=3)
        assert f"backend {backend}" in runs[backend].proc.stdout, runs[backend].proc.stdout[-2000:]
        assert "note: backend" not in runs[backend].proc.stderr, runs[backend].proc.stderr[-2000:]
    assert_close_per_step(runs["spmd_types"].losses, runs["dtensor"].losses, 1e-5, "loss (spmd_types vs dtensor)")
    assert_close_per_step(runs["spmd_types"].grad_norms, runs["dtensor"].grad_norms, 1e-5,
                          "grad norm (spmd_types vs dtensor)")
