"""What activation checkpointing really keeps for backward, against the cost model's per-layer terms.

One transformer block is run forward under the executor's own wrapping (``apply_ac``, and
``apply_tp`` for the tp case); every tensor produced during that forward is recorded by a
``TorchDispatchMode`` with a weak reference to its storage.  After the forward (and a
``gc.collect()``), the storages still alive -- other than the parameters, the block's inputs and
its output -- are exactly what autograd and the checkpoint keep until backward: with
``selective`` the outputs the policy saves (``torch.utils.checkpoint``'s selective-checkpoint
cache), with ``none`` autograd's saved tensors, with ``full`` nothing but the input.  Their bytes
are compared with ``cost_models.activations.layer_activation_terms`` for the same dims, whose block-input
term counts the input the checkpoint keeps for its recomputation (so the input is added to the
measurement).

Exact (to the byte) for ``selective`` and ``full`` at tp 1 (llama3-debug, GQA), fp32 and bf16.  Not
checked: MLA blocks, whose value width differs from the query width, so CPU SDPA takes its math
path and keeps the s x s scores (``bmm`` outputs) that the cost model's fused-attention term does
not have (on GPUs a fused kernel runs); MoE blocks, whose CPU expert matmuls are padded to the
busiest expert (routing-dependent sizes).  At tp 2
(sequence parallel, one rank of a fake process group) the executor also keeps the outputs of the
two reduce-scatters (after the row-parallel ``wo`` and ``w2``: ``2 * e * dim / tp`` bytes per
token), which the cost model's ``matmul`` policy does not count yet: that term is named below and
added explicitly.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing.reductions import StorageWeakRef
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from cost_models.activations import FULL, FULL_TP, SCORE, SEQ, SEQ_TP, SHARD, layer_activation_terms
from cost_models.specs import load_model
from cost_models.workload import Workload
from executor.models.layers import rope_cos_sin
from executor.models.llama import TransformerBlock
from executor.parallel.activation_checkpoint import apply_ac
from executor.parallel.tensor_parallel import apply_tp

BATCH, SEQ_LEN = 2, 64


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding the data of `t` (the local shard of a DTensor, the inner tensor of a wrapper)."""
    while is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t


class _Outputs(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.produced: list[tuple[str, StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = _plain(t).untyped_storage()
                self.produced.append((str(func), StorageWeakRef(st), st.data_ptr(), st.nbytes()))
        return out


class _OneBlock(nn.Module):
    """A model of one block (what apply_tp / apply_ac act on: ``model.layers``)."""

    def __init__(self, spec):
        super().__init__()
        self.layers = nn.ModuleDict({"0": TransformerBlock(0, spec)})


def kept_for_backward(spec, ac: str, dtype: torch.dtype, tp_mesh=None, policy: str = "matmul"
                      ) -> tuple[int, dict[str, int]]:
    """(bytes this rank keeps for backward after one block's forward, bytes by producing op); `policy`: the
    workload's ``selective_ac`` under ``ac: selective``."""
    torch.manual_seed(0)
    model = _OneBlock(spec)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
    apply_ac(model, ac, policy)
    model.to(dtype)
    tp = tp_mesh.size() if tp_mesh is not None else 1
    x = torch.randn(BATCH, SEQ_LEN // tp, spec.dim, dtype=dtype, requires_grad=True)   # sequence-sharded under SP
    rope_dim = spec.qk_rope_head_dim if spec.attention == "mla" else spec.head_dim
    cos, sin = rope_cos_sin(torch.arange(SEQ_LEN), rope_dim, spec.rope_theta, dtype)
    rec = _Outputs()
    with rec:
        out = model.layers["0"](x, cos, sin)
    gc.collect()
    not_activations = {_plain(t).untyped_storage().data_ptr() for t in [out, x, cos, sin, *model.parameters()]}
    seen, by_op = set(), {}
    for name, ref, ptr, nbytes in rec.produced:
        if ref.expired() or ptr in not_activations or ptr in seen:
            continue
        seen.add(ptr)
        by_op[name] = by_op.get(name, 0) + nbytes
    out.float().sum().backward()          # the kept tensors were usable: backward runs
    assert x.grad is not None
    input_bytes = x.numel() * x.element_size()            # kept by the checkpoint for its recomputation
    return sum(by_op.values()) + (input_bytes if ac != "none" else 0), by_op


def modelled_bytes(spec, ac: str, dtype: str, tp: int, policy: str = "matmul") -> float:
    """The cost model's bytes per rank for the same block and tokens (tp: sequence-parallel, fsdp2 layout)."""
    t = layer_activation_terms(spec, Workload(seq_len=SEQ_LEN, global_batch=1, dtype=dtype, selective_ac=policy),
                               moe=False, ac=ac, compiled=False)
    per_token = ((t[SEQ] + t[SHARD] + t[SCORE] * SEQ_LEN) / tp + t[FULL]
                 + ((t[FULL_TP] + t[SEQ_TP] / tp) if tp > 1 else 0.0))
    return per_token * BATCH * SEQ_LEN


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("ac", ["selective", "full"])
def test_saved_bytes_match_the_cost_model(dtype, ac):
    spec = load_model("llama3-debug")
    measured, by_op = kept_for_backward(spec, ac, torch.float32 if dtype == "fp32" else torch.bfloat16)
    assert measured == modelled_bytes(spec, ac, dtype, tp=1), by_op
    if ac == "selective":
        # what the policy keeps: matmul and attention outputs only, no elementwise op
        assert set(by_op) <= {"aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"}, by_op


def test_no_checkpointing_keeps_more_than_selective():
    spec = load_model("llama3-debug")
    none, _ = kept_for_backward(spec, "none", torch.float32)
    selective, _ = kept_for_backward(spec, "selective", torch.float32)
    full, _ = kept_for_backward(spec, "full", torch.float32)
    assert full < selective < none


@pytest.fixture
def tp2_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_selective_under_tensor_parallel(tp2_mesh):
    spec = load_model("llama3-debug")
    tp, e = 2, 4
    measured, by_op = kept_for_backward(spec, "selective", torch.float32, tp_mesh=tp2_mesh)
    # the reduce-scatter outputs of the two row-parallel matmuls (wo, w2), sequence-sharded residual-stream
    # tensors: the SEQ_TP term
    reduce_scatter = 2 * e * spec.dim / tp * BATCH * SEQ_LEN
    assert by_op["_c10d_functional.reduce_scatter_tensor.default"] == reduce_scatter
    # the all-gathered attention and FFN inputs: the FULL_TP term
    assert by_op["_c10d_functional.all_gather_into_tensor.default"] == 2 * e * spec.dim * BATCH * SEQ_LEN
    assert measured == modelled_bytes(spec, "selective", "fp32", tp), by_op


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_op_policy_keeps_every_other_matmul(dtype):
    """TorchTitan's per-op policy (``selective_ac: op``): the 1st, 3rd, ... matmul outputs of the block (wq, wv,
    w1, w2 here) and the attention's, as the cost model counts them; fewer bytes than ``matmul``."""
    spec = load_model("llama3-debug")
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    measured, by_op = kept_for_backward(spec, "selective", tdtype, policy="op")
    assert measured == modelled_bytes(spec, "selective", dtype, tp=1, policy="op"), by_op
    e = 4 if dtype == "fp32" else 2
    tokens = BATCH * SEQ_LEN
    kept_mm = (spec.n_heads * spec.head_dim + spec.n_kv_heads * spec.head_dim + spec.ffn_hidden + spec.dim) * e * tokens
    assert by_op["aten.mm.default"] == kept_mm
    matmul, _ = kept_for_backward(spec, "selective", tdtype)
    assert measured < matmul


def test_op_policy_gradients_are_exact():
    """Recomputing every other matmul changes no gradient: the block's input and weight gradients under
    ``op`` equal those without checkpointing, bit for bit (fp32, one process)."""
    spec = load_model("llama3-debug")
    grads = {}
    for ac, policy in (("none", "matmul"), ("selective", "op"), ("selective", "matmul")):
        torch.manual_seed(0)
        model = _OneBlock(spec)
        apply_ac(model, ac, policy)
        x = torch.randn(BATCH, SEQ_LEN, spec.dim, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(SEQ_LEN), spec.head_dim, spec.rope_theta, torch.float32)
        model.layers["0"](x, cos, sin).square().mean().backward()
        grads[(ac, policy)] = [x.grad] + [p.grad for p in model.parameters()]
    for key in (("selective", "op"), ("selective", "matmul")):
        for a, b in zip(grads[("none", "matmul")], grads[key]):
            assert torch.equal(a, b), key


def test_op_policy_under_tensor_parallel(tp2_mesh):
    """Under DTensor TP (sequence parallel, tp 2): the 'op' policy keeps the reduce-scatter outputs and not the
    all-gathered inputs, which the cost model's 'op' terms leave out."""
    spec = load_model("llama3-debug")
    measured, by_op = kept_for_backward(spec, "selective", torch.float32, tp_mesh=tp2_mesh, policy="op")
    assert "_c10d_functional.all_gather_into_tensor.default" not in by_op, by_op
    assert by_op["_c10d_functional.reduce_scatter_tensor.default"] == 2 * 4 * spec.dim / 2 * BATCH * SEQ_LEN
    assert measured == modelled_bytes(spec, "selective", "fp32", 2, policy="op"), by_op


def test_unknown_policy_is_refused():
    spec = load_model("llama3-debug")
    with pytest.raises(ValueError, match="selective_ac"):
        apply_ac(_OneBlock(spec), "selective", "attention")


@pytest.mark.parametrize("name", ["moe-debug", "deepseek-debug"])
def test_op_policy_on_moe_and_mla_models_changes_no_gradient(name):
    """The per-op policy counts every matmul of a block, the router's and the experts' included (MoE), and MLA's
    projections: whatever it drops is recomputed, so the whole model's gradients match no checkpointing."""
    from executor.init import init_weights
    from executor.models.llama import Transformer
    spec = load_model(name)
    grads = {}
    for ac, policy in (("none", "matmul"), ("selective", "op")):
        torch.manual_seed(0)
        model = Transformer(spec)
        init_weights(model, model.init_rule, seed=0, device=torch.device("cpu"))
        apply_ac(model, ac, policy)
        out = model(torch.randint(0, spec.vocab_size, (2, 32)))
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
        grads[ac] = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads["none"])
    for a, b in zip(grads["none"], grads["selective"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-30)
