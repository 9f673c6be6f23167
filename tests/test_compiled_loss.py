"""titan-run compiles its loss with compile on at tp 1 (as TorchTitan does): what that saves is measured here,
and the cost model charges it so (cost_models/memory.py ``logit_bytes``, ``loss_fused``).

Eager, ``F.cross_entropy(logits.float())`` keeps the fp32 log-softmax output for backward (4 bytes per
logit, whatever the logits' dtype); compiled, Inductor fuses upcast, log-softmax and NLL and its backward
reads the logits themselves: it keeps the e-byte logits and per-token statistics.  Measured with
``saved_tensors_hooks`` on torch's own compile (CPU), not assumed.
"""
from __future__ import annotations

import pytest
import torch

from cost_models.coefficients import Coefficients
from cost_models.compute import Rates
from cost_models.estimate import estimate
from cost_models.memory import logit_bytes, loss_fused
from cost_models.memory import loss_compiled as model_loss_compiled
from cost_models.specs import load_hardware, load_model
from cost_models.step_time import head_times
from cost_models.workload import Workload
from executor.parallel.tensor_parallel import compile_loss, cross_entropy, loss_compiled
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import assert_titan_run_refuses

N, V, H = 256, 1024, 32


def _saved_bytes_per_logit(dtype: torch.dtype, compiled: bool) -> tuple[float, torch.Tensor, tuple]:
    """(distinct logit-sized bytes the loss saves for backward, per logit; the loss; the input gradients)."""
    torch.manual_seed(0)
    x = torch.randn(1, N, H, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (1, N))
    logits = x @ w.t()                 # the head's output: the matmul itself saves x and w, not the logits
    compile_loss(compiled)
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
        compile_loss(False)
    return sum(seen.values()) / (N * V), loss.detach(), (x.grad, w.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compiled_loss_keeps_only_the_logits_and_matches_eager(dtype):
    eager_bytes, eager_loss, eager_grads = _saved_bytes_per_logit(dtype, compiled=False)
    fused_bytes, fused_loss, fused_grads = _saved_bytes_per_logit(dtype, compiled=True)
    e = torch.finfo(dtype).bits / 8
    assert eager_bytes == pytest.approx(4.0)          # the fp32 log-softmax output
    assert fused_bytes == pytest.approx(e)            # the logits themselves
    # the cost model keeps what was measured: eager 4 (pp 1), fused e
    wl = Workload(seq_len=64, global_batch=8, dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    tab = CandidateTable.from_plans([Plan(dp_shard=8, compile=False), Plan(dp_shard=8, compile=True)])
    kept, _ = logit_bytes(tab, wl)
    assert list(kept) == [eager_bytes, fused_bytes]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_loss, eager_loss, **tol)
    for a, b in zip(fused_grads, eager_grads):
        torch.testing.assert_close(a, b, **tol)


def test_titan_run_compiles_the_loss_exactly_where_the_cost_model_says():
    """compile on, tp 1, loss_impl auto or fused: compiled; tp > 1 (vocab-sharded logits), compile off or
    loss_impl eager: eager -- the executor's rule and the memory model's, candidate by candidate."""
    plans = [Plan(dp_shard=4, compile=True), Plan(dp_shard=4, compile=False), Plan(dp_shard=2, tp=2, compile=True),
             Plan(dp_shard=2, pp=2, n_microbatches=2, compile=True)]
    tab = CandidateTable.from_plans(plans)
    for impl in ("auto", "eager"):
        wl = Workload(seq_len=64, global_batch=8, loss_impl=impl)
        assert list(loss_fused(tab, wl)) == [loss_compiled(p, wl) for p in plans]
    assert [loss_compiled(p, Workload(seq_len=64, global_batch=8)) for p in plans] == [True, False, False, True]


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


def test_titan_run_takes_loss_impl_auto_or_eager(tmp_path):
    """A plan file's ``loss_impl: fused`` names another framework's kernel: refused in one line, compiled or
    not (titan-run's own compiled loss is ``auto``); auto and eager are taken."""
    for plan in ({"dp_shard": 2, "microbatch": 2, "compile": False}, {"dp_shard": 2, "microbatch": 2, "compile": True}):
        assert_titan_run_refuses(tmp_path, "loss_impl", "fused", ["auto", "eager"], plan=plan)
