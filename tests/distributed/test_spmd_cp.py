"""Context parallel on the spmd_types backend (typed ring-attention region, batch typed over cp) and on dtensor.

Each layout (cp 2, dp_shard 2 x cp 2, cp 2 x tp 2) runs on each backend and matches the
single-process run (loss and grad norm per step within 1e-4 relative); the two backends match
each other within 1e-5.  The checker (``train.spmd_typecheck``) passes on a real CP run; on a
fake process group it names what is missing when the ring's typed declaration or the loss's
pending sum over cp is taken away, and the ring region refuses inputs not sharded over cp.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import spmd_types as spmd
from cost_models.specs import load_model
from executor.mesh import build_meshes
from executor.parallel import fsdp, spmd_step
from executor.parallel.fsdp import spmd_fsdp_supported, spmd_typecheck
from executor.parallel.parallelize import Precision, build_model_parts, resolve_backend
from executor.parallel.ring_attention import _RingAttentionFn
from executor.parallel.spmd_context_parallel import TypedRingAttention, TypedRingAttentionFn, apply_spmd_cp
from search_spaces.plan import Plan
from tests.distributed.harness import (in_fresh_process, assert_backends_agree, assert_close_per_step,
                                       backend_params, run_on_its_backend, run_titan)

needs_spmd = pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))
LAYOUTS = {"cp2": Plan(cp=2, microbatch=4), "dp2xcp2": Plan(dp_shard=2, cp=2, microbatch=2),
           "cp2xtp2": Plan(cp=2, tp=2, microbatch=4), "hsdp2xcp2": Plan(dp_replicate=2, cp=2, microbatch=2),
           "dp2xcp2xtp2": Plan(dp_shard=2, cp=2, tp=2, microbatch=2)}
# the dtensor fallback's runs (and the backend-agreement checks) are under -m slow: its quick cases in the CI run
# are FSDP and TP (test_executor_parity, test_spmd_tp)
PAIRS, AGREE = backend_params(LAYOUTS, slow={"hsdp2xcp2", "dp2xcp2xtp2"}, dtensor_slow={"cp2", "dp2xcp2", "cp2xtp2"})


def _run(layout: str, backend: str):
    return run_on_its_backend(dataclasses.replace(LAYOUTS[layout], backend=backend))


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout, backend", PAIRS)
def test_cp_matches_single_process(layout, backend):
    _run(layout, backend)


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout", AGREE)
def test_backends_match_each_other(layout):
    a, b = _run(layout, "spmd_types"), _run(layout, "dtensor")
    assert_backends_agree(a, b)


@needs_spmd
@pytest.mark.distributed
def test_the_typecheck_switch_runs_cp_steps_under_the_checker():
    run = run_titan(LAYOUTS["cp2"], steps=2, extra={"train.spmd_typecheck": True})
    assert "backend spmd_types" in run.proc.stdout, run.proc.stdout[-2000:]
    assert_close_per_step(run.losses, _run("cp2", "spmd_types").losses[:2], 1e-6, "loss (checker on vs off)")


@pytest.fixture(scope="module")
def dp2xcp2_checkpoints(tmp_path_factory):
    """dp_shard 2 x cp 2 on each backend, checkpoints every 2 steps: tmp, {backend: (run dir, losses)}."""
    tmp = tmp_path_factory.mktemp("cp-ckpt")
    bases = {}
    for backend in ("spmd_types", "dtensor"):
        run = run_titan(dataclasses.replace(LAYOUTS["dp2xcp2"], backend=backend), run_dir=tmp / f"base-{backend}",
                        train={"checkpoint_every": 2, "keep_checkpoints": 0})
        assert f"backend {backend}" in run.proc.stdout, run.proc.stdout[-2000:]
        bases[backend] = (run.run_dir, run.losses)
    return tmp, bases


@needs_spmd
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [("spmd_types", "dtensor"), ("dtensor", "spmd_types")])
def test_cp_resumes_across_backends(dp2xcp2_checkpoints, saved, resumed):
    """Parameters typed R over cp and FSDP-sharded over (dp_shard, cp) on spmd_types, sharded over the flat
    dp_shard*cp on dtensor: one checkpoint (DCP, by FQN); the resumed run continues either one exactly."""
    tmp, bases = dp2xcp2_checkpoints
    run_dir, want = bases[saved]
    run = run_titan(dataclasses.replace(LAYOUTS["dp2xcp2"], backend=resumed), run_dir=tmp / f"{saved}-to-{resumed}",
                    args=("--resume", str(run_dir / "checkpoints" / "step-000002")))
    assert f"backend {resumed}" in run.proc.stdout and run.ranks[0]["first_step"] == 3, run.proc.stdout[-2000:]
    assert_close_per_step(run.losses, want[2:], 1e-6, f"loss (saved on {saved}, resumed on {resumed})")
    assert_close_per_step(run.losses, bases[resumed][1][2:], 1e-6, f"loss (vs an uninterrupted {resumed} run)")


# --------------------------------------------------------------------------- the checker (one process, fake PG)
class _UntypedRing(TypedRingAttention):
    """The typed region with the ring's declaration taken away (the plain autograd function)."""
    function = _RingAttentionFn


def _without_cp_pending_sum(loss, mesh):
    """``spmd_loss`` over the dp axes only: the loss is left Varying over cp."""
    names = tuple(n for n in mesh.mesh_dim_names if n != "cp")
    return fsdp.spmd_loss(loss, mesh[names]) if names else loss


def _checker_case(plan: Plan, remove: str | None) -> str:
    """One typechecked step of llama3-debug for `plan` on a fake process group (rank 0), in a fresh process
    (FSDP's spmd_types restore does not tell a second model's meshes from the first's).  `remove`:
    "ring" runs the ring without its typed declaration, "loss" leaves the loss Varying over cp.
    Returns "ok" or the checker's error.  (The fake group moves no data: values are not checked.)"""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    dist.init_process_group("fake", rank=0, world_size=plan.world_size, store=FakeStore())
    meshes = build_meshes(plan, "cpu")
    model = build_model_parts(load_model("llama3-debug"), plan, meshes, precision=Precision(torch.float32, torch.float32),
                              backend="spmd_types", device=torch.device("cpu"))[0][1]
    assert all(type(b.attention.sdpa) is TypedRingAttention for b in model.layers.values())
    if remove == "ring":
        apply_spmd_cp(model, meshes.cp, attention=_UntypedRing)
    elif remove == "loss":
        spmd_step.spmd_loss = _without_cp_pending_sum
    tok = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    try:
        spmd_step.forward_backward(model, tok, tok.roll(-1, 1), meshes, plan, typecheck=True)
    except spmd.SpmdTypeError as e:
        return f"SpmdTypeError: {e}"
    return "ok"


def _ring_region_case(cp_type: str) -> str:
    """The ring region alone on a fake 2-rank cp group: q / k / v typed `cp_type` ("V" or "R") on cp."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    cp = spmd.MeshAxis.of(dist.group.WORLD)
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    try:
        with spmd_typecheck():
            for t in (q, k, v):
                spmd.assert_type(t, {cp: getattr(spmd, cp_type)})
            out = TypedRingAttentionFn.apply(q, k, v, dist.group.WORLD, "math")
    except spmd.SpmdTypeError as e:
        return f"SpmdTypeError: {e}"
    return f"ok {spmd.get_local_type(out)[cp] is spmd.V}"


_in_fresh_process = in_fresh_process


@needs_spmd
@pytest.mark.parametrize("layout", ["dp2xcp2", "cp2xtp2"])
def test_checker_accepts_the_cp_plan(layout):
    assert _in_fresh_process(_checker_case, LAYOUTS[layout], None) == "ok"


@needs_spmd
def test_checker_names_the_ring_without_its_typed_declaration():
    # the typed region runs strict: an autograd function with no declared types is named, not left untyped
    msg = _in_fresh_process(_checker_case, LAYOUTS["dp2xcp2"], "ring")
    assert msg.startswith("SpmdTypeError: _RingAttentionFn.apply: autograd Function is not registered"), msg
    assert "spmd_typecheck" in msg, msg


@needs_spmd
def test_checker_names_a_loss_left_varying_over_cp():
    # without the pending sum over cp the cp ranks' gradients would not be the global mean's
    msg = _in_fresh_process(_checker_case, LAYOUTS["dp2xcp2"], "loss")
    assert msg.startswith("SpmdTypeError: backward() on a Varying loss on axis"), msg
    assert "reinterpret(loss" in msg and "dst=P" in msg, msg


@needs_spmd
def test_ring_region_types_its_output_and_refuses_an_input_not_sharded_over_cp():
    assert _in_fresh_process(_ring_region_case, "V") == "ok True"
    msg = _in_fresh_process(_ring_region_case, "R")
    assert msg.startswith("SpmdTypeError: SPMD type mismatch on axis"), msg
    assert "has PerMeshAxisLocalSpmdType.R, expected PerMeshAxisLocalSpmdType.V" in msg and "In apply(" in msg, msg


# --------------------------------------------------------------------------- which backend a plan gets
class _Meshes:
    spmd_dp = None        # cp alone: no data-parallel axis, still distributed


@needs_spmd
def test_cp_plans_get_spmd_types_silently(capsys):
    spec = load_model("llama3-debug")
    for plan in (Plan(cp=2), Plan(dp_shard=2, cp=2), Plan(cp=2, tp=2), Plan(dp_replicate=2, cp=2)):
        assert resolve_backend(plan, _Meshes(), announce=True, spec=spec) == "spmd_types", plan.describe()
    assert resolve_backend(Plan(cp=2, backend="dtensor"), _Meshes(), announce=True) == "dtensor"
    assert capsys.readouterr().err == ""
