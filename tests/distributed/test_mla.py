"""Multi-head latent attention (executor/models/mla.py): the module against the cost model, and
real multi-process training against a single-process run.

Unit part (no processes): the parameter count of the model built on the meta device equals
`cost_models.flops.param_counts` (deepseek-debug, its q_lora_rank 0 variant, and the full
DeepSeek-V3 16B / 671B presets); the MLA layer's forward FLOPs (FlopCounterMode) equal the
cost model's matmul inventory plus its attention term; MLA is causal; the ring-attention
kernels handle a value width different from the query/key width.

Distributed part (real gloo processes through `titan-run`, tests/distributed/harness.py):
deepseek-debug (MLA + MoE) with ``aux_loss_coef: 0`` (the aux loss is per rank's micro-batch,
layout dependent; see executor/moe_step.py) trains 5 steps at seq_len 32, global batch 4, fp32;
the global loss and gradient norm after every step must be within 1e-4 (relative) of the
single-process run:
FSDP 2, TP 2 with sequence parallel (MLA sharded by heads, down-projections replicated; also
with q_lora_rank 0 and with per-block compile), EP 2, PP 2 and CP 2 (ring attention with
v_head_dim != qk head dim).  These run on the plan's default backend, spmd_types (MLA under TP typed by
``spmd_tensor_parallel.MLA_ATTENTION_SHARDING``); tests/distributed/test_spmd_mla.py runs the TP
layouts on both backends and compares them.
"""
from __future__ import annotations

import functools

import pytest
import torch

from cost_models.flops import attention_flops_per_token, attention_matmuls, param_counts
from cost_models.specs import load_model, model_from_dict
from search_spaces.plan import Plan
from tests.distributed.harness import assert_matches_single_process, model_spec_file

MODEL = "deepseek-debug"
SEQ_LEN = 32
GLOBAL_BATCH = 4


def _variant(**changes):
    d = load_model(MODEL).to_dict()
    d.update(changes)
    return model_from_dict(d)


# --------------------------------------------------------------------------- unit
@pytest.mark.parametrize("spec", [
    load_model(MODEL), _variant(name="deepseek-debug-q0", q_lora_rank=0),
    load_model("deepseek-v3-16b"), load_model("deepseek-v3-671b")], ids=lambda s: s.name)
def test_param_count_matches_cost_model(spec):
    from executor.models.llama import Transformer
    with torch.device("meta"):
        model = Transformer(spec)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n == param_counts(spec)["total"], (n, param_counts(spec)["total"])
    attn = model.layers["0"].attention
    assert sum(p.numel() for p in attn.parameters()) == (
        sum(m.params for m in attention_matmuls(spec)) + spec.kv_lora_rank + spec.q_lora_rank)


@pytest.mark.parametrize("q_lora_rank", [96, 0])
def test_mla_forward_flops_match_cost_model(q_lora_rank):
    from torch.utils.flop_counter import FlopCounterMode

    from executor.models.llama import rope_cos_sin
    from executor.models.mla import MLAttention
    spec = _variant(name="mla-flops", q_lora_rank=q_lora_rank)
    attn = MLAttention(spec)
    b, s = 2, 64
    x = torch.randn(b, s, spec.dim)
    cos, sin = rope_cos_sin(torch.arange(s), spec.qk_rope_head_dim, spec.rope_theta, torch.float32)
    with FlopCounterMode(display=False) as fc:
        attn(x, cos, sin)
    tokens = b * s
    proj = 2 * tokens * sum(m.params for m in attention_matmuls(spec))
    # cost model: fwd+bwd attention = 3x fwd, causal-halved; SDPA here computes the full s x s square
    core = 2 * tokens * attention_flops_per_token(spec, s) / spec.n_layers / 3
    assert fc.get_total_flops() == pytest.approx(proj + core, rel=1e-9)


def test_mla_is_causal_and_uses_positions():
    from executor.models.llama import Transformer
    from executor.init import init_weights
    torch.manual_seed(0)
    model = Transformer(load_model(MODEL))
    init_weights(model, model.init_rule, seed=0, device=torch.device("cpu"))   # not torch.empty's garbage
    tok = torch.randint(0, 512, (1, 16))
    tok2 = tok.clone()
    tok2[0, 10:] = (tok2[0, 10:] + 1) % 512
    with torch.no_grad():
        a, b = model(tok), model(tok2)
        shifted = model(tok, torch.arange(16) + 5)     # RoPE is relative: a uniform shift changes nothing
        spread = model(tok, torch.arange(16) * 2)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-3)
    assert torch.allclose(a, shifted, atol=1e-4)
    assert not torch.allclose(a, spread, atol=1e-4)       # RoPE sees the positions


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_kernels_with_value_width_different_from_qk(kernel, causal):
    from executor.parallel.ring_attention import make_kernel
    torch.manual_seed(0)
    q = torch.randn(1, 4, 8, 12, requires_grad=True)
    k = torch.randn(1, 4, 8, 12, requires_grad=True)
    v = torch.randn(1, 4, 8, 4, requires_grad=True)
    kern = make_kernel(kernel, 0.3)
    out, lse, aux = kern.fwd(q.detach(), k.detach(), v.detach(), causal)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    dout = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    got = kern.bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, causal, aux)
    assert out.shape == ref.shape and (out - ref).abs().max() < 1e-5
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g - w).abs().max() < 1e-5


# --------------------------------------------------------------------------- distributed
@functools.lru_cache(maxsize=None)
def spec_file(q_lora_rank: int | None = None) -> str:
    """deepseek-debug with aux_loss_coef 0 (and another q_lora_rank), as a YAML file titan-run can load."""
    d = load_model(MODEL).to_dict()
    d.update(name="deepseek-debug-noaux", aux_loss_coef=0.0)
    if q_lora_rank is not None:
        d.update(name=f"deepseek-debug-noaux-q{q_lora_rank}", q_lora_rank=q_lora_rank)
    model_from_dict(d)
    return model_spec_file(d, d["name"])


# losses within 1e-4 (relative), and the global gradient norms too: AdamW hides a wrong constant
# gradient factor on a few weights (e.g. the replicated MLA down-projections under TP) from the loss;
# the reference's loss must drop by more than 0.5 in the 5 steps
matches_single_process = functools.partial(assert_matches_single_process, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                                           reference_learns_by=0.5)


@pytest.mark.slow
@pytest.mark.distributed
def test_mla_fsdp2():
    matches_single_process(Plan(dp_shard=2, microbatch=2), model=spec_file())


@pytest.mark.slow
@pytest.mark.distributed
def test_mla_tp2_sequence_parallel():
    matches_single_process(Plan(dp_shard=1, tp=2, microbatch=4), model=spec_file())


@pytest.mark.slow
@pytest.mark.distributed
def test_mla_tp2_direct_queries():
    # q_lora_rank 0 (as deepseek-v3-16b): wq column-sharded instead of wq_a/q_norm/wq_b
    matches_single_process(Plan(dp_shard=1, tp=2, microbatch=4), model=spec_file(0))


@pytest.mark.slow
@pytest.mark.distributed
def test_mla_tp2_compiled():
    # per-block torch.compile: the replicated down-projections' gradients arrive replicated (not
    # partial) under compile; the TP plan must turn them into each rank's share
    matches_single_process(Plan(dp_shard=1, tp=2, microbatch=4, compile=True), model=spec_file())


@pytest.mark.slow
@pytest.mark.distributed
def test_mla_ep2():
    matches_single_process(Plan(dp_shard=2, ep=2, microbatch=2), model=spec_file())


@pytest.mark.slow
@pytest.mark.distributed
def test_mla_pp2():
    matches_single_process(Plan(dp_shard=1, pp=2, microbatch=2, n_microbatches=2), model=spec_file())


@pytest.mark.slow
@pytest.mark.distributed
def test_mla_cp2_ring_attention():
    matches_single_process(Plan(dp_shard=1, cp=2, microbatch=4), model=spec_file())
