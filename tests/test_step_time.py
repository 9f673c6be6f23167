"""cost_models/step_time.py: the step time (pipeline bubbles, launch-bound micro-batches, compile/float8)."""
from __future__ import annotations

import pytest

from cost_models.coefficients import Coefficients
from cost_models.comm import axis_links
from cost_models.compute import Rates
from cost_models.estimate import estimate
from cost_models.specs import load_hardware, load_model, model_from_dict
from cost_models.workload import Workload
from cost_models.step_time import stage_times
from search_spaces import Plan
from tests.cost_model_helpers import est1, table


def test_pipeline_bubble_fractions():
    """1F1B / interleaved bubbles are (p-1)/m (/v) of the busy time of a stage WITHOUT the LM head:
    warm-up and cool-down run through the stages that do not hold it (Narayanan et al. Sec. 2.2)."""
    wl = Workload(seq_len=8192, global_batch=32)
    m, hw, co = load_model("llama3-70b"), load_hardware("h100-sxm"), Coefficients()
    for plan, frac in ((Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8), 3 / 8),
                       (Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8, schedule="Interleaved1F1B",
                             stages_per_rank=2), 3 / 16)):
        e = est1(plan, wl=wl)
        busy = e.time["compute"] + e.time["tp_comm"] + e.time["cp_comm"] + e.time["ep_comm"]
        t = table(plan)
        st = stage_times(t, m, hw, wl, co, axis_links(t, hw, co), Rates(hw, wl, co))
        head = plan.n_microbatches * (st["head_F"] + st["head_B"] + st["head_W"])
        assert head[0] > 0
        assert e.time["pp_bubble"][0] / (busy[0] - head[0]) == pytest.approx(frac, rel=1e-9)
        assert e.time["pp_bubble"][0] < frac * busy[0]
    zb = est1(Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8, schedule="ZBVZeroBubble", stages_per_rank=2), wl=wl)
    one = est1(Plan(dp_shard=4, tp=8, pp=4, n_microbatches=8), wl=wl)
    assert zb.time["pp_bubble"][0] < 0.5 * one.time["pp_bubble"][0]


def test_small_microbatches_are_launch_bound_on_the_a100_preset():
    """vTrain's regime: a GPT layer's time per micro-batch has a host floor (~76 launches of
    Megatron's eager stack per layer, forward + recompute + backward), so micro-batch 1 and 2
    cost about the same per micro-batch while large micro-batches are GPU-bound."""
    m = model_from_dict({"name": "gpt", "dim": 1024, "n_layers": 24, "n_heads": 16, "ffn_hidden": 4096,
                         "vocab_size": 50257, "mlp": "gelu", "norm": "layernorm"})
    hw = load_hardware("a100-80g")
    assert hw.kernel_launch_us == 43.0 and load_hardware("h100-sxm").kernel_launch_us == 4.0
    wl = Workload(seq_len=1024, global_batch=64, state_layout="megatron", zero=0, attention_impl="materialized",
                  dropout=True, sequence_parallel=False, selective_ac="attention")
    per_mb = {}
    for mb in (1, 2, 8):
        e = estimate(table(Plan(dp_shard=1, microbatch=mb, n_microbatches=64 // mb, ac="full", compile=True)),
                     m, hw, wl)
        per_mb[mb] = e.step_time_s[0] / (64 // mb)
    assert per_mb[2] / per_mb[1] < 1.2                    # launch-bound: micro-batch 2 almost free
    assert per_mb[8] / per_mb[2] > 2.0                    # GPU-bound: time grows with the work
    assert 24 * 76 * 43e-6 < per_mb[1] < 2.0 * 24 * 76 * 43e-6


def test_compile_and_float8_speed_up():
    base = dict(dp_shard=8, microbatch=2, ac="selective")
    e = est1(Plan(**base), model="llama3-8b")
    c = est1(Plan(compile=True, **base), model="llama3-8b")
    f = est1(Plan(compile=True, float8=True, **base), model="llama3-8b")
    assert f.step_time_s[0] < c.step_time_s[0] < e.step_time_s[0]
    assert c.step_time_s[0] > 0.7 * e.step_time_s[0]          # a modest speedup


def _gpt(n_layers: int, vocab: int) -> object:
    return model_from_dict({"name": f"gpt{n_layers}", "dim": 4096, "n_layers": n_layers, "n_heads": 32,
                            "ffn_hidden": 16384, "vocab_size": vocab, "mlp": "gelu", "norm": "layernorm"})


@pytest.mark.parametrize("vocab", [8192, 256000])
def test_the_pipeline_is_paced_by_the_rank_with_the_most_work(vocab):
    """70 layers over 12 stages: stages 0-9 hold 6, stages 10-11 hold 5 and the last the LM head too. The rank
    that paces the pipeline runs max(6 blocks, 5 blocks + head) per micro-batch, never 6 blocks AND the head:
    with a small vocabulary the busiest rank's 6 blocks, with a large one the last rank's 5 blocks and head.
    The 72-layer model (6 on every stage, the head on the last) gives one block's time."""
    wl = Workload(seq_len=2048, global_batch=48)
    hw, co = load_hardware("a100-80g"), Coefficients()
    plan = Plan(dp_shard=1, tp=4, pp=12, n_microbatches=48, ac="full")
    t = table(plan)
    work = {}
    for L in (70, 72):
        st = stage_times(t, _gpt(L, vocab), hw, wl, co, axis_links(t, hw, co), Rates(hw, wl, co))
        work[L] = {k: float(st[k][0]) for k in ("F", "B", "W", "head_F", "head_B", "head_W")}
    head = work[72]["head_F"] + work[72]["head_B"] + work[72]["head_W"]
    block = (work[72]["F"] + work[72]["B"] + work[72]["W"] - head) / 6
    got = work[70]["F"] + work[70]["B"] + work[70]["W"]
    assert got == pytest.approx(max(6 * block, 5 * block + head), rel=1e-9)
    assert got < 6 * block + head
    holds_head = work[70]["head_F"] > 0
    assert holds_head == (head > block)          # the head's rank paces it exactly when the head outweighs a block
