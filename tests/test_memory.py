"""cost_models/memory.py: per-rank memory (parameters, optimizer, activations, pipeline buffers)."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.coefficients import Coefficients
from cost_models.estimate import estimate
from cost_models.activations import per_layer_activation_bytes
from cost_models.layout import in_flight_on_rank, interleaved_round_size
from cost_models.memory import in_flight_microbatches
from cost_models.specs import load_hardware, load_model, model_from_dict
from cost_models.workload import Workload
from search_spaces import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import est1, table


def _peak(plan, **kw):
    return est1(plan, **kw).peak_memory_bytes[0]


@pytest.mark.parametrize("layout", ["fsdp2", "megatron"])
def test_more_tp_or_dp_shard_means_less_memory_per_rank(layout):
    wl = lambda p: Workload(seq_len=8192, global_batch=p.global_batch(), state_layout=layout, zero=1)  # noqa: E731
    base = dict(microbatch=1, n_microbatches=4, ac="selective")
    tps = [_peak(p, wl=wl(p)) for p in (Plan(dp_shard=8, tp=t, **base) for t in (1, 2, 4, 8))]
    assert all(a > b for a, b in zip(tps, tps[1:])), tps
    dps = [_peak(p, wl=wl(p)) for p in (Plan(dp_shard=d, tp=4, **base) for d in (1, 2, 8, 32))]
    assert all(a > b for a, b in zip(dps, dps[1:])), dps


def test_more_pp_means_less_memory_per_rank():
    wl = lambda p: Workload(seq_len=8192, global_batch=p.global_batch(), state_layout="megatron", zero=1)  # noqa: E731
    peaks = [_peak(p, wl=wl(p)) for p in (Plan(dp_shard=4, tp=8, pp=pp, microbatch=1, n_microbatches=16)
                                          for pp in (1, 2, 4, 8))]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks
    # fsdp2: the parameter/optimizer shards shrink with pp as well
    p1, p4 = (est1(Plan(dp_shard=4, tp=8, pp=pp, microbatch=1, n_microbatches=16)) for pp in (1, 4))
    assert p4.memory["params"][0] < p1.memory["params"][0]
    assert p4.memory["optimizer"][0] < p1.memory["optimizer"][0]


@pytest.mark.parametrize("policy,attn,layout", [("matmul", "fused", "fsdp2"), ("op", "fused", "fsdp2"),
                                                ("attention", "materialized", "megatron")])
def test_activations_full_lt_selective_lt_none(policy, attn, layout):
    m = load_model("llama3-8b")
    wl = Workload(seq_len=4096, global_batch=8, attention_impl=attn, selective_ac=policy, state_layout=layout)
    t = table(*(Plan(dp_shard=8, tp=1, ac=a) for a in ("none", "selective", "full")))
    kept, _ = per_layer_activation_bytes(t, m, wl, Coefficients(), moe=False)
    assert kept[2] < kept[1] < kept[0]
    e = estimate(t, m, load_hardware("h100-sxm"), wl)
    assert e.memory["activations"][2] < e.memory["activations"][1] < e.memory["activations"][0]
    assert e.time["compute"][0] < e.time["compute"][1] < e.time["compute"][2]   # recomputation costs time


def test_activations_reproduce_korthikanti_table2():
    """Korthikanti et al. 2022, Table 2: per layer sbh(10 + 24/t + 5as/(ht)) with TP,
    sbh(34/t) with TP+SP and selective recompute, 2sbh/t with full recompute and SP."""
    s, b, h, a, t = 2048, 4, 6144, 64, 8
    m = model_from_dict(dict(name="gpt22b", dim=h, n_layers=48, n_heads=a, ffn_hidden=4 * h, vocab_size=51200,
                             mlp="gelu", norm="layernorm"))
    kw = dict(seq_len=s, global_batch=b, state_layout="megatron", attention_impl="materialized", dropout=True,
              selective_ac="attention")
    # Megatron's fused kernels (LayerNorm, bias-GeLU, softmax) are what compile=True expresses
    plan = table(*(Plan(tp=t, microbatch=b, ac=ac, compile=True) for ac in ("none", "selective", "full")))
    no_sp, _ = per_layer_activation_bytes(plan, m, Workload(sequence_parallel=False, **kw), Coefficients(), False)
    sp, _ = per_layer_activation_bytes(plan, m, Workload(sequence_parallel=True, **kw), Coefficients(), False)
    sbh = s * b * h
    assert no_sp[0] == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert sp[1] == pytest.approx(sbh * 34 / t, rel=1e-12)
    assert sp[2] == pytest.approx(2 * sbh / t, rel=1e-12)


def test_in_flight_microbatches_by_schedule():
    t = table(Plan(pp=4, n_microbatches=16, schedule="1F1B"), Plan(pp=4, n_microbatches=16, schedule="GPipe"),
              Plan(pp=4, n_microbatches=16, schedule="Interleaved1F1B", stages_per_rank=2),
              Plan(pp=4, n_microbatches=16, schedule="ZBVZeroBubble", stages_per_rank=2),
              Plan(pp=4, n_microbatches=16, schedule="DualPipeV", stages_per_rank=2), Plan(n_microbatches=16))
    first, last = in_flight_microbatches(t)
    assert list(first) == pytest.approx([4, 16, 4 * (1 + 3 / 8), 4, 4.5, 1])
    assert last[0] == 1 and last[1] == 16 and last[5] == 1



def _torch_interleaved_in_flight(pp: int, v: int, n: int, rank: int) -> float:
    """Peak of live (stage, micro-batch) forwards on `rank` in torch's own ScheduleInterleaved1F1B
    order (its `_calculate_single_rank_operations`, the pipeline_order the executor runs), in
    rank-micro-batches (/ v)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    sched = object.__new__(ScheduleInterleaved1F1B)   # the order only: no stages, no process group
    sched.pp_group_size, sched.n_local_stages, sched.rank, sched._n_microbatches = pp, v, rank, n
    sched.number_of_rounds = max(1, n // pp)
    sched.microbatches_per_round = n // sched.number_of_rounds
    live = peak = 0
    for a in sched._calculate_single_rank_operations(rank):
        if a is not None:
            live += {"F": 1, "B": -1}.get(a.computation_type.value, 0)
            peak = max(peak, live)
    return peak / v


def test_interleaved_in_flight_follows_torchs_rounds_of_n_microbatches():
    """The Llama 3 paper's schedule (N contiguous micro-batches per stage) as torch runs it: N = n //
    max(1, n // pp); n not a multiple of pp (pp 4, n 6 or 10: N 6, 5 -- Fig. 6 of arXiv:2407.21783 has
    pp 4, n 10, N 5) holds more chunks than the depth-first N = pp."""
    cases = [(pp, v, n) for pp, v in ((2, 2), (4, 2), (4, 3), (8, 2)) for n in (pp, pp + 1, pp + 2, 2 * pp,
                                                                          2 * pp + 2, 3 * pp)
             if n % max(1, n // pp) == 0]
    plans = [Plan(pp=pp, n_microbatches=n, schedule="Interleaved1F1B", stages_per_rank=v) for pp, v, n in cases]
    t = CandidateTable.from_plans(plans)
    for r in range(8):
        got = in_flight_on_rank(t, np.minimum(r, t.pp - 1))
        for i, (pp, v, n) in enumerate(cases):
            assert got[i] == pytest.approx(_torch_interleaved_in_flight(pp, v, n, min(r, pp - 1))), (r, pp, v, n)
    assert interleaved_round_size(t)[cases.index((4, 2, 10))] == 5

def _cpu_debug(*plans, **wl):
    m, hw = load_model("llama3-debug"), load_hardware("cpu")
    w = Workload(seq_len=256, global_batch=plans[0].global_batch(), dtype="fp32", **wl)
    return estimate(table(*plans), m, hw, w), m, w


def test_block_activations_match_saved_tensors_of_the_executor_model():
    """llama3-debug, fp32 eager, mb 8 x 256 tokens: torch.autograd.graph.saved_tensors_hooks on
    executor/models/llama.py count 26 MiB + the 64 KiB LSE + the two norms' 8 KiB rstd per block: the
    GQA K and V saved at n_kv_heads width (SDPA with enable_gqa; tests/test_gqa_native.py measures it),
    no extra copy of the attention output, each RMSNorm its input and rstd only
    (tests/test_executor_norm.py measures it to the byte), the SwiGLU Function gate and up only and the down
    projection's input rebuilt from them (``rebuilt_input``, on where titan-run's blocks are neither
    checkpointed nor compiled; tests/test_compiled_saved_activations.py measures the block)."""
    m = load_model("llama3-debug")
    wl = Workload(seq_len=256, global_batch=8, dtype="fp32")
    kept, _ = per_layer_activation_bytes(table(Plan(microbatch=8)), m, wl, Coefficients(), moe=False)
    assert kept[0] == pytest.approx(26 * 2 ** 20 + 8 * 2048 * 4 + 2 * 2048 * 4, rel=1e-12)

    def kept_with(**kw):
        w = Workload(seq_len=256, global_batch=8, dtype="fp32", **kw)
        return per_layer_activation_bytes(table(Plan(microbatch=8)), m, w, Coefficients(), moe=False)[0][0]

    # GQA K/V expanded to n_heads (workload gqa_kv: TorchTitan's repeat_kv): K and V at n_heads width,
    # 2 x 1 MiB more (auto is native); one [2048 tokens, 768] fp32 FFN-width tensor is 6 MiB: the fused
    # SwiGLU kernel (swiglu_impl fused) keeps the product as the down projection's input, the plain code's
    # (eager: TorchTitan) silu(gate) too
    gqa, ffn = 2 * 2 ** 20, 2048 * m.ffn_hidden * 4
    assert kept_with(gqa_kv="native") == kept_with(swiglu_impl="fused_ffn") == kept[0]
    assert kept_with(swiglu_impl="fused") - kept[0] == pytest.approx(ffn, rel=1e-12)
    assert kept_with(gqa_kv="expanded") - kept[0] == pytest.approx(gqa, rel=1e-12)
    assert kept_with(swiglu_impl="eager") - kept[0] == pytest.approx(2 * ffn, rel=1e-12)
    # Megatron's fused kernel keeps the product (auto there is fused), and with the key stated eager silu(gate) too
    assert kept_with(state_layout="megatron") - kept[0] == pytest.approx(ffn, rel=1e-12)
    assert kept_with(state_layout="megatron", swiglu_impl="eager") - kept[0] == pytest.approx(2 * ffn, rel=1e-12)
    assert kept_with(state_layout="megatron", gqa_kv="expanded", swiglu_impl="eager") == pytest.approx(
        kept[0] + gqa + 2 * ffn, rel=1e-12)
    # checkpointed or compiled blocks keep the product (the recipe is off there): the full-AC and compiled
    # tables do not take it
    compiled, _ = per_layer_activation_bytes(table(Plan(microbatch=8, compile=True)), m, wl, Coefficients(),
                                             moe=False)
    assert compiled[0] - kept[0] > ffn - 16 * 2048


@pytest.mark.parametrize("loss_impl, kept", [("auto", 4), ("eager", 4 + 4)])
def test_gpipe_keeps_the_logits_of_all_microbatches_on_the_loss_stage(loss_impl, kept):
    """Per micro-batch the loss stage keeps its output (fp32 logits), which titan-run's fused loss also saves
    (one tensor), or with the eager loss that output and the fp32 log-softmax."""
    lg = [_cpu_debug(Plan(pp=2, microbatch=1, n_microbatches=n, schedule=s), loss_impl=loss_impl)[0]
          .memory["logits"][0] for s in ("GPipe", "1F1B") for n in (8, 16)]
    per_mb = 256 * 512 * kept
    assert lg[1] - lg[0] == pytest.approx(8 * per_mb, rel=1e-9)
    assert lg[2] == lg[3]                   # 1F1B: one micro-batch on the loss stage (the worst rank is the first)


def test_multi_stage_schedules_hold_no_sends_per_microbatch():
    # titan-run lets a sent stage output go once its gradient is back and a sent input gradient once the
    # schedule's program shows the peer has used it (pp_sent_tensors: released), and its stages receive into a
    # fresh buffer per micro-batch, so neither Interleaved1F1B nor 1F1B grows with n_microbatches past the
    # in-flight cap (torch's runtime as is: 3 residual tensors a micro-batch on Interleaved1F1B, and torch's
    # PipelineStage 3 more: tests/distributed/test_pp_recv_buffers.py measures them)
    a = {(s, n): _cpu_debug(Plan(pp=2, microbatch=1, n_microbatches=n, schedule=s,
                                 stages_per_rank=2 if s != "1F1B" else 1))[0].memory["activations"][0]
         for s in ("Interleaved1F1B", "1F1B") for n in (8, 16)}
    assert a[("Interleaved1F1B", 16)] == pytest.approx(a[("Interleaved1F1B", 8)], rel=1e-12)
    assert a[("1F1B", 16)] == a[("1F1B", 8)]
    kept = _cpu_debug(Plan(pp=2, microbatch=1, n_microbatches=16, schedule="Interleaved1F1B", stages_per_rank=2),
                      pp_sent_tensors="kept")[0].memory["activations"][0]
    assert kept > a[("Interleaved1F1B", 16)]


def test_zero_bubble_v_keeps_output_gradients_for_deferred_weight_grads():
    from cost_models.activations import pipeline_extra_bytes
    m = load_model("llama3-debug")
    wl = Workload(seq_len=256, global_batch=16, dtype="fp32")
    t = table(Plan(pp=2, microbatch=2, n_microbatches=8, schedule="ZBVZeroBubble", stages_per_rank=2),
              Plan(pp=2, microbatch=2, n_microbatches=8, schedule="DualPipeV", stages_per_rank=2))
    d = pipeline_extra_bytes(t, m, wl)["deferred_w"]
    # 0.5 of the rank's 2 layers' matmul output gradients (wq, wk, wv, wo, w1, w3, w2 = 5 MiB per layer)
    assert d[0] == pytest.approx(0.5 * 2 * 5 * 2 ** 20, rel=1e-9) and d[1] == 0


def test_one_backward_pass_peaks_before_gradients_exist():
    """pp == 1 with one micro-batch (or GPipe): the activation peak comes before any gradient, so
    the peak is params + optimizer + max(grads, activation phase); with gradient accumulation the
    gradients of earlier micro-batches are alive at the peak."""
    e, _, _ = _cpu_debug(Plan(microbatch=8), Plan(microbatch=8, ac="full"), Plan(microbatch=4, n_microbatches=2))
    assert e.memory["grads"][0] == 0 and e.memory["grads"][1] == 0
    assert e.memory["grads"][2] == pytest.approx(4 * 3_410_176, rel=1e-6)   # 3.4 M params (+ norms), fp32
    # measured (bench_memory_vs_model's titan-run step): single mb8 ac=full 95.4 MiB with the SwiGLU Function's
    # backward holding one ffn-width tensor fewer (101.4 before; 103.4 while CoreAttention repeated GQA K/V to
    # n_heads, 107.4 while the norms also kept their normalized outputs); the phase max predicts it within 3% (93.1)
    assert e.peak_memory_bytes[1] / 2 ** 20 == pytest.approx(95.4, rel=0.03)


def test_pipelined_fsdp_regathers_blocks_every_microbatch():
    e, _, _ = _cpu_debug(Plan(dp_shard=2, pp=2, microbatch=1, n_microbatches=16),
                         Plan(dp_replicate=2, pp=2, microbatch=1, n_microbatches=16))
    block = 786_432 * 4                     # one llama3-debug block, fp32
    assert e.memory["fsdp_buffers"][0] >= 4 * block
    assert e.memory["fsdp_buffers"][1] < 4 * block   # replicate-only FSDP: nothing to gather


def test_megatron_grad_dtype_sets_the_gradient_bytes_exactly():
    """grad_dtype bf16 (NeMo / Megatron-Bridge recipes) holds 2 bytes per gradient element, fp32 4; the
    parameters and optimizer states do not change."""
    tab = CandidateTable.from_plans([Plan(dp_shard=8, tp=2, n_microbatches=4), Plan(dp_shard=16, n_microbatches=2)])
    m, hw = load_model("llama3-8b"), load_hardware("h100-sxm")
    for zero in (0, 1, 2):
        w32 = Workload(seq_len=2048, global_batch=32, state_layout="megatron", zero=zero)
        w16 = Workload(seq_len=2048, global_batch=32, state_layout="megatron", zero=zero, grad_dtype="bf16")
        a, b = (estimate(tab, m, hw, w).memory for w in (w32, w16))
        np.testing.assert_allclose(b["grads"], a["grads"] / 2, rtol=1e-12)
        for k in ("params", "optimizer", "activations", "logits"):
            np.testing.assert_array_equal(a[k], b[k])


def test_fused_loss_keeps_one_copy_of_the_logits_and_writes_one_gradient():
    """loss_impl fused: 2e bytes per logit at the loss turn (its input and its gradient) instead of the eager
    fp32 path's 12 (log-softmax, its gradient, the input gradient); under GPipe (every micro-batch's
    logits kept) fused stays below eager too."""
    m, hw = load_model("llama3-8b"), load_hardware("h100-sxm")
    plans = [Plan(dp_shard=16, microbatch=2, n_microbatches=1), Plan(dp_shard=4, pp=4, n_microbatches=8,
                                                                      schedule="GPipe")]
    tab = CandidateTable.from_plans(plans)
    eager, fused = (estimate(tab, m, hw, Workload(seq_len=2048, global_batch=32, loss_impl=li)).memory
                    for li in ("eager", "fused"))
    # (the 'logits' term also holds the final norm's and the head's inputs, the same under both)
    per_logit = 2 * 2048 * m.vocab_size                       # logits of one micro-batch (pp = 1 row)
    assert eager["logits"][0] - fused["logits"][0] == pytest.approx((12.0 - 4.0) * per_logit, rel=1e-9)
    assert eager["logits"][1] > fused["logits"][1]
