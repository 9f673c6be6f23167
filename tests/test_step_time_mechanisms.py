"""Step-time mechanisms at scale (issue 12, items 4-6): data-parallel traffic, pipeline engines, MoE."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cost_models import step_time as S
from cost_models.coefficients import Coefficients
from cost_models.comm import axis_links, ring_gather_time
from cost_models.compute import Rates
from cost_models.memory import rank_params
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable


def _parts(table, model, hw, wl, coeffs):
    r = Rates(hw, wl, coeffs)
    links = axis_links(table, hw, coeffs)
    st = S.stage_times(table, model, hw, wl, coeffs, links, r)
    return r, links, st


def test_dense_fsdp_pays_one_ring_per_block_not_an_empty_expert_ring():
    """A dense model has no expert weights, so no expert-group collective and none of its (p-1) latency
    steps: with overlap off, the FSDP2 passes are exactly the dense rings (all-gather before forward,
    reduce-scatter after backward, per block plus the first one and the root unit)."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm")
    wl = Workload(seq_len=2048, global_batch=512)
    coeffs = Coefficients(dp_overlap=0.0)
    t = CandidateTable.from_plans([Plan(dp_shard=512, microbatch=1, n_microbatches=1, reshard_after_forward=False)])
    r, links, st = _parts(t, model, hw, wl, coeffs)
    dp, _ = S.data_parallel(t, model, hw, wl, coeffs, links, r, st)
    fs = links["fsdp"]
    blk = rank_params(t, model)["dense_block"]
    from cost_models.flops import param_counts
    pc = param_counts(model)
    head = pc["embedding"] + pc["lm_head"] + pc["final_norm"]      # the root unit (pp = 1, tp = 1)
    ag, rs = (ring_gather_time(512, blk * b, fs.bw, fs.alpha) for b in (2.0, 4.0))
    ag_h, rs_h = (ring_gather_time(512, head * b, fs.bw, fs.alpha) for b in (2.0, 4.0))
    n = model.n_layers
    assert dp[0] == pytest.approx(float(np.ravel((n + 1) * (ag + rs) + ag_h + rs_h)[0]), rel=1e-9)


def test_cross_node_ring_latency_counts_network_steps_only_at_node_boundaries():
    """NCCL's ring model (src/graph/tuning.cc): of p-1 steps, nNodes-1 cross the network."""
    from cost_models.comm import group_link, link_params
    hw, coeffs = load_hardware("h100-sxm"), Coefficients()
    lp = link_params(hw, coeffs)
    dense = group_link(np.array([512]), np.array([1]), hw, coeffs)        # 8 members per node, 64 nodes
    assert 511 * dense.alpha[0] == pytest.approx(448 * lp["intra_alpha"] + 63 * lp["inter_alpha"])
    assert dense.p2p_alpha[0] == pytest.approx(lp["inter_alpha"])
    strided = group_link(np.array([64]), np.array([8]), hw, coeffs)       # one member per node
    assert strided.alpha[0] == pytest.approx(lp["inter_alpha"])
    inside = group_link(np.array([8]), np.array([1]), hw, coeffs)
    assert inside.alpha[0] == inside.p2p_alpha[0] == pytest.approx(lp["intra_alpha"])


def test_backward_window_hides_the_sum_of_its_collectives_not_each_alone():
    """FSDP2 with resharding: in a block's backward the re-gather of the next block and the reduce-scatter
    of this one share the links, so the window exposes max(0, ag + rs - compute) even when each of them
    alone would hide (Zhao et al. 2023, Sec. 3.4) -- in every block but the last, which keeps its parameters
    after forward without a pipeline (executor fsdp.py keep_last): its window holds the reduce-scatter only."""
    import dataclasses
    model = load_model("llama3-8b")
    hw = dataclasses.replace(load_hardware("h100-sxm"), inter_node_bw_gbs=6.0, nic_gbps=None,
                              gpus_per_nic=None)
    wl = Workload(seq_len=8192, global_batch=64)
    coeffs = Coefficients()
    t = CandidateTable.from_plans([Plan(dp_shard=64, microbatch=1, n_microbatches=1, ac="full")])
    r, links, st = _parts(t, model, hw, wl, coeffs)
    fs = links["fsdp"]
    blk = rank_params(t, model)["dense_block"]
    ag, rs = (ring_gather_time(64, blk * b, fs.bw, fs.alpha)[0] for b in (2.0, 4.0))
    window = st["blockBW"][0]
    assert ag < window and rs < window < ag + rs        # each alone hides, together they do not
    on, _ = S.data_parallel(t, model, hw, wl, coeffs, links, r, st)
    off_t = CandidateTable.from_plans([Plan(dp_shard=64, microbatch=1, n_microbatches=1, ac="full",
                                            reshard_after_forward=False)])
    off, _ = S.data_parallel(off_t, model, hw, wl, coeffs, links, r, st)
    assert on[0] - off[0] == pytest.approx((model.n_layers - 1) * (ag + rs - window), rel=1e-6)


def test_tp_waits_inside_the_node_hide_data_parallel_traffic_across_nodes():
    """The DP collectives run on their own stream: while a block waits on its TP collectives over NVLink, another
    block's gradients keep the network busy, so those waits widen the window the DP traffic hides under -- where TP
    stays inside the node and the DP group crosses nodes, and only there (data_parallel.overlap_windows)."""
    from cost_models.data_parallel import overlap_windows
    model, hw = load_model("llama3-70b"), load_hardware("h100-sxm")
    wl, coeffs = Workload(seq_len=8192, global_batch=64, tp_comm_overlap="none"), Coefficients()
    t = CandidateTable.from_plans([Plan(tp=8, dp_shard=64, microbatch=1, n_microbatches=1),      # DP across nodes
                                   Plan(tp=2, dp_shard=4, microbatch=1, n_microbatches=16)])    # all in one node
    r, links, st = _parts(t, model, hw, wl, coeffs)
    assert links["tp"].intra.all() and list(links["fsdp"].intra) == [False, True]
    assert (st["tp_f"] > 0).all() and (st["tp_b"] > 0).all()
    nb = np.array([model.n_layers] * 2, dtype=float)
    win = overlap_windows(t, links, st, nb, links["fsdp"].intra)
    assert win["blockF"][0] == pytest.approx(st["blockF"][0] + st["tp_f"][0] / model.n_layers)
    assert win["blockBW"][0] == pytest.approx(st["blockBW"][0] + st["tp_b"][0] / model.n_layers)
    assert win["F"][0] == pytest.approx(st["F"][0] + st["tp_f"][0]) and win["B"][0] == pytest.approx(
        st["B"][0] + st["tp_b"][0])
    for k in ("blockF", "blockBW", "F", "B", "W"):         # DP on NVLink as TP is: the waits hide nothing
        assert win[k][1] == st[k][1], k
    # end to end: hiding the TP collectives (coefficient tp_overlap 0 -> 1) leaves fewer exposed TP waits, so the
    # DP window across nodes shrinks and more DP traffic is exposed (`_parts` takes the coefficients as given, not
    # through `Workload.with_overlaps`, so the workload's tp_comm_overlap does not reset them)
    one = CandidateTable.from_plans([Plan(tp=8, dp_shard=64, microbatch=1, n_microbatches=1)])
    slow_net = dataclasses.replace(hw, inter_node_bw_gbs=5.0, nic_gbps=None, gpus_per_nic=None)
    dp, tp = {}, {}
    for ov in (0.0, 1.0):
        c = Coefficients(tp_overlap=ov)
        r, links, st = _parts(one, model, slow_net, wl, c)
        dp[ov], tp[ov] = S.data_parallel(one, model, slow_net, wl, c, links, r, st)[0][0], st["tp_f"][0]
    assert tp[1.0] < tp[0.0] and dp[0.0] < dp[1.0], (tp, dp)


def test_nic_fields_decide_the_per_gpu_network_bandwidth():
    from cost_models.specs import SpecError, hardware_from_dict
    base = dict(name="x", device="cuda", peak_tflops_bf16=300.0, peak_tflops_fp32=20.0)
    p4d = hardware_from_dict({**base, "nic_gbps": 100.0, "gpus_per_nic": 2.0})   # 4x 100 Gb/s EFA / 8 GPUs
    assert p4d.inter_node_bw_gbs == pytest.approx(6.25) and p4d.nics_per_node == pytest.approx(4)
    for name in ("h100-sxm", "h800", "h200", "b200"):
        assert load_hardware(name).inter_node_bw_gbs == pytest.approx(50.0)    # 400 Gb/s per GPU
    assert load_hardware("a100-80g").inter_node_bw_gbs == pytest.approx(25.0)  # 200 Gb/s HDR per GPU
    with pytest.raises(SpecError, match="'inter_node_bw_gbs' \\(50\\) disagrees"):
        hardware_from_dict({**base, "nic_gbps": 200.0, "inter_node_bw_gbs": 50.0})
    with pytest.raises(SpecError, match="'gpus_per_nic' needs 'nic_gbps'"):
        hardware_from_dict({**base, "gpus_per_nic": 2.0})


def test_rail_optimized_all_to_all_relays_off_rail_bytes_over_nvlink():
    from cost_models.comm import all_to_all_time
    # 16 ranks, 8 per node; NVLink only 1.5x the NIC so the relayed share shows
    plain = all_to_all_time(16, 1.6e9, 8, 1.5e10, 0.0, 1e10, 0.0)
    relayed = all_to_all_time(16, 1.6e9, 8, 1.5e10, 0.0, 1e10, 0.0, relay=1.0)
    assert plain == pytest.approx(0.08)                                  # 8/16 off-node at 10 GB/s
    assert relayed == pytest.approx((7 / 16 + 8 / 16 * 7 / 8) * 1.6e9 / 1.5e10)  # NVLink now the bottleneck


def test_node_limited_routing_crosses_the_network_once_per_remote_node():
    """DeepSeek-V3 (Sec. 3.2.2): 256 experts in 8 groups, a token within its best 4; on EP 64 over 8 nodes
    (one group per node) a token reaches at most 4 nodes and is sent once to each remote one."""
    import dataclasses
    from cost_models.moe_traffic import ib_share
    m = load_model("deepseek-v3-671b")
    share = float(ib_share(m, np.array([64]), np.array([8]))[0])
    distinct = 4 * (1 - (3 / 4) ** 8)                 # occupancy of 4 nodes by 8 experts
    assert share == pytest.approx(distinct * 7 / 8 / 8)
    free = dataclasses.replace(m, n_expert_groups=0, n_limited_groups=0)
    assert float(ib_share(free, np.array([64]), np.array([8]))[0]) == pytest.approx(56 / 64)
    # inside one node nothing crosses the network
    assert float(ib_share(m, np.array([8]), np.array([8]))[0]) == 0.0
    # and the step's EP time falls accordingly on an H800 cluster (EP 64 x 8 nodes)
    hw, wl = load_hardware("h800"), Workload(seq_len=4096, global_batch=256, state_layout="megatron", zero=1)
    t = CandidateTable.from_plans([Plan(dp_shard=64, pp=1, ep=64, microbatch=1, n_microbatches=4, ac="full")])
    ep_limited = S.step_time_breakdown(t, m, hw, wl, Coefficients())["ep_comm"][0]
    ep_free = S.step_time_breakdown(t, free, hw, wl, Coefficients())["ep_comm"][0]
    assert ep_limited < 0.5 * ep_free


def test_group_limited_routing_keys_are_checked():
    from cost_models.specs import SpecError, load_model as lm
    import dataclasses
    m = lm("deepseek-v3-671b")
    with pytest.raises(SpecError, match="'n_expert_groups' \\(7\\) must divide n_experts"):
        dataclasses.replace(m, n_expert_groups=7)
    with pytest.raises(SpecError, match="'n_limited_groups' must be in 1..n_expert_groups"):
        dataclasses.replace(m, n_limited_groups=9)
    with pytest.raises(SpecError, match="'n_limited_groups' needs 'n_expert_groups'"):
        dataclasses.replace(m, n_expert_groups=0)


def test_root_unit_collectives_are_exposed_not_hidden_under_the_head():
    """The root (embedding, final norm, LM head) is all-gathered before any compute and reduce-scattered
    after the whole backward (executor/parallel/fsdp.py: fully_shard(model) after the blocks), so with
    full overlap the data-parallel time still holds both of them in full, per micro-batch (pp = 1)."""
    from cost_models.flops import param_counts
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm")
    wl = Workload(seq_len=8192, global_batch=256)
    coeffs = Coefficients()
    t = CandidateTable.from_plans([Plan(dp_shard=128, microbatch=1, n_microbatches=2, ac="full")])
    r, links, st = _parts(t, model, hw, wl, coeffs)
    dp, _ = S.data_parallel(t, model, hw, wl, coeffs, links, r, st)
    fs = links["fsdp"]
    pc = param_counts(model)
    root = pc["embedding"] + pc["lm_head"] + pc["final_norm"]
    blk = rank_params(t, model)["dense_block"]
    one = sum(ring_gather_time(128, x * b, fs.bw, fs.alpha)[0] for x in (root, blk) for b in (2.0, 4.0))
    assert dp[0] == pytest.approx(2 * one, rel=1e-6)       # every block's window hides its collectives


def test_grouped_expert_gemms_run_far_below_peak_at_few_tokens_per_expert():
    """compute.gemm_time with groups = local experts: each expert's weights are read once per micro-batch
    (roofline) and its rows fill whole tiles only above the tile height, so efficiency falls with the
    tokens an expert receives (DeepSeek-V3 shape, 4 local experts, H100 rates)."""
    from cost_models.compute import gemm_time
    rate, mem = 663e12, 3350e9 * 0.7

    def eff(rows):
        t = gemm_time(rows, 7168, 2048, rate, mem, 2.0, 2.0, 132, groups=4)
        return float(2 * 4 * rows * 7168 * 2048 / t / rate)
    assert eff(8192) > 0.9
    assert eff(128) < 0.5 * eff(8192) and eff(16) < 0.1
    assert eff(16) < eff(64) < eff(128) < eff(512)


def test_all_reduce_takes_the_tree_latency_across_many_nodes():
    """NCCL (tuning.cc) picks ring or tree per call: across 64 nodes the tree's 2(7 intra + 6 inter) latency
    replaces the ring's 2 x 511 steps; inside one node both are the same chain."""
    from cost_models.comm import all_reduce_time, group_link, link_params
    hw, coeffs = load_hardware("h100-sxm"), Coefficients()
    lp = link_params(hw, coeffs)
    big = group_link(np.array([512]), np.array([1]), hw, coeffs)
    tree = 2 * (7 * lp["intra_alpha"] + 6 * lp["inter_alpha"])
    assert big.tree_latency[0] == pytest.approx(tree)
    n = 1e6
    t = all_reduce_time(512, n, big.bw, big.alpha, big.tree_latency)[0]
    assert t == pytest.approx(2 * 511 / 512 * n / big.bw[0] + tree)
    node = group_link(np.array([8]), np.array([1]), hw, coeffs)
    assert all_reduce_time(8, n, node.bw, node.alpha, node.tree_latency)[0] == pytest.approx(
        all_reduce_time(8, n, node.bw, node.alpha)[0])


def test_gradient_accumulation_pass_by_framework():
    """grad_accum: autograd adds grad += g after the first micro-batch (12 B per fp32 element it holds:
    the unsharded gradients under pipelining, the shard otherwise); hp_copy (DeepSpeed's BF16 optimizer)
    18 B per local parameter after every micro-batch; fused (Megatron) nothing."""
    m = load_model("llama3-8b")
    tab = CandidateTable.from_plans([Plan(dp_shard=4, pp=2, n_microbatches=8), Plan(dp_shard=8, n_microbatches=8),
                                     Plan(dp_shard=8, n_microbatches=1)])
    rp = S.layout_facts(tab, m)["rp"]
    local = rp["last_dense"] + rp["last_expert"]
    auto = S.grad_accum_bytes(tab, m, Workload(seq_len=2048, global_batch=64), rp)
    assert auto[0] == pytest.approx(12.0 * local[0] * 7)                  # unsharded, pipelined
    assert auto[1] == pytest.approx(12.0 * local[1] / 8 * 7)              # the shard, after each reduce-scatter
    assert auto[2] == 0.0                                                 # one micro-batch: nothing to add
    megatron = dict(seq_len=2048, global_batch=64, state_layout="megatron")
    assert not S.grad_accum_bytes(tab, m, Workload(**megatron), rp).any()   # auto = fused
    hp = S.grad_accum_bytes(tab, m, Workload(**megatron, grad_accum="hp_copy"), rp)
    np.testing.assert_allclose(hp, 18.0 * local * tab.n_microbatches)
    bf16 = S.grad_accum_bytes(tab, m, Workload(**megatron, grad_accum="autograd", grad_dtype="bf16"), rp)
    np.testing.assert_allclose(bf16, 6.0 * local * np.maximum(tab.n_microbatches - 1, 0))


def test_tied_embedding_gradient_is_all_reduced_between_first_and_last_stage():
    """Tied embeddings under pipelining: the embedding (stage 0) and the LM head (last stage) are two
    copies of one weight, and their gradient is all-reduced over the two ranks once per step
    (Megatron-LM finalize_model_grads, DeepSpeed _exec_reduce_tied_grads): exposed, in the gradient's
    dtype (DeepSpeed's BF16 optimizer reduces its fp32 copy); nothing when untied, without pipelining,
    or when a V schedule keeps both ends on rank 0."""
    hw = load_hardware("a100-80g")
    untied = load_model("llama3-8b")
    tied = dataclasses.replace(untied, tie_embeddings=True)
    wl = Workload(seq_len=2048, global_batch=64, state_layout="megatron", grad_dtype="bf16")
    plans = [Plan(dp_shard=2, pp=4, tp=4, microbatch=1, n_microbatches=32, schedule="1F1B"),
             Plan(dp_shard=8, tp=4, microbatch=1, n_microbatches=8),
             Plan(dp_shard=4, pp=2, tp=4, microbatch=1, n_microbatches=16, schedule="ZBVZeroBubble",
                  stages_per_rank=2)]
    t = CandidateTable.from_plans(plans)
    links = axis_links(t, hw, Coefficients())
    ppl = links["pp"]
    sync = S.tied_embedding_sync(t, tied, wl, ppl)
    nbytes = 2.0 * tied.vocab_size * tied.dim / 4       # bf16 main gradients of this rank's vocab shard
    assert sync[0] == pytest.approx(2 * (ppl.p2p_alpha[0] + nbytes / 2 / ppl.p2p_bw[0]))
    assert sync[1] == 0.0 and sync[2] == 0.0
    assert not np.any(S.tied_embedding_sync(t, untied, wl, ppl))
    hp = dataclasses.replace(wl, grad_accum="hp_copy")
    assert S.tied_embedding_sync(t, tied, hp, ppl)[0] > 1.9 * sync[0]
    # and the step carries it, as exposed gradient synchronisation
    c = Coefficients()
    d_tied = S.step_time_breakdown(t, tied, hw, wl, c)["dp_comm"]
    d_untied = S.step_time_breakdown(t, untied, hw, wl, c)["dp_comm"]
    assert d_tied[0] - d_untied[0] == pytest.approx(sync[0], rel=1e-9)


def test_split_backward_recomputes_a_fully_checkpointed_block_in_the_weight_pass():
    """titan-run's V schedules (torch.distributed.pipelining) run input and weight gradients as two autograd
    passes and a fully checkpointed block is recomputed in each (tests/test_search_spaces.py shows torch
    doing it): W holds one more forward of the stage's blocks; a one-pass schedule's W does not, nor does
    the megatron layout's DualPipe (its weight pass keeps the inputs)."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm")
    coeffs = Coefficients()

    def st(schedule, ac, layout="fsdp2"):
        wl = Workload(seq_len=4096, global_batch=64, state_layout=layout, **({"zero": 1} if layout == "megatron" else {}))
        t = CandidateTable.from_plans([Plan(dp_shard=4, pp=2, microbatch=1, n_microbatches=16, schedule=schedule,
                                            stages_per_rank=2, ac=ac, reshard_after_forward=False, runnable=False)])
        return S.stage_times(t, model, hw, wl, coeffs, axis_links(t, hw, coeffs), Rates(hw, wl, coeffs))

    for sched in ("ZBVZeroBubble", "DualPipeV"):
        full, none = st(sched, "full"), st(sched, "none")
        blocks_f = float(full["F"][0] - full["head_F"][0])          # the stage's blocks, forward (GPU-bound)
        assert float(full["W"][0] - none["W"][0]) == pytest.approx(blocks_f, rel=1e-3)
        meg_full, meg_none = st(sched, "full", "megatron"), st(sched, "none", "megatron")
        assert float(meg_full["W"][0]) == pytest.approx(float(meg_none["W"][0]), rel=1e-12)
    one = st("Interleaved1F1B", "full"), st("Interleaved1F1B", "none")
    assert float(one[0]["W"][0]) == pytest.approx(float(one[1]["W"][0]), rel=1e-12)


def test_titan_runs_compiled_v_schedules_fill_no_bubble_with_weight_work():
    """titan-run runs a V schedule's whole backward in the input pass when the blocks are compiled (the deferred
    weight pass through compiled blocks gives wrong gradients: executor/parallel/pipeline.py), so the zero-bubble
    schedule's bubble is the plain one there; eager, and the megatron layout's V schedules, keep the deferral."""
    from cost_models.estimate import estimate
    from cost_models.specs import load_hardware, load_model
    from cost_models.workload import Workload
    from search_spaces.plan import Plan
    from search_spaces.table import CandidateTable
    m, hw = load_model("llama3-70b"), load_hardware("h100-sxm")
    plans = [Plan(pp=4, dp_shard=2, microbatch=1, n_microbatches=8, schedule=s, stages_per_rank=2, compile=c,
                  runnable=False) for s in ("ZBVZeroBubble", "DualPipeV") for c in (False, True)]
    t = CandidateTable.from_plans(plans)
    fsdp2 = estimate(t, m, hw, Workload(seq_len=4096, global_batch=64)).time["pp_bubble"]
    mega = estimate(t, m, hw, Workload(seq_len=4096, global_batch=64, state_layout="megatron", zero=1)
                    ).time["pp_bubble"]
    for eager, compiled in ((0, 1), (2, 3)):
        assert fsdp2[compiled] > 1.5 * fsdp2[eager]            # compile makes the blocks faster, yet the bubble grows
        assert mega[compiled] < mega[eager]                    # another stack's compiled V schedule keeps deferring
