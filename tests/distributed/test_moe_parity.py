"""Mixture-of-experts training through `titan-run` matches a single-process run, layout by layout.

Real gloo processes (torchrun via tests/distributed/harness.py) train moe-debug
for 5 steps at seq_len 32, global batch 4, fp32; the global loss after every
step must be within 1e-4 (relative) of the single-process run of the same
model, data and seed.  Routing is dropless, so every layout computes the same
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
import json
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from cost_models.specs import load_model, model_from_dict
from search_spaces.plan import Plan
from tests.distributed.harness import (DEFAULT_TRAIN, ROOT, _heavy_lock, assert_losses_close, env,
                                       titan_run_cmd)

pytestmark = pytest.mark.distributed
GLOBAL_BATCH = 4
SEQ_LEN = 32


@functools.lru_cache(maxsize=None)
def moe_spec_file() -> str:
    """moe-debug with aux_loss_coef 0, as a YAML file titan-run can load (kept for the session)."""
    d = load_model("moe-debug").to_dict()
    d.update(name="moe-debug-noaux", aux_loss_coef=0.0)
    model_from_dict(d)                       # validates
    path = Path(tempfile.mkdtemp(prefix="titan-moe-spec-")) / "moe-debug-noaux.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def run_moe(plan: Plan, nproc: int, steps: int = 5, timeout: float = 900, model: str | None = None,
            with_aux: bool = False) -> tuple[list[float], ...]:
    """(losses, grad norms[, aux-loss terms]) per step of a real titan-run of `model` (default: the
    aux-free moe-debug), from rank 0's metrics.jsonl."""
    with tempfile.TemporaryDirectory(prefix="titan-moe-") as tmp:
        tmp = Path(tmp)
        f = tmp / "plan.yaml"
        f.write_text(yaml.safe_dump({
            "model": model or moe_spec_file(), "workload": {"seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH},
            "plan": plan.to_dict(), "train": {**DEFAULT_TRAIN, "steps": steps}}))
        cmd = titan_run_cmd("--plan", str(f), "--nproc-per-node", str(nproc), "--run-dir", str(tmp / "run"))
        with _heavy_lock(nproc > 4):
            p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"titan-run failed (exit {p.returncode}) for {plan.describe()} on {nproc} procs:\n"
                               f"--- stdout ---\n{p.stdout[-4000:]}\n--- stderr ---\n{p.stderr[-8000:]}")
        recs = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        per_rank = [json.loads((tmp / "run" / "ranks" / f"rank{r}.json").read_text())["losses"]
                    for r in range(nproc)]
    losses = [r["loss"] for r in recs]
    assert all(x == per_rank[0] for x in per_rank), f"ranks disagree on the losses: {per_rank}"
    assert losses == per_rank[0]
    if with_aux:
        return losses, [r["grad_norm"] for r in recs], [r["moe"]["aux_loss_term"] for r in recs]
    return losses, [r["grad_norm"] for r in recs]


@functools.lru_cache(maxsize=None)
def reference() -> tuple[list[float], list[float]]:
    return run_moe(Plan(microbatch=GLOBAL_BATCH), 1)


def _check(plan: Plan, nproc: int | None = None, timeout: float = 900):
    got, got_norm = run_moe(plan, nproc or plan.world_size, timeout=timeout)
    want, want_norm = reference()
    assert want[-1] < want[0] - 1.0, f"the reference does not learn: {want}"
    assert_losses_close(got, want)
    for i, (g, w) in enumerate(zip(got_norm, want_norm)):
        assert abs(g - w) <= 1e-4 * w, f"step {i + 1}: grad norm {g!r} vs reference {w!r}"


def test_ep2():
    _check(Plan(dp_shard=2, ep=2, microbatch=2))


@pytest.mark.slow
def test_ep4():
    _check(Plan(dp_shard=4, ep=4, microbatch=1))


@pytest.mark.slow
def test_fsdp_x_ep_efsdp2():
    # experts: 4 per rank (ep 2), FSDP-sharded over efsdp 2; gradient divide factor 4
    _check(Plan(dp_shard=4, ep=2, microbatch=1))


@pytest.mark.slow
def test_hsdp_x_ep():
    # experts' FSDP mesh is 2-D (dp_replicate 2, efsdp 1)
    _check(Plan(dp_replicate=2, dp_shard=2, ep=2, microbatch=1))


@pytest.mark.slow
def test_dp_x_tp_x_ep():
    _check(Plan(dp_shard=2, tp=2, ep=2, microbatch=2))


@pytest.mark.slow
def test_cp_x_ep_with_grad_accumulation():
    _check(Plan(cp=2, ep=2, microbatch=2, n_microbatches=2))


@pytest.mark.slow
def test_fsdp_x_ep_compiled():
    # per-block torch.compile; the routed part of each MoE layer (data-dependent shapes, host-side
    # all-to-all splits) runs eagerly (torch.compiler.disable), the rest of the block compiled
    _check(Plan(dp_shard=2, ep=2, microbatch=2, compile=True))


@pytest.mark.slow
def test_all_five_axes_pp_dp_tp_cp_ep():
    _check(Plan(pp=2, dp_shard=2, tp=2, cp=2, ep=2, microbatch=1, n_microbatches=2), timeout=1200)


# --------------------------------------------------------------------------- auxiliary loss under PP
@functools.lru_cache(maxsize=None)
def aux_spec_file() -> str:
    """moe-debug with a large aux_loss_coef (1.0), so the aux loss moves the 5-step losses well
    beyond the 1e-4 tolerance (the preset's 0.01 would hardly show)."""
    d = load_model("moe-debug").to_dict()
    d.update(name="moe-debug-aux1", aux_loss_coef=1.0)
    model_from_dict(d)
    path = Path(tempfile.mkdtemp(prefix="titan-moe-spec-")) / "moe-debug-aux1.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


@pytest.mark.slow
def test_aux_loss_under_pipeline_parallel():
    """The aux loss trains under PP (moe.AuxLossGrad adds its gradient in each MoE layer's backward).

    The aux loss is per micro-batch, so the reference is one process with the same micro-batches
    (2 of 2 sequences, gradient accumulation); both runs log the same quantity, the mean
    cross-entropy (the aux term is reported separately).  The aux-free reference must differ,
    or the comparison would not show that the aux gradient arrives at all."""
    model = aux_spec_file()
    want, want_norm, want_aux = run_moe(Plan(microbatch=2, n_microbatches=2), 1, model=model, with_aux=True)
    got, got_norm, got_aux = run_moe(Plan(dp_shard=1, pp=2, microbatch=2, n_microbatches=2), 2, model=model,
                                     with_aux=True)
    assert_losses_close(got, want)
    for i, (g, w) in enumerate(zip(got_norm, want_norm)):
        assert abs(g - w) <= 1e-4 * w, f"step {i + 1}: grad norm {g!r} vs reference {w!r}"
    # the logged aux term (coef * mean aux loss) too: the stages' shape-inference forwards of
    # the first step must not count
    assert_losses_close(got_aux, want_aux)
    assert all(a > 0.5 for a in want_aux), want_aux
    noaux, _ = reference()
    assert max(abs(a - b) / abs(b) for a, b in zip(want, noaux)) > 1e-3, (want, noaux)
