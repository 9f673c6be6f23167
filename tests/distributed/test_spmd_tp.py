"""Tensor parallel + sequence parallel on both backends: spmd_types (local SPMD, typed collectives) and dtensor.

Each layout runs on each backend and matches the single-process run (loss and grad norm per
step within 1e-4 relative); the two backends match each other within 1e-5.  The layouts
include per-block compile (TP 2, FSDP 2 x TP 2): on spmd_types with the vocab-parallel
embedding, which the dtensor backend has to leave replicated under compile
(docs/torch_on_cpu.md §8c, §8e).  A single-process fake-process-group test shows the checker
(``train.spmd_typecheck``) names a collective that a TP block is missing; another builds two
spmd_types models in one process.
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import spmd_types as spmd
from cost_models.specs import load_model
from executor.mesh import build_meshes
from executor.parallel import spmd_step, spmd_tensor_parallel
from executor.parallel import fsdp
from executor.parallel.fsdp import spmd_fsdp_supported
from executor.parallel.parallelize import Precision, build_model_parts, resolve_backend, spmd_plan_unsupported
from executor.parallel.spmd_tensor_parallel import BLOCK_SHARDING, BOUNDARY_OPS
from search_spaces.plan import Plan
from tests.distributed.harness import (in_fresh_process, assert_backends_agree, assert_close_per_step,
                                       backend_params, run_on_its_backend, run_titan, write_tied_model)

needs_spmd = pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))
LAYOUTS = {"tp2": Plan(tp=2, microbatch=4), "dp2xtp2": Plan(dp_shard=2, tp=2, microbatch=2),
           "hsdp2xtp2": Plan(dp_replicate=2, tp=2, microbatch=2),
           "tp2_compile": Plan(tp=2, microbatch=4, compile=True),
           "dp2xtp2_compile": Plan(dp_shard=2, tp=2, microbatch=2, compile=True)}
# out of the CI run (README test command, 30 minutes on 2 cores): HSDP x TP (HSDP and TP each have their quick
# cases) and FSDP x TP compiled (tp2_compile and test_spmd_backend's fsdp2_compile stay), and on the dtensor
# fallback FSDP x TP and compiled TP (TP alone runs there: the fallback's quick cases are FSDP and TP)
PAIRS, AGREE = backend_params(LAYOUTS, slow={"hsdp2xtp2", "dp2xtp2_compile"}, dtensor_slow={"dp2xtp2", "tp2_compile"})


def _run(layout: str, backend: str):
    return run_on_its_backend(dataclasses.replace(LAYOUTS[layout], backend=backend))


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout, backend", PAIRS)
def test_tp_matches_single_process(layout, backend):
    _run(layout, backend)


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout", AGREE)
def test_backends_match_each_other(layout):
    a, b = _run(layout, "spmd_types"), _run(layout, "dtensor")
    assert_backends_agree(a, b)


# --------------------------------------------------------------------------- the checker (one process, fake PG)
def _checker_case(skip_reduce_scatter: bool) -> str:
    """One typechecked TP step of llama3-debug at tp=2 on a fake process group (rank 0 of 2), in a fresh
    process (the case alters the module's tables and starts a process group).
    With `skip_reduce_scatter` the attention output projection skips the SP reduce-scatter (a
    test-only boundary that only keeps this rank's sequence chunk).  Returns "ok" or the error."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    plan = Plan(tp=2, microbatch=2)
    if skip_reduce_scatter:
        BOUNDARY_OPS["skip_reduce_scatter"] = lambda x, tp: x.chunk(tp.size, 1)[tp.rank]
        spmd_tensor_parallel.BLOCK_SHARDING = {**BLOCK_SHARDING, "attention.wo": dataclasses.replace(
            BLOCK_SHARDING["attention.wo"], output="skip_reduce_scatter")}
    meshes = build_meshes(plan, "cpu")
    stages = build_model_parts(load_model("llama3-debug"), plan, meshes,
                               precision=Precision(torch.float32, torch.float32), backend="spmd_types",
                               device=torch.device("cpu"))
    tok = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    try:
        loss = spmd_step.forward_backward(stages[0][1], tok, tok.roll(-1, 1), meshes, plan, typecheck=True)
    except spmd.SpmdTypeError as e:
        return f"SpmdTypeError: {e}"
    assert torch.isfinite(loss)
    return "ok"


def _in_fresh_process(skip_reduce_scatter: bool) -> str:
    return in_fresh_process(_checker_case, skip_reduce_scatter)


def _two_models_case() -> list:
    """Build, materialize and step two spmd_types FSDP 2 x TP 2 models of llama3-debug one after the other in
    one process (fake process group, rank 0 of 4, new meshes for each); returns each one's loss and
    whether every parameter's FSDP storage mesh is that model's own mesh."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    plan = Plan(dp_shard=2, tp=2, microbatch=2)
    tok = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    out = []
    for _ in range(2):
        meshes = build_meshes(plan, "cpu")
        model = build_model_parts(load_model("llama3-debug"), plan, meshes, precision=Precision(torch.float32,
                                  torch.float32), backend="spmd_types", device=torch.device("cpu"))[0][1]
        tp_group = meshes.tp.get_group()
        own = all(p.device_mesh.get_group("tp") is tp_group for p in model.parameters())
        loss = spmd_step.forward_backward(model, tok, tok.roll(-1, 1), meshes, plan, typecheck=True)
        out.append((float(loss), own))
    return out


@needs_spmd
def test_checker_accepts_the_tp_tables():
    assert _in_fresh_process(False) == "ok"


@needs_spmd
def test_checker_names_a_skipped_sequence_parallel_reduce_scatter():
    # the projection's output stays a pending sum (P) and meets the sequence-sharded (V) residual:
    # the checker names the types, the op (the residual add) and the collective that was missing
    msg = _in_fresh_process(True)
    assert msg.startswith("SpmdTypeError: Partial type on axis"), msg
    assert "cannot combine with Varying" in msg and "reduce_scatter" in msg and "In add(" in msg, msg


@needs_spmd
def test_a_second_spmd_model_in_one_process_builds_and_steps():
    # FSDP's spmd path checks that a parameter's DTensor mesh IS the mesh it was given; DTensor's caches
    # compare meshes by value and handed the second model the first one's ("different mesh objects")
    (first, own1), (second, own2) = in_fresh_process(_two_models_case)
    assert own1 and own2
    assert first == second and math.isfinite(first)


# --------------------------------------------------------------------------- compile: one graph per block
def _compiled_graphs_case() -> list:
    """Graph breaks and compiled graphs of one forward of llama3-debug at tp 2 with per-block compile (fake
    process group, rank 0 of 2): erased TP boundaries, then with the checker's typed ones (typecheck)."""
    from torch._dynamo.utils import counters
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    plan = Plan(tp=2, microbatch=2, compile=True)
    tok = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    out = []
    for typecheck in (False, True):
        counters.clear()
        torch._dynamo.reset()
        stages = build_model_parts(load_model("llama3-debug"), plan, build_meshes(plan, "cpu"),
                                   precision=Precision(torch.float32, torch.float32), backend="spmd_types",
                                   device=torch.device("cpu"), typecheck=typecheck)
        stages[0][1](tok)
        out.append((sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]))
    return out


@needs_spmd
def test_compiled_blocks_trace_their_tp_collectives_into_one_graph():
    """A compiled block's TP boundaries are the collectives with their types erased (ERASED_OPS), which Dynamo
    traces: no graph break, one graph for the identical blocks.  With the checker on they stay typed eager
    islands (measured: 4 breaks, 7 graphs), which is what the erased path removes."""
    (erased_breaks, erased_graphs), (typed_breaks, typed_graphs) = in_fresh_process(_compiled_graphs_case)
    assert erased_breaks == 0 and erased_graphs == 1, (erased_breaks, erased_graphs)
    assert typed_breaks > 0 and typed_graphs > 1, (typed_breaks, typed_graphs)


# --------------------------------------------------------------------------- which backend a plan gets
class _Meshes:
    spmd_dp = object()        # resolve_backend only asks whether a data-parallel axis exists


@pytest.mark.parametrize("plan, spec, missing", [
    # every attention a ModelSpec accepts has a table; a spec object with another one shows the rule
    (Plan(tp=2), SimpleNamespace(attention="linear"), "attention 'linear' has no spmd_types TP sharding table"),
])
def test_a_plan_the_spmd_path_cannot_run_gets_dtensor_with_one_line(plan, spec, missing, capsys):
    assert resolve_backend(plan, _Meshes(), announce=True, spec=spec) == "dtensor"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("titan-run: note: backend dtensor instead of spmd_types: "), err
    assert missing in err[0], err


@needs_spmd
def test_tp_and_fsdp_plans_get_spmd_types_silently(capsys):
    for plan in (Plan(tp=2), Plan(dp_shard=2, tp=2), Plan(dp_replicate=2, dp_shard=2),
                 Plan(dp_shard=2, compile=True), Plan(dp_shard=2, tp=2, compile=True), Plan(dp_shard=2, float8=True),
                 Plan(tp=2, float8=True)):
        assert resolve_backend(plan, _Meshes(), announce=True, spec=load_model("llama3-debug")) == "spmd_types"
    assert resolve_backend(Plan(tp=2, backend="dtensor"), _Meshes(), announce=True) == "dtensor"
    assert capsys.readouterr().err == ""


def test_mla_and_moe_under_tp_have_spmd_tables():
    for model in ("deepseek-debug", "moe-debug"):
        spec = load_model(model)
        assert spmd_plan_unsupported(Plan(dp_shard=2), spec) is None
    assert spmd_plan_unsupported(Plan(tp=2), load_model("deepseek-debug")) is None   # MLA under TP: test_spmd_mla.py
    assert spmd_plan_unsupported(Plan(tp=2), load_model("moe-debug")) is None    # MoE under TP: test_spmd_ep.py


def test_torch_without_spmd_fsdp_names_its_version(monkeypatch):
    def fully_shard_2_13(module, *, mesh=None, reshard_after_forward=None, mp_policy=None):   # no dp_mesh_dims
        raise AssertionError("not called")
    monkeypatch.setattr(fsdp, "fully_shard", fully_shard_2_13)
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    reason = fsdp.spmd_fsdp_supported()
    assert reason.startswith("torch 2.13.0 has no spmd_types FSDP2") and "2.14" in reason, reason


@needs_spmd
@pytest.mark.distributed
def test_the_typecheck_switch_runs_tp_steps_under_the_checker():
    run = run_titan(Plan(tp=2, microbatch=4), steps=2, extra={"train.spmd_typecheck": True})
    assert "backend spmd_types" in run.proc.stdout, run.proc.stdout[-2000:]
    assert_close_per_step(run.losses, _run("tp2", "spmd_types").losses[:2], 1e-6, "loss (checker on vs off)")


# --------------------------------------------------------------------------- tp-pending grads: one all-reduce a step
def _deferred_grads_case() -> dict:
    """Which parameters of llama3-debug's TP plans have their tp-pending gradient summed after backward in one
    all-reduce (fsdp.defer_tp_grad_reduction) instead of in FSDP's post-backward (fake process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    out = {}
    for name, plan, typecheck in (("tp2", Plan(tp=2, microbatch=2), False),
                                  ("tp2 checker", Plan(tp=2, microbatch=2), True),
                                  ("tp2 2 micro-batches", Plan(tp=2, microbatch=1, n_microbatches=2), False),
                                  ("dp2xtp2", Plan(dp_shard=2, tp=2, microbatch=2), False)):
        model = build_model_parts(load_model("llama3-debug"), plan, build_meshes(plan, "cpu"),
                                  precision=Precision(torch.float32, torch.float32), backend="spmd_types",
                                  device=torch.device("cpu"), typecheck=typecheck)[0][1]
        deferred = getattr(model, "_deferred_tp_grads", None)
        names = {id(p): n for n, p in model.named_parameters()}
        out[name] = sorted(names[id(p)] for p in deferred[0]) if deferred else []
    return out


@needs_spmd
def test_tp_pending_grads_are_summed_in_one_all_reduce_on_a_one_rank_dp_axis():
    got = in_fresh_process(_deferred_grads_case)
    n_layers = load_model("llama3-debug").n_layers
    want = sorted([f"layers.{i}.{n}.weight" for i in range(n_layers) for n in ("attention_norm", "ffn_norm")]
                  + ["norm.weight"])
    assert got["tp2"] == want, got["tp2"]
    # FSDP's own reduction where the sum order would change (dp ranks, micro-batches) and under the checker
    assert got["tp2 checker"] == got["tp2 2 micro-batches"] == got["dp2xtp2"] == [], got


# --------------------------------------------------------------------------- tied embeddings under tp
TIED_LAYOUTS = {"tied_dp2xtp2": Plan(dp_shard=2, tp=2, microbatch=2), "tied_tp2": Plan(tp=2, microbatch=4),
                "tied_tp2_compile": Plan(tp=2, microbatch=4, compile=True)}


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    return write_tied_model(tmp_path_factory.mktemp("tied"))


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout, backend", [
    pytest.param("tied_dp2xtp2", "spmd_types", id="spmd_types-tied_dp2xtp2"),
    pytest.param("tied_tp2", "dtensor", id="dtensor-tied_tp2", marks=pytest.mark.slow),
    pytest.param("tied_tp2_compile", "spmd_types", id="spmd_types-tied_tp2_compile", marks=pytest.mark.slow)])
def test_tied_embeddings_under_tp_match_single_process(tied_model, layout, backend):
    """A tied embedding under tp: the embedding and the LM head shard the same vocabulary rows, so they stay one
    parameter (its gradient the sum of both uses, as in one process); loss and grad norm match the single-process
    run on each backend, and the two backends each other."""
    run = run_on_its_backend(dataclasses.replace(TIED_LAYOUTS[layout], backend=backend), model=tied_model)
    if backend == "dtensor":
        other = run_on_its_backend(dataclasses.replace(TIED_LAYOUTS[layout], backend="spmd_types"), model=tied_model)
        assert_backends_agree(other, run)


def test_tied_embeddings_under_tp_and_compile_refuse_the_dtensor_backend(tied_model, tmp_path):
    """The dtensor backend keeps the embedding replicated under compile while the head is vocab-sharded: a tied model
    there is refused before launch, in one line naming the keys to change."""
    import yaml
    from executor.config import ConfigError, load_run_config
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump({"model": tied_model, "workload": {"seq_len": 64, "global_batch": 4},
                                 "plan": {"tp": 2, "microbatch": 4, "compile": True, "backend": "dtensor"}}))
    with pytest.raises(ConfigError) as e:
        load_run_config(str(f), [], world_size=2)
    assert "tied embeddings runs on backend spmd_types only" in str(e.value) and "\n" not in str(e.value)
