"""cost_models/flops.py: parameter counts, FLOPs per token and the MFU built on them."""
from __future__ import annotations

import pytest

from cost_models.flops import attention_flops_per_token, flops_per_token, param_counts
from cost_models.specs import load_hardware, load_model
from search_spaces import Plan
from tests.cost_model_helpers import est1


@pytest.mark.parametrize("name,total,active,tol", [
    ("llama3-8b", 8.03e9, 8.03e9, 0.01),
    ("llama3-70b", 70.6e9, 70.6e9, 0.01),
    ("llama3-405b", 405.9e9, 405.9e9, 0.01),
    ("deepseek-v3-671b", 671e9, 37e9, 0.03),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.03),
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),
])
def test_param_counts_match_published(name, total, active, tol):
    pc = param_counts(load_model(name))
    assert pc["total"] == pytest.approx(total, rel=tol)
    assert pc["active"] == pytest.approx(active, rel=tol)
    assert pc["matmul_active"] < pc["active"]


def test_flops_per_token_is_the_declared_formula():
    m = load_model("llama3-8b")
    pc = param_counts(m)
    expect = 6 * pc["matmul_active"] + 12 * m.n_layers * m.n_heads * m.head_dim * 8192 / 2
    assert flops_per_token(m, 8192) == pytest.approx(expect, rel=1e-12)
    assert flops_per_token(m, 8192) == pytest.approx(51.47e9, rel=0.01)
    assert attention_flops_per_token(m, 16384) == pytest.approx(2 * attention_flops_per_token(m, 8192))


def test_mfu_uses_the_declared_formula():
    plan = Plan(dp_shard=8, tp=8, microbatch=1, n_microbatches=4)
    e = est1(plan)
    hw = load_hardware("h100-sxm")
    expect = flops_per_token(load_model("llama3-70b"), 8192) * e.tokens_per_s / (64 * hw.peak_tflops_bf16 * 1e12)
    assert e.mfu[0] == pytest.approx(expect[0])
    assert 0 < e.mfu[0] < 1
