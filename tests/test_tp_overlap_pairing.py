"""TP communication overlap pairs each collective with its own matmuls (`step_time._tp_exposed`).

Async TP and Megatron's TP overlap decompose a collective into tp chunks under the matmul that consumes
(all-gather) or produces (reduce-scatter) its tensor, so a collective hides under (tp-1)/tp of that
matmul only: a GQA model's small QKV projection cannot hide the attention all-gather, however large the
MLP.  Without overlap every collective stays on the critical path, as before the pairing."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.coefficients import Coefficients
from cost_models.flops import COL, ROW, Matmul, layer_matmuls
from cost_models.specs import load_model
from cost_models.step_time import TP_SIDES, _tp_exposed, tp_side
from cost_models.workload import Workload
from search_spaces.plan import Plan
from tests.cost_model_helpers import est1

DIM = 1024
# one block: QKV and out-projection of 0.5 units each, an MLP of 10 units per matmul
BLOCK = [(Matmul("wq", DIM, DIM, COL), 0.25), (Matmul("wk", DIM, 128, COL), 0.125),
         (Matmul("wv", DIM, 128, COL), 0.125), (Matmul("wo", DIM, DIM, ROW), 0.5),
         (Matmul("w1", DIM, 4096, COL, group="ffn"), 10.0), (Matmul("w3", DIM, 4096, COL, group="ffn"), 10.0),
         (Matmul("w2", 4096, DIM, ROW, group="ffn"), 10.0)]
SP_SIDES = ((1.0, 1.0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0), [np.zeros(1)] * 4)   # forward, backward, recomputed


class _Model:
    dim = DIM


def _exposed(overlap: float, tp: float = 8.0, c: float = 1.0, block=BLOCK, mode: str = "auto", sides=SP_SIDES,
             sp: bool = True):
    mm = [(m, np.array([t])) for m, t in block]
    wl = Workload(seq_len=8, global_batch=1, tp_comm_overlap=mode, sequence_parallel=sp)
    tpf, tpb = _tp_exposed(mm, _Model(), wl, Coefficients(tp_overlap=overlap), np.array([tp]), np.array([c]), sides)
    return float(tpf[0]), float(tpb[0])


def test_without_overlap_every_collective_is_exposed():
    assert _exposed(0.0) == pytest.approx((4.0, 4.0))


def test_each_collective_hides_only_under_its_own_matmuls():
    tpf, tpb = _exposed(1.0)
    # the pooled rule (4 collectives under 31 units of matmul) would hide everything; per collective the
    # attention sides keep c - 0.5 * 7/8 forward and c - 2 * 0.5 * 7/8 backward, the FFN sides nothing
    assert tpf == pytest.approx(2 * (1.0 - 0.5 * 7 / 8))
    assert tpb == pytest.approx(2 * (1.0 - 1.0 * 7 / 8))


def test_decomposition_leaves_one_chunk_of_the_matmul_unpaired():
    # tp 2: a collective hides under half of its matmul (the local chunk runs before any transfer is due):
    # attention sides 6 - 0.5/2 each, the FFN all-gather under 20/2 (hidden), the reduce-scatter 6 - 10/2
    tpf, _ = _exposed(1.0, tp=2.0, c=6.0)
    assert tpf == pytest.approx(2 * 5.75 + 0.0 + 1.0)


def test_sides_of_llama_and_mla_blocks():
    llama = load_model("llama3-70b")
    sides = {m.name: tp_side(m, llama.dim) for m in layer_matmuls(llama, False)}
    assert sides == {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w1": 2, "w3": 2, "w2": 3}
    assert TP_SIDES[0] == "attn_ag" and TP_SIDES[3] == "ffn_rs"
    mla = load_model("deepseek-v3-671b")
    mla_sides = {m.name: tp_side(m, mla.dim) for m in layer_matmuls(mla, False)}
    # the down projections read the gathered residual; the up projections read their latents
    assert mla_sides["wq_a"] == 0 and mla_sides["wkv_a"] == 0
    assert mla_sides["wq_b"] is None and mla_sides["wkv_b"] is None and mla_sides["wo"] == 1


def test_full_overlap_of_a_gqa_model_leaves_tp_time_exposed_end_to_end():
    plan = Plan(dp_shard=8, tp=8, microbatch=1, n_microbatches=4, ac="none", compile=True)
    wl = dict(seq_len=4096, global_batch=32, state_layout="megatron", zero=1)
    none = est1(plan, wl=Workload(tp_comm_overlap="none", **wl)).time["tp_comm"][0]
    full = est1(plan, wl=Workload(tp_comm_overlap="full", **wl)).time["tp_comm"][0]
    # llama3-70b at TP 8: the MLP hides its collectives, the attention projections do not hide theirs
    assert 0.0 < full < 0.5 * none


def test_async_tp_fuses_what_torchs_micro_pipeline_pass_matches():
    """torch's micro_pipeline_tp fuses all-gather -> matmuls and one matmul -> reduce-scatter: forward as full;
    backward the summed Q/K/V (gate/up) input gradients' reduce-scatters stay exposed, the gradient
    all-gathers hide under the input-gradient matmul only (1 g, not 2 g)."""
    full_f, _ = _exposed(1.0)
    tpf, tpb = _exposed(1.0, mode="async")
    assert tpf == pytest.approx(full_f)
    assert tpb == pytest.approx(1.0 + 1.0 + (1.0 - 0.5 * 7 / 8) + 0.0)
    # a GELU MLP's single fc1 produces its input gradient alone: that reduce-scatter fuses
    gelu = BLOCK[:4] + [(Matmul("fc1", DIM, 4096, COL, group="ffn"), 10.0),
                        (Matmul("fc2", 4096, DIM, ROW, group="ffn"), 10.0)]
    _, tpb_gelu = _exposed(1.0, block=gelu, mode="async")
    assert tpb_gelu == pytest.approx(1.0 + (1.0 - 0.5 * 7 / 8))
    # recomputed forward collectives (full AC) pair as forward, under the recomputed matmuls once
    rec = ((1.0, 1.0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0), [np.ones(1)] * 4)
    _, tpb_rec = _exposed(1.0, mode="async", sides=rec)
    assert tpb_rec == pytest.approx(tpb + 2 * (1.0 - 0.5 * 7 / 8))
    # async TP needs sequence parallelism (all-gather / reduce-scatter pairs): without it nothing hides
    nosp = ((0.0, 2.0, 0.0, 2.0), (2.0, 0.0, 2.0, 0.0), [np.zeros(1)] * 4)
    assert _exposed(1.0, mode="async", sides=nosp, sp=False) == pytest.approx((4.0, 4.0))


def test_async_tp_sits_between_plain_and_full_overlap_end_to_end():
    plan = Plan(dp_shard=8, tp=8, microbatch=2, n_microbatches=1, ac="selective", compile=True)
    wl = dict(seq_len=8192, global_batch=16, selective_ac="op")
    tp = {mode: est1(plan, model="llama3-8b", wl=Workload(tp_comm_overlap=mode, **wl)).time["tp_comm"][0]
          for mode in ("none", "async", "full")}
    assert tp["full"] < tp["async"] < tp["none"]
