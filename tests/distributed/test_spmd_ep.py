"""Expert parallel on the spmd_types backend (typed all-to-all, experts typed on their own mesh) and on dtensor.

moe-debug (with ``aux_loss_coef: 0``, as in test_moe_parity.py: the aux loss is per rank's
micro-batch, so it is layout dependent) trains 5 steps at seq 32, global batch 4, fp32, on
each layout and each backend: loss and grad norm per step within 1e-4 relative of one process,
and the two backends within 1e-5 of each other.  ``dp2xep2``: ep borrows both dp_shard ranks
(efsdp 1); ``dp4xep2``: experts FSDP-sharded over efsdp 2, so the dense mesh (dp_shard 4) and
the experts' mesh (efsdp 2 x ep 2) differ and the tokens cross between them at the all-to-alls;
``hsdp2xep2``: the experts' mesh is (dp_replicate 2, efsdp 1, ep 2); ``dp2xtp2xep2``: the dense
blocks typed by the spmd TP tables, the MoE blocks on the sequence-parallel local tokens (their
parameters R on tp: pending-sum gradients, reduced with the norms'), experts typed on
(efsdp, ep, tp); ``pp2xdp2xep2``: each pipeline stage's MoE blocks typed the same way.

The checker (``train.spmd_typecheck=true``) runs the dp4xep2 steps (same losses as without it),
and a four-process step whose dispatch skips the all-to-all shows the checker naming the tokens
left on the dense mesh where the experts' mesh was expected.
"""
from __future__ import annotations

import dataclasses
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from executor.parallel.fsdp import spmd_fsdp_supported
from executor.parallel.parallelize import resolve_backend, spmd_plan_unsupported
from search_spaces.plan import Plan
from tests.distributed.harness import (assert_backends_agree, assert_close_per_step, backend_params, free_port,
                                       run_on_its_backend, run_titan)
from tests.distributed.test_moe_parity import GLOBAL_BATCH, SEQ_LEN, moe_spec_file

needs_spmd = pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))
LAYOUTS = {"dp2xep2": Plan(dp_shard=2, ep=2, microbatch=2),
           "dp4xep2": Plan(dp_shard=4, ep=2, microbatch=1),
           "hsdp2xep2": Plan(dp_replicate=2, dp_shard=2, ep=2, microbatch=1),
           "dp2xtp2xep2": Plan(dp_shard=2, tp=2, ep=2, microbatch=2),
           "pp2xdp2xep2": Plan(pp=2, dp_shard=2, ep=2, microbatch=1, n_microbatches=2)}
SLOW = {"dp4xep2", "hsdp2xep2", "dp2xtp2xep2", "pp2xdp2xep2"}          # four processes


# the dtensor fallback's runs and the backend-agreement checks are under -m slow: the fallback's quick cases in the
# CI run (30 minutes on 2 cores) are FSDP and TP (test_executor_parity, test_spmd_tp)
PAIRS, AGREE = backend_params(LAYOUTS, slow=SLOW, dtensor_slow=set(LAYOUTS))


def _run(layout: str, backend: str):
    return run_on_its_backend(dataclasses.replace(LAYOUTS[layout], backend=backend), model=moe_spec_file(),
                              seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, reference_learns_by=1.0)


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout, backend", PAIRS)
def test_ep_matches_single_process(layout, backend):
    _run(layout, backend)


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout", AGREE)
def test_backends_match_each_other(layout):
    a, b = _run(layout, "spmd_types"), _run(layout, "dtensor")
    assert_backends_agree(a, b)


@needs_spmd
@pytest.mark.distributed
@pytest.mark.slow
def test_the_typecheck_switch_runs_ep_steps_under_the_checker():
    run = run_titan(dataclasses.replace(LAYOUTS["dp4xep2"], backend="spmd_types"), model=moe_spec_file(),
                    seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, steps=2, extra={"train.spmd_typecheck": True})
    assert "backend spmd_types" in run.proc.stdout, run.proc.stdout[-2000:]
    assert_close_per_step(run.losses, _run("dp4xep2", "spmd_types").losses[:2], 1e-6, "loss (checker on vs off)")


@needs_spmd
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("save, resume", [("spmd_types", "dtensor"), ("dtensor", "spmd_types")])
def test_an_ep_checkpoint_resumes_on_the_other_backend(save, resume, tmp_path):
    """The experts are stored as full [E, ...] tensors on both backends: a run saved under one resumes under
    the other, its losses continuing those of the saving run."""
    plan = LAYOUTS["dp2xep2"]
    kw = dict(model=moe_spec_file(), seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH)
    base = run_titan(dataclasses.replace(plan, backend=save), train={"checkpoint_every": 2}, run_dir=tmp_path / "a",
                     **kw)
    again = run_titan(dataclasses.replace(plan, backend=resume), run_dir=tmp_path / "b", **kw,
                      args=("--resume", str(base.run_dir / "checkpoints" / "step-000002")))
    assert f"backend {resume}" in again.proc.stdout, again.proc.stdout[-2000:]
    assert again.ranks[0]["first_step"] == 3, again.ranks[0]
    assert_close_per_step(again.ranks[0]["losses"], base.losses[2:], 1e-6, f"loss ({save} -> {resume})")


# --------------------------------------------------------------------------- which backend an EP plan gets
class _Meshes:
    spmd_dp = object()        # resolve_backend only asks whether a data-parallel axis exists


@needs_spmd
def test_ep_plans_get_spmd_types_silently(capsys):
    from cost_models.specs import load_model
    for plan in LAYOUTS.values():
        assert spmd_plan_unsupported(plan, load_model("moe-debug")) is None
        assert resolve_backend(plan, _Meshes(), announce=True, spec=load_model("moe-debug")) == "spmd_types"
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- the checker names a missing dispatch
def _dispatch_without_all_to_all(self, x, out_splits, in_splits):
    """Test-only dispatch that moves no data: as many rows as this rank should receive, made from its own
    tokens (right shape; wrong data, and still typed on the dense mesh, as a skipped all-to-all leaves it)."""
    return x.sum(0, keepdim=True).expand(sum(out_splits), -1)


def _checker_worker(rank: int, world: int, port: int, out_q) -> None:
    """One typechecked step of moe-debug (aux loss on) at dp_shard 4 x ep 2 on gloo, then one whose dispatch
    skips the all-to-all; rank 0 reports (first step's verdict, second step's error, the MoE output's type)."""
    import torch.distributed as dist
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        import spmd_types as spmd
        from cost_models.specs import load_model
        from executor.mesh import build_meshes
        from executor.moe_step import moe_layers, set_aux_loss_scale
        from executor.parallel import spmd_step
        from executor.parallel.parallelize import Precision, build_model_parts
        from executor.parallel.spmd_expert_parallel import SpmdExpertParallelExperts

        dist.init_process_group("gloo", rank=rank, world_size=world)
        plan = dataclasses.replace(LAYOUTS["dp4xep2"], backend="spmd_types")
        spec = load_model("moe-debug")
        meshes = build_meshes(plan, "cpu")
        stages = build_model_parts(spec, plan, meshes, precision=Precision(torch.float32, torch.float32),
                                   backend="spmd_types", device=torch.device("cpu"))
        assert set_aux_loss_scale(moe_layers(stages), spec, plan) > 0
        model = stages[0][1]
        out_types = []          # the routed experts' output under the checker (after the aux-loss gradient hook)
        ff = moe_layers(stages)[0][1]
        routed = ff.routed

        def typed_routed(x):
            out = routed(x)
            out_types.append(sorted(f"{a}: {t!r}" for a, t in spmd.get_local_type(out).items()))
            return out
        ff.routed = typed_routed
        tok = torch.randint(0, spec.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
        verdicts = []
        for broken in (False, True):
            if broken:
                SpmdExpertParallelExperts.dispatch = _dispatch_without_all_to_all
            try:
                loss = spmd_step.forward_backward(model, tok, tok.roll(-1, 1), meshes, plan, typecheck=True)
                verdicts.append("ok" if torch.isfinite(loss) else f"loss {loss}")
            except spmd.SpmdTypeError as e:
                verdicts.append(f"SpmdTypeError: {e}")
            model.zero_grad()
        if rank == 0:
            out_q.put((*verdicts, out_types[0]))
    except Exception:        # noqa: BLE001 (reported to the test)
        out_q.put(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@needs_spmd
@pytest.mark.distributed
@pytest.mark.slow
def test_checker_names_a_dispatch_that_skips_the_all_to_all():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_checker_worker, args=(r, 4, port, q)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        ok, broken, moe_out_type = q.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    assert ok == "ok", ok
    # the routed output is typed (Varying on the dense dp axis) also through the aux-loss gradient hook
    # (moe.AuxLossGrad, declared a local autograd function: unregistered, its output would be untyped)
    assert len(moe_out_type) == 1 and moe_out_type[0].endswith(": V"), moe_out_type
    # the experts' weights are typed on (efsdp, ep); tokens that never crossed are still on dp_shard
    assert broken.startswith("SpmdTypeError:"), broken
    assert "not orthogonal" in broken and "mesh_efsdp" in broken and "mesh_ep" in broken, broken
