"""Multi-head latent attention under tensor parallel on both backends: spmd_types (typed local SPMD) and dtensor.

deepseek-debug (MLA + MoE, ``aux_loss_coef: 0``: tests/distributed/test_mla.py's spec file) trains
5 steps at seq 32, global batch 4, fp32, on each layout and each backend: loss and grad norm per
step within 1e-4 relative of one process, no fallback note, and the two backends within 1e-5 of
each other.  On spmd_types the MLA block is typed by ``spmd_tensor_parallel.MLA_ATTENTION_SHARDING``:
up-projections by heads, the replicated down-projections and latent norms R with pending-sum
gradients.  ``tp2_q0``: q_lora_rank 0 (wq column-wise instead of wq_a / q_norm / wq_b);
``dp2xtp2`` (four processes, slow): FSDP over the typed MLA parameters; ``cp2xtp2`` (four processes,
slow): ring attention over cp on the heads this tp rank holds (q, k, v V on tp: k's shared rotary
part is R joined with the head-sharded k_nope); ``pp2xtp2`` (slow): each pipeline stage's MLA
blocks typed by the same table; ``dp2xtp2xep2`` (slow): MLA attention under TP with the routed
experts on their own mesh; ``tp2_compile``: per-block compile on the spmd path.

The checker (``train.spmd_typecheck=true``) runs TP 2 steps (same losses as without it), and a
one-process fake-process-group step of both MLA variants (q_lora_rank 96 and 0) type-checks.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import spmd_types as spmd
from cost_models.specs import load_model, model_from_dict
from executor.mesh import build_meshes
from executor.parallel import spmd_step
from executor.parallel.fsdp import spmd_fsdp_supported
from executor.parallel.parallelize import Precision, build_model_parts, resolve_backend, spmd_plan_unsupported
from search_spaces.plan import Plan
from tests.distributed.harness import (backend_params, in_fresh_process, assert_backends_agree, assert_close_per_step,
                                       run_on_its_backend, run_titan)
from tests.distributed.test_mla import GLOBAL_BATCH, MODEL, SEQ_LEN, spec_file

needs_spmd = pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))
LAYOUTS = {"tp2": (Plan(tp=2, microbatch=4), None),
           "tp2_q0": (Plan(tp=2, microbatch=4), 0),
           "dp2xtp2": (Plan(dp_shard=2, tp=2, microbatch=2), None),
           "tp2_compile": (Plan(tp=2, microbatch=4, compile=True), None),
           "cp2xtp2": (Plan(cp=2, tp=2, microbatch=4), None),
           "pp2xtp2": (Plan(pp=2, tp=2, microbatch=2, n_microbatches=2), None),
           "dp2xtp2xep2": (Plan(dp_shard=2, tp=2, ep=2, microbatch=2), None)}
SLOW = {"dp2xtp2", "cp2xtp2", "pp2xtp2", "dp2xtp2xep2",      # four processes
        "tp2_q0", "tp2_compile"}                              # the variants of the quick tp2 case


# the dtensor fallback's runs and the backend-agreement checks are under -m slow: the fallback's quick cases in the
# CI run (30 minutes on 2 cores) are FSDP and TP (test_executor_parity, test_spmd_tp)
PAIRS, AGREE = backend_params(LAYOUTS, slow=SLOW, dtensor_slow=set(LAYOUTS))


def _run(layout: str, backend: str):
    plan, q_lora_rank = LAYOUTS[layout]
    return run_on_its_backend(dataclasses.replace(plan, backend=backend), model=spec_file(q_lora_rank),
                              seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, reference_learns_by=0.5)


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout, backend", PAIRS)
def test_mla_tp_matches_single_process(layout, backend):
    _run(layout, backend)


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout", AGREE)
def test_backends_match_each_other(layout):
    a, b = _run(layout, "spmd_types"), _run(layout, "dtensor")
    assert_backends_agree(a, b)


@needs_spmd
@pytest.mark.distributed
def test_the_typecheck_switch_runs_mla_tp_steps_under_the_checker():
    plan = dataclasses.replace(LAYOUTS["tp2"][0], backend="spmd_types")
    run = run_titan(plan, model=spec_file(), seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, steps=2,
                    extra={"train.spmd_typecheck": True})
    assert "backend spmd_types" in run.proc.stdout, run.proc.stdout[-2000:]
    assert "note: backend" not in run.proc.stderr, run.proc.stderr[-2000:]
    assert_close_per_step(run.losses, _run("tp2", "spmd_types").losses[:2], 1e-6, "loss (checker on vs off)")


# --------------------------------------------------------------------------- the checker (one process, fake PG)
def _checker_case(q_lora_rank: int) -> str:
    """One typechecked TP 2 step of deepseek-debug (with `q_lora_rank`) on a fake process group (rank 0 of 2),
    in a fresh process; returns "ok" or the checker's error."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    d = load_model(MODEL).to_dict()
    d.update(name=f"mla-q{q_lora_rank}", q_lora_rank=q_lora_rank)
    plan = Plan(tp=2, microbatch=2)
    meshes = build_meshes(plan, "cpu")
    stages = build_model_parts(model_from_dict(d), plan, meshes, precision=Precision(torch.float32, torch.float32),
                               backend="spmd_types", device=torch.device("cpu"))
    tok = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    try:
        loss = spmd_step.forward_backward(stages[0][1], tok, tok.roll(-1, 1), meshes, plan, typecheck=True)
    except spmd.SpmdTypeError as e:
        return f"{type(e).__name__}: {e}"
    assert torch.isfinite(loss)
    return "ok"


def _in_fresh_process(q_lora_rank: int) -> str:
    return in_fresh_process(_checker_case, q_lora_rank)


@needs_spmd
@pytest.mark.parametrize("q_lora_rank", [96, 0])
def test_checker_accepts_the_mla_tables(q_lora_rank):
    assert _in_fresh_process(q_lora_rank) == "ok"


# --------------------------------------------------------------------------- which backend an MLA plan gets
class _Meshes:
    spmd_dp = object()        # resolve_backend only asks whether a data-parallel axis exists


@needs_spmd
def test_mla_tp_plans_get_spmd_types_silently(capsys):
    spec = load_model("deepseek-debug")
    for plan in (Plan(tp=2), Plan(dp_shard=2, tp=2), Plan(tp=2, compile=True), Plan(dp_shard=2, tp=2, ep=2)):
        assert spmd_plan_unsupported(plan, spec) is None, plan.describe()
        assert resolve_backend(plan, _Meshes(), announce=True, spec=spec) == "spmd_types", plan.describe()
    assert capsys.readouterr().err == ""
