"""Float8 linears under tensor parallelism on spmd_types (executor/parallel/spmd_float8.py) take the steps of the
same float8 run on one process: each tp-sharded operand is scaled by its tp-global amax.

Measured (llama3-debug, seq 64, fp32 master weights, 3 steps, local batch 2): TP 2 eager, loss per step
6.672860145 / 5.642586708 / 5.828227043 vs one process 6.672860622 / 5.642586708 / 5.827620029 (step 1: 7e-8
relative, the forward on the single process's float8 grid; later steps 1e-4, float8 rounding of the different
summation order); with per-shard (local) amaxes step 1 is 6.672962189, 1.5e-5 off, which the first assertion
rejects.  Per-block compile: 6.672860145 / 5.642586231 / 5.827568054, stderr empty.
"""
from __future__ import annotations

import importlib.util

import pytest

from executor.parallel.fsdp import spmd_fsdp_supported
from search_spaces.plan import Plan
from tests.distributed.harness import assert_close_per_step, run_titan

pytestmark = [pytest.mark.distributed, pytest.mark.slow,     # float8 matmuls are emulated on a CPU
              pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported())),
              pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                 reason="float8 needs torchao (the float8 extra)")]

STEPS = 3
_ONE: dict = {}


def _single_process():
    if "run" not in _ONE:
        _ONE["run"] = run_titan(Plan(microbatch=2, float8=True, compile=False), nproc=1, steps=STEPS, global_batch=2)
    return _ONE["run"]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_float8_tp2_takes_the_single_process_steps(compile):
    one = _single_process()
    tp = run_titan(Plan(tp=2, microbatch=2, float8=True, compile=compile), steps=STEPS, global_batch=2)
    assert "backend spmd_types" in tp.proc.stdout, tp.proc.stdout[-2000:]
    assert tp.proc.stderr.strip() == "", tp.proc.stderr[-2000:]        # no note, no fallback, no warning
    # step 1's loss is the forward alone: on the single process's float8 grid it agrees to fp32 rounding
    # (local amaxes put it 1.5e-5 off)
    assert abs(tp.losses[0] - one.losses[0]) <= 1e-6 * abs(one.losses[0]), (tp.losses[0], one.losses[0])
    assert_close_per_step(tp.losses, one.losses, 1e-3, "loss (float8 tp 2 vs one process)")
    assert_close_per_step(tp.grad_norms, one.grad_norms, 1e-3, "grad norm (float8 tp 2 vs one process)")
