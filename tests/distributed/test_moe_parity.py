"""Mixture-of-experts training through `titan-run` matches a single-process run, layout by layout.

Real gloo processes (torchrun via tests/distributed/harness.py,
assert_matches_single_process) train moe-debug for 5 steps at seq_len 32, global
batch 4, fp32; the global loss after every step must be within 1e-4 (relative)
of the single-process run of the same model, data and seed.  Routing is dropless, so every layout computes the same
function; the auxiliary load-balancing loss is per rank's micro-batch (layout
dependent, see executor/moe_step.py), so these runs use a copy of moe-debug
with ``aux_loss_coef: 0`` (built with ``cost_models.specs.model_from_dict``).

The global gradient norm (before clipping) of every step is compared too: AdamW
is nearly invariant to a constant gradient scale, so a wrong expert-gradient
divide factor moves the loss by only ~1e-4 in 5 steps, but the norm at once.

Layouts: EP 2 (efsdp 1), EP 2 with per-block compile, EP 4, FSDP x EP (dp_shard 4, ep 2: efsdp 2), HSDP x EP,
DP x TP x EP (MoE layers on the sequence-parallel local tokens, grads summed
over tp), CP x EP, and all five axes: pp2 x dp_shard2 x tp2 x cp2 with ep 2 on
16 processes (the harness takes /tmp/titan_heavy.lock for > 4 processes).

Auxiliary loss under pipeline parallel: moe-debug with ``aux_loss_coef: 1.0``, PP 2 vs one
process with the same micro-batches (the aux loss is per micro-batch).
"""
from __future__ import annotations

import functools

import pytest

from cost_models.specs import load_model, model_from_dict
from search_spaces.plan import Plan
from tests.distributed.harness import (assert_close_per_step, assert_matches_single_process, model_spec_file,
                                      reference_run)

pytestmark = pytest.mark.distributed
GLOBAL_BATCH = 4
SEQ_LEN = 32
# the reference's loss must drop by more than 1.0 in the 5 steps; losses and grad norms within 1e-4
matches_single_process = functools.partial(assert_matches_single_process, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                                           reference_learns_by=1.0)


@functools.lru_cache(maxsize=None)
def moe_spec_file() -> str:
    """moe-debug with aux_loss_coef 0, as a YAML file titan-run can load (kept for the session)."""
    d = load_model("moe-debug").to_dict()
    d.update(name="moe-debug-noaux", aux_loss_coef=0.0)
    model_from_dict(d)                       # validates
    return model_spec_file(d, "moe-debug-noaux")


@pytest.fixture(scope="module")
def noaux():
    return moe_spec_file()


def test_ep2(noaux):
    matches_single_process(Plan(dp_shard=2, ep=2, microbatch=2), model=noaux)


@pytest.mark.slow
def test_ep4(noaux):
    matches_single_process(Plan(dp_shard=4, ep=4, microbatch=1), model=noaux)


@pytest.mark.slow
def test_fsdp_x_ep_efsdp2(noaux):
    # experts: 4 per rank (ep 2), FSDP-sharded over efsdp 2; gradient divide factor 4
    matches_single_process(Plan(dp_shard=4, ep=2, microbatch=1), model=noaux)


@pytest.mark.slow
def test_hsdp_x_ep(noaux):
    # experts' FSDP mesh is 2-D (dp_replicate 2, efsdp 1)
    matches_single_process(Plan(dp_replicate=2, dp_shard=2, ep=2, microbatch=1), model=noaux)


@pytest.mark.slow
def test_dp_x_tp_x_ep(noaux):
    matches_single_process(Plan(dp_shard=2, tp=2, ep=2, microbatch=2), model=noaux)


@pytest.mark.slow
def test_dp_x_tp_x_ep_compiled(noaux):
    # compiled MoE blocks: the attention's TP boundaries traced into the graph (erased), the EP all-to-alls typed
    matches_single_process(Plan(dp_shard=2, tp=2, ep=2, microbatch=2, compile=True), model=noaux)


@pytest.mark.slow
def test_cp_x_ep_with_grad_accumulation(noaux):
    matches_single_process(Plan(cp=2, ep=2, microbatch=2, n_microbatches=2), model=noaux)


@pytest.mark.slow
def test_fsdp_x_ep_compiled(noaux):
    # per-block torch.compile; the routed part of each MoE layer (data-dependent shapes, host-side
    # all-to-all splits) runs eagerly (torch.compiler.disable), the rest of the block compiled
    matches_single_process(Plan(dp_shard=2, ep=2, microbatch=2, compile=True), model=noaux)


@pytest.mark.slow
def test_all_five_axes_pp_dp_tp_cp_ep(noaux):
    matches_single_process(Plan(pp=2, dp_shard=2, tp=2, cp=2, ep=2, microbatch=1, n_microbatches=2), model=noaux,
                           timeout=1200)


# --------------------------------------------------------------------------- auxiliary loss under PP
@functools.lru_cache(maxsize=None)
def aux_spec_file() -> str:
    """moe-debug with a large aux_loss_coef (1.0), so the aux loss moves the 5-step losses well
    beyond the 1e-4 tolerance (the preset's 0.01 would hardly show)."""
    d = load_model("moe-debug").to_dict()
    d.update(name="moe-debug-aux1", aux_loss_coef=1.0)
    model_from_dict(d)
    return model_spec_file(d, "moe-debug-aux1")


def aux_terms(run) -> list[float]:
    return [r["moe"]["aux_loss_term"] for r in run.metrics]


@pytest.mark.slow
def test_aux_loss_under_pipeline_parallel(noaux):
    """The aux loss trains under PP (moe.AuxLossGrad adds its gradient in each MoE layer's backward).

    The aux loss is per micro-batch, so the reference is one process with the same micro-batches
    (2 of 2 sequences, gradient accumulation); both runs log the same quantity, the mean
    cross-entropy (the aux term is reported separately).  The aux-free reference must differ,
    or the comparison would not show that the aux gradient arrives at all."""
    got, want = assert_matches_single_process(
        Plan(dp_shard=1, pp=2, microbatch=2, n_microbatches=2), model=aux_spec_file(), seq_len=SEQ_LEN,
        global_batch=GLOBAL_BATCH, reference_plan=Plan(microbatch=2, n_microbatches=2), reference_learns_by=None)
    # the logged aux term (coef * mean aux loss) too: the stages' shape-inference forwards of
    # the first step must not count
    assert_close_per_step(aux_terms(got), aux_terms(want), what="aux loss term")
    assert all(a > 0.5 for a in aux_terms(want)), aux_terms(want)
    want, noaux_ref = want.losses, reference_run(model=noaux, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH).losses
    assert max(abs(a - b) / abs(b) for a, b in zip(want, noaux_ref)) > 1e-3, (want, noaux_ref)
