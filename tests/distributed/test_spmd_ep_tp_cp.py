"""Expert parallel together with tensor and context parallel on the spmd_types backend (and on dtensor).

moe-debug with ``aux_loss_coef: 0`` (as test_spmd_ep.py / test_moe_parity.py) trains 5 steps at seq 32,
global batch 4, fp32, on each layout and each backend: loss and grad norm per step within 1e-4 relative
of one process, and the two backends within 1e-5 of each other.

The experts' mesh is ``(dp_replicate,) efsdp, ep, tp`` (``Meshes.expert_spmd``, ``mesh._expert_tp_mesh``):
ep is carved out of dp_shard x cp, tp stays innermost and the experts are R on it (the MoE layers run on
the sequence-parallel local tokens of this rank's context-parallel chunk).  Layouts:

* ``cp2xtp2xep2`` (4 processes, quick): ep borrows both cp ranks (dp_shard 1, efsdp 1), so the tokens
  cross from the dense mesh's ``cp`` axis to the experts' ``efsdp x ep`` at the dispatch;
* ``dp2xcp2xtp2xep2`` (8, slow): experts FSDP-sharded over efsdp 2 (the dp_shard ranks), ep = cp;
* ``dp2xcp2xtp2xep4`` (8, slow): ep spans dp_shard x cp (efsdp 1);
* ``hsdp2xcp2xtp2xep2`` (8, slow): the experts' mesh is (dp_replicate 2, efsdp 1, ep 2, tp 2), the
  experts replicated (HSDP) over dp_replicate;
* ``pp2xdp2xcp2xtp2xep2`` (16, slow): all five axes, each pipeline stage's experts typed the same way.

The checker (``train.spmd_typecheck=true``) runs the cp2xtp2xep2 steps with the same losses.  On a fake
process group (no processes), every rank of several layouts checks that the experts' mesh axes span the ranks
of ``Meshes.ep`` / ``efsdp`` / ``tp`` / ``dp_replicate`` and that communication on them is attributed to those
axes (``Meshes.group_names``).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from cost_models.specs import load_model
from executor.mesh import build_meshes
from executor.parallel.fsdp import spmd_fsdp_supported
from executor.parallel.parallelize import resolve_backend, spmd_plan_unsupported
from search_spaces.plan import Plan
from tests.distributed.harness import (in_fresh_process, assert_backends_agree, assert_close_per_step,
                                       backend_params, run_on_its_backend, run_titan)
from tests.distributed.test_moe_parity import GLOBAL_BATCH, SEQ_LEN, moe_spec_file

needs_spmd = pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))
LAYOUTS = {"cp2xtp2xep2": Plan(dp_shard=1, cp=2, tp=2, ep=2, microbatch=4),
           "dp2xcp2xtp2xep2": Plan(dp_shard=2, cp=2, tp=2, ep=2, microbatch=2),
           "dp2xcp2xtp2xep4": Plan(dp_shard=2, cp=2, tp=2, ep=4, microbatch=2),
           "hsdp2xcp2xtp2xep2": Plan(dp_replicate=2, dp_shard=1, cp=2, tp=2, ep=2, microbatch=2),
           "pp2xdp2xcp2xtp2xep2": Plan(pp=2, dp_shard=2, cp=2, tp=2, ep=2, microbatch=1, n_microbatches=2)}
SLOW = {"dp2xcp2xtp2xep2", "dp2xcp2xtp2xep4", "hsdp2xcp2xtp2xep2", "pp2xdp2xcp2xtp2xep2"}     # 8 and 16 processes


# on the dtensor fallback EP, TP and CP each keep their own quick cases in the CI run; their composite here runs
# there under -m slow
PAIRS, AGREE = backend_params(LAYOUTS, slow=SLOW, dtensor_slow={"cp2xtp2xep2"})


def _run(layout: str, backend: str):
    return run_on_its_backend(dataclasses.replace(LAYOUTS[layout], backend=backend), model=moe_spec_file(),
                              seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, reference_learns_by=1.0, timeout=1200)


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout, backend", PAIRS)
def test_ep_tp_cp_matches_single_process(layout, backend):
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
def test_the_typecheck_switch_runs_ep_tp_cp_steps_under_the_checker():
    run = run_titan(dataclasses.replace(LAYOUTS["cp2xtp2xep2"], backend="spmd_types"), model=moe_spec_file(),
                    seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, steps=2, extra={"train.spmd_typecheck": True})
    assert "backend spmd_types" in run.proc.stdout, run.proc.stdout[-2000:]
    assert "note: backend" not in run.proc.stderr, run.proc.stderr[-2000:]
    assert_close_per_step(run.losses, _run("cp2xtp2xep2", "spmd_types").losses[:2], 1e-6,
                          "loss (checker on vs off)")


# --------------------------------------------------------------------------- which backend the plan gets
class _Meshes:
    spmd_dp = object()        # resolve_backend only asks whether a data-parallel axis exists


@needs_spmd
def test_ep_tp_cp_plans_get_spmd_types_silently(capsys):
    spec = load_model("moe-debug")
    for plan in LAYOUTS.values():
        assert spmd_plan_unsupported(plan, spec) is None, plan.describe()
        assert resolve_backend(plan, _Meshes(), announce=True, spec=spec) == "spmd_types", plan.describe()
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- the experts' mesh, rank by rank
MESH_PLANS = [Plan(cp=2, tp=2, ep=2), Plan(dp_shard=2, cp=2, tp=2, ep=2), Plan(dp_shard=2, cp=2, tp=2, ep=4),
              Plan(dp_replicate=2, dp_shard=1, cp=2, tp=2, ep=2), Plan(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4),
              Plan(pp=2, dp_shard=2, cp=2, tp=2, ep=2, n_microbatches=2), Plan(dp_shard=4, tp=2, ep=2),
              Plan(dp_shard=2, cp=2, ep=2)]


def _expert_mesh_mismatches(plans: list[Plan]) -> list[str]:
    """For every rank of every plan on a fake process group: what differs between the experts' mesh axes and
    the matching dense / expert axes, or where group_names does not name an experts' mesh axis."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    out = []
    for plan in plans:
        for rank in range(plan.world_size):
            dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=FakeStore())
            try:
                m = build_meshes(plan, "cpu")
                names = m.group_names()
                for axis in m.expert_spmd.mesh_dim_names:
                    got = m.expert_spmd[axis].mesh.tolist()
                    want = getattr(m, axis).mesh.tolist()
                    if got != want:
                        out.append(f"{plan.describe()} rank {rank} {axis}: {got} vs {want}")
                    group = m.expert_spmd.get_group(axis).group_name
                    if names.get(group) != (axis if len(got) > 1 else "self"):
                        out.append(f"{plan.describe()} rank {rank} {axis}: group_names says {names.get(group)}")
            finally:
                dist.destroy_process_group()
    return out


def test_the_experts_mesh_spans_the_ep_efsdp_and_tp_ranks_on_every_rank():
    assert in_fresh_process(_expert_mesh_mismatches, MESH_PLANS) == []
