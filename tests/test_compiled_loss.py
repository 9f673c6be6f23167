"""titan-run's loss of plain-tensor logits (tp 1): compiled with compile on (as TorchTitan does), else its fused
autograd Function (executor/parallel/fused_loss.py); ``loss_impl: eager`` runs ``F.cross_entropy`` on the upcast.
What each saves is measured here, and the cost model charges it so (cost_models/memory.py ``logit_bytes``,
``loss_fused``).

Eager, ``F.cross_entropy(logits.float())`` keeps the fp32 log-softmax output for backward (4 bytes per
logit, whatever the logits' dtype); compiled, Inductor fuses upcast, log-softmax and NLL and its backward
reads the logits themselves; the fused Function keeps the logits too.  Both keep the e-byte logits.
Measured with ``saved_tensors_hooks`` on torch's own compile (CPU), not assumed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cost_models.coefficients import Coefficients
from cost_models.estimate import estimate
from cost_models.memory import logit_bytes, loss_fused
from cost_models.memory import loss_compiled as model_loss_compiled
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from executor.parallel import fused_loss
from executor.parallel.fused_loss import IGNORE_INDEX, fused_cross_entropy
from executor.parallel.tensor_parallel import cross_entropy, loss_compiled, loss_kind, set_loss
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import assert_titan_run_refuses

N, V, H = 256, 1024, 32


def _saved_bytes_per_logit(dtype: torch.dtype, kind: str) -> tuple[float, torch.Tensor, tuple]:
    """(distinct logit-sized bytes the loss saves for backward, per logit; the loss; the input gradients)."""
    torch.manual_seed(0)
    x = torch.randn(1, N, H, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (1, N))
    logits = x @ w.t()                 # the head's output: the matmul itself saves x and w, not the logits
    set_loss(kind)
    seen: dict[int, int] = {}

    def pack(t):
        if t.numel() >= N * V:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = cross_entropy(logits, labels)
        loss.backward()
    finally:
        set_loss("fused")
    return sum(seen.values()) / (N * V), loss.detach(), (x.grad, w.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_and_compiled_losses_keep_only_the_logits_and_match_eager(dtype):
    eager_bytes, eager_loss, eager_grads = _saved_bytes_per_logit(dtype, "eager")
    e = torch.finfo(dtype).bits / 8
    assert eager_bytes == pytest.approx(4.0)          # the fp32 log-softmax output
    wl = Workload(seq_len=64, global_batch=8, dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    # the cost model keeps what was measured: eager 4 (pp 1, loss_impl eager), fused or compiled e (auto)
    tab = CandidateTable.from_plans([Plan(dp_shard=8, compile=False), Plan(dp_shard=8, compile=True)])
    assert list(logit_bytes(tab, Workload(seq_len=64, global_batch=8, dtype=wl.dtype, loss_impl="eager"))[0]) \
        == [eager_bytes, eager_bytes]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for kind, plan_compiles in (("fused", 0), ("compiled", 1)):
        kept_bytes, loss, grads = _saved_bytes_per_logit(dtype, kind)
        assert kept_bytes == pytest.approx(e), kind     # the logits themselves
        assert logit_bytes(tab, wl)[0][plan_compiles] == kept_bytes
        torch.testing.assert_close(loss, eager_loss, **tol)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_loss_equals_the_upcast_cross_entropy_block_by_block(dtype, monkeypatch):
    """Loss and logit gradient of the fused Function against ``F.cross_entropy`` on the fp32 upcast, with
    ignored labels and with blocks of 7 tokens (the last one short): equal to fp32 rounding, and the gradient in
    the logits' dtype."""
    torch.manual_seed(1)
    logits = (3 * torch.randn(50, 300)).to(dtype)
    labels = torch.randint(0, 300, (50,))
    labels[::6] = IGNORE_INDEX
    monkeypatch.setattr(fused_loss, "BLOCK_ELEMENTS", 7 * 300)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = F.cross_entropy(a.float(), labels)
    ref.backward()
    got = fused_cross_entropy(b, labels)
    got.backward()
    assert got.dtype == torch.float32 and b.grad.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(b.grad[::6]) == 0          # ignored tokens get no gradient


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_loss_backward_adds_one_gradient_in_the_logits_dtype(dtype, monkeypatch):
    """At the turn the fused Function allocates the gradient (e bytes per logit) and, below fp32, one block's
    fp32 temporary (fp32 logits: the softmax is written into the gradient), where the eager path holds two
    more fp32 copies: every logit-block-sized allocation of backward, seen by a dispatch mode watching
    outputs, with blocks of 128 tokens."""
    torch.manual_seed(2)
    n, v = 512, 2048
    monkeypatch.setattr(fused_loss, "BLOCK_ELEMENTS", 128 * v)
    logits = torch.randn(n, v, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    loss = fused_cross_entropy(logits, labels)
    storages: dict[int, int] = {}           # storages backward writes, by address (views of one count once)

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                     if isinstance(a, torch.Tensor)}          # views and in-place or out= writes allocate nothing
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if (isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= 128 * v
                        and t.untyped_storage().data_ptr() not in given):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return out
    with Watch():
        torch.autograd.grad(loss, logits)    # (no accumulation into .grad: a leaf's copy is not the loss's)
    e = torch.finfo(dtype).bits // 8
    gradient, block = e * n * v, 4 * 128 * v
    big = sorted(storages.values())
    assert big.count(gradient) == 1 and max(big) == gradient                  # the gradient, once
    if dtype == torch.float32:
        assert big == [gradient]                                              # the softmax written into it
    else:                                                                     # and one block at a time
        assert set(big) == {block, gradient} and len(big) <= 1 + n // 128


def test_titan_run_compiles_the_loss_exactly_where_the_cost_model_says():
    """compile on, tp 1, loss_impl auto or compiled: compiled; otherwise at tp 1 the fused Function under auto,
    F.cross_entropy under eager or compiled; tp > 1 (vocab-sharded logits): not fused -- the executor's rule and
    the memory model's, candidate by candidate."""
    plans = [Plan(dp_shard=4, compile=True), Plan(dp_shard=4, compile=False), Plan(dp_shard=2, tp=2, compile=True),
             Plan(dp_shard=2, pp=2, n_microbatches=2, compile=True), Plan(dp_shard=2, tp=2, compile=False)]
    tab = CandidateTable.from_plans(plans)
    kinds = {impl: [loss_kind(p, Workload(seq_len=64, global_batch=8, loss_impl=impl)) for p in plans]
             for impl in ("auto", "eager", "compiled")}
    assert kinds == {"auto": ["compiled", "fused", "fused", "compiled", "fused"],
                     "eager": ["eager"] * 5,
                     "compiled": ["compiled", "eager", "eager", "compiled", "eager"]}
    for impl, ks in kinds.items():
        wl = Workload(seq_len=64, global_batch=8, loss_impl=impl)
        # tp > 1: the logits are vocab-sharded and the vocab-parallel loss keeps its fp32 exponentials
        expect = [k != "eager" and p.tp == 1 for k, p in zip(ks, plans)]
        assert list(loss_fused(tab, wl)) == expect
        assert [wl.loss_fused_at(p.compile, p.tp) for p in plans] == expect
        assert list(model_loss_compiled(tab, wl)) == [loss_compiled(p, wl) for p in plans]


def test_compiled_loss_lowers_the_planned_peak_of_a_large_vocabulary():
    """Llama 3 8B (128K vocabulary) at tp 1 with compile: the logits term drops by what the eager loss's
    fp32 copies hold, 12 - 2 bytes per logit of a micro-batch (the head's output is the loss's input)."""
    m, hw = load_model("llama3-8b"), load_hardware("h100-sxm")
    tab = CandidateTable.from_plans([Plan(dp_shard=8, microbatch=1, n_microbatches=1, ac="full", compile=True)])
    eager, auto = (estimate(tab, m, hw, Workload(seq_len=8192, global_batch=8, loss_impl=li), Coefficients()).memory
                   for li in ("eager", "auto"))
    per_logit = 8192 * m.vocab_size
    assert eager["logits"][0] - auto["logits"][0] == pytest.approx((12.0 - 4.0) * per_logit, rel=1e-12)
    assert auto["logits"][0] > 0


def test_titan_run_takes_loss_impl_auto_eager_or_compiled(tmp_path):
    """A plan file's ``loss_impl: fused`` names another framework's kernel: refused in one line, compiled or
    not (titan-run's own fused and compiled losses are ``auto``); auto, eager and compiled are taken."""
    for plan in ({"dp_shard": 2, "microbatch": 2, "compile": False}, {"dp_shard": 2, "microbatch": 2, "compile": True}):
        assert_titan_run_refuses(tmp_path, "loss_impl", "fused", ["auto", "eager", "compiled"], plan=plan)
