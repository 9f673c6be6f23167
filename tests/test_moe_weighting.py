"""Where a MoE block applies its router weights (workload moe_weighting): at the combine, which keeps the
routed experts' outputs for the weights' gradient (titan-run, TorchTitan, Megatron-core before April
2025), or in the experts' activation (Megatron-core since commit 2659630, which keeps none); the
one-line error and titan-run's refusal (the flag, the plan-file key and the --json echo:
tests/test_moe_dispatch.py, one test for every MoE workload key)."""
from __future__ import annotations

import dataclasses

import pytest

from cost_models.activations import SHARD, layer_activation_terms
from cost_models.specs import SpecError, load_model
from cost_models.workload import Workload
from tests.cost_model_helpers import assert_titan_run_refuses

DSV3 = load_model("deepseek-v3-671b")


def test_auto_follows_the_state_layout():
    assert Workload(seq_len=8, global_batch=1).moe_keeps_expert_outputs
    assert not Workload(seq_len=8, global_batch=1, state_layout="megatron").moe_keeps_expert_outputs
    assert Workload(seq_len=8, global_batch=1, state_layout="megatron", moe_weighting="combine").moe_keeps_expert_outputs
    assert not Workload(seq_len=8, global_batch=1, moe_weighting="activation").moe_keeps_expert_outputs
    with pytest.raises(SpecError, match="moe_weighting.*auto, combine, activation; got 'probs'"):
        Workload(seq_len=8, global_batch=1, moe_weighting="probs")


@pytest.mark.parametrize("layout", ["fsdp2", "megatron"])
def test_activation_weighting_drops_exactly_the_routed_outputs(layout):
    """top_k copies of a [dim] bf16 expert output per token, head/FFN-sharded; nothing else moves, and a
    dense block does not depend on it; full recompute keeps the block input only, either way."""
    comb = Workload(seq_len=4096, global_batch=8, state_layout=layout, moe_weighting="combine",
                    selective_ac="attention")      # a policy that keeps the FFN's stored tensors
    act = dataclasses.replace(comb, moe_weighting="activation")
    for ac in ("none", "selective"):
        t_c = layer_activation_terms(DSV3, comb, True, ac, True, 1.0)
        t_a = layer_activation_terms(DSV3, act, True, ac, True, 1.0)
        diff = t_c - t_a
        assert diff[SHARD] == pytest.approx(DSV3.top_k * 2.0 * DSV3.dim)
        diff[SHARD] = 0.0
        assert not diff.any()
        assert (layer_activation_terms(DSV3, comb, False, ac, True, 1.0)
                == layer_activation_terms(DSV3, act, False, ac, True, 1.0)).all()
    assert (layer_activation_terms(DSV3, comb, True, "full", True, 1.0)
            == layer_activation_terms(DSV3, act, True, "full", True, 1.0)).all()



def test_titan_run_refuses_activation_weighting(tmp_path):
    assert_titan_run_refuses(tmp_path, "moe_weighting", "activation", ["auto", "combine"], model="moe-debug",
                             plan={"dp_shard": 2, "ep": 2, "microbatch": 2})
