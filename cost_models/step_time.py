"""Step time per optimizer step, as a breakdown, for every candidate of a `CandidateTable`.

Keys (seconds per step): compute, tp_comm, cp_comm, ep_comm, dp_comm (exposed gradient and
parameter synchronisation: data parallel, and a tied embedding across pipeline stages),
pp_p2p, pp_bubble, other.  They sum to the step time.

The critical path is the pipeline rank with the most work per micro-batch: the busiest by blocks
(the most MoE blocks, then the most layers) or the one holding the LM head and loss, whichever takes
longer (`stage_times`).  Per micro-batch it runs forward F, input-gradient backward B and
weight-gradient backward W of its blocks; a step is ``n_microbatches * (F + B + W)``
plus the pipeline bubble, the exposed data-parallel collectives, the point-to-point
pipeline transfers and the optimizer.  Each block (and the LM head) takes the larger, smoothly,
of its GPU time and the host time of launching its kernels (`compute.launch_bound`): small
micro-batches of small models are launch-bound.
"""
from __future__ import annotations

import numpy as np


from .activations import ffn_rebuild_rows
from .comm import all_reduce_time, all_to_all_time, axis_links, link_params, p2p_time, ring_gather_time
from .compute import (Rates, elementwise_bytes, ep_regroup_bytes, expert_kernels, float8_cast_bytes, gemm_sums,
                      gemm_time, head_kernels, kernels_per_block, launch_bound, layer_gemms, matmul_times)
from .data_parallel import data_parallel, grad_accum_bytes, layout_facts  # noqa: F401 (tests use S.*)
from .flops import ROW, attention_dims, layer_matmuls
from .layout import holds_ends, layer_mix, mtp_blocks, unique_rows
from .memory import loss_compiled
from .moe_traffic import a2a_overlap_runs, dispatch_sm_share, ib_share, nvlink_relay, sends_once_per_node

TIME_KEYS = ("compute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_p2p", "pp_bubble", "other")

# Flash-attention backward does 2.5x the forward FLOPs (it recomputes QK^T):
# Dao 2023 (arXiv:2307.08691), Sec. 3.1.2 -- 5 matmuls backward vs 2 forward.
FLASH_BWD = 2.5


def stage_times(table, model, hw, workload, coeffs, links, r: Rates):
    """Per micro-batch times of the critical pipeline rank: dict of F/B/W compute and exposed comm arrays.

    The critical rank is the one whose own work per micro-batch is the largest: its blocks plus the LM
    head and loss where it holds them (`layout.holds_ends`).  With the layers split evenly and the
    earlier stages larger, the last stage often holds a block fewer than the busiest one, and its head
    can make it the slowest or not; charging the busiest rank's blocks AND the head counts a block the
    pipeline never runs on one rank (BLOOM-176B: 70 layers over 12 stages, 6 on stage 0, 5 and the head
    on stage 11).  Ranks compared: the busiest by blocks (`layout.rank_index`), and the ones holding the
    head (the last; the first under the V placement).  ``head_F``/``head_B``/``head_W`` are the head's
    times on the chosen rank (zero where it holds none): the bubble leaves them out."""
    n = len(table)
    tp = table.tp.astype(np.float64)
    cp = table.cp.astype(np.float64)
    tokens = table.microbatch * float(workload.seq_len) / cp
    attn = attention_core_times(model, workload, r, tokens, tp, cp)
    ac_full = table.is_ac("full")
    keys = ("F", "B", "W", "tp_f", "tp_b", "cp_f", "cp_b", "ep_f", "ep_b")
    tp_coll = _tp_collectives(table, model, workload, links["tp"], r, tokens, tp)
    cp_f, cp_b = _cp_ring_times(model, coeffs, links["cp"], r, tokens, tp, cp, *attn)
    per_block = {}
    for moe in (False, True):
        if moe and not model.is_moe:
            continue
        coll = tp_coll if not moe or workload.moe_ffn_tp_split else _attention_side_only(tp_coll)
        blk = _block_times(table, model, workload, coeffs, r, moe, tokens, tp, attn, coll)
        one = {"F": blk["f"], "B": blk["b"], "W": blk["w"], "tp_f": blk["tpf"], "tp_b": blk["tpb"],
               "cp_f": cp_f, "cp_b": np.where(ac_full, cp_f, 0.0) + cp_b}
        if moe:
            one["ep_f"], one["ep_b"] = _ep_exposed(table, model, hw, coeffs, links["ep"], r, tokens, tp,
                                                   blk["gpu_f"], blk["gpu_b"], workload)
            g_f, g_b = _expert_tp_gathers(table, model, workload, links["tp"], r, tokens, tp)
            one["tp_f"], one["tp_b"] = one["tp_f"] + g_f, one["tp_b"] + g_b
        per_block[moe] = one
    head = head_times(model, workload, r, tokens, tp, loss_compiled(table, workload))
    if model.mtp_layers:
        # each multi-token-prediction module runs the head and loss once more and its [2h -> h] projection
        # (column-parallel; forward, input and weight gradients) on the rank holding the head; its block is
        # counted with the rank's blocks below (`layout.mtp_blocks`)
        proj = model.mtp_layers * gemm_time(tokens, 2 * model.dim, model.dim / tp, r.gemm, r.mem, r.elt, r.elt, r.sms)
        head = {k: (1 + model.mtp_layers) * head[k] + proj for k in ("F", "B", "W")}
    m_dense, m_moe = mtp_blocks(model)

    def rank_work(which):
        nd, nm = layer_mix(table, model, which=which, weighted=workload.pp_weighted)
        _, has_head = holds_ends(table, model, which, workload.pp_weighted)
        nd, nm = nd + has_head * m_dense, nm + has_head * m_moe
        out = {k: np.zeros(n) for k in keys}
        for moe, count in ((False, nd), (True, nm)):
            for k, v in per_block.get(moe, {}).items():
                out[k] = out[k] + count * v
        hh = has_head.astype(np.float64)
        for k in ("F", "B", "W"):
            out[k] = out[k] + hh * head[k]
            out[f"head_{k}"] = hh * head[k]
        out["head_BW"] = out["head_B"] + out["head_W"]
        # average block of the rank (FSDP's per-block overlap window)
        nb = np.maximum(nd + nm, 1)
        out["blockF"] = sum(count / nb * per_block[moe]["F"] for moe, count in ((False, nd), (True, nm))
                            if moe in per_block)
        out["blockBW"] = sum(count / nb * (per_block[moe]["B"] + per_block[moe]["W"])
                             for moe, count in ((False, nd), (True, nm)) if moe in per_block)
        total = sum(out[k] for k in keys)
        return out, total

    best, best_total = rank_work("busiest")
    # the head is on the last rank, or on the first under the V placement (the first holds no more blocks)
    for which in ("last", "first") if table.is_v_schedule.any() else ("last",):
        cand, total = rank_work(which)
        pick = total > best_total
        if pick.any():
            best = {k: np.where(pick, cand[k], v) for k, v in best.items()}
            best_total = np.maximum(total, best_total)
    return best


# A block's four TP collectives under sequence parallelism (Korthikanti Sec. 4.2.2), each on the side of
# the matmuls that read its all-gathered input or produce its reduce-scattered output:
# attention all-gather (QKV), attention reduce-scatter (out-projection), FFN all-gather, FFN reduce-scatter.
TP_SIDES = ("attn_ag", "attn_rs", "ffn_ag", "ffn_rs")


def tp_side(m, dim: int) -> int | None:
    """Index in `TP_SIDES` of the collective a block matmul `m` can hide under, None for one that neither
    reads the gathered residual nor writes the reduced one (MLA's up projections read their latents)."""
    if m.shard == ROW:
        return 1 if m.group == "attn" else 3
    if m.k == dim:
        return 0 if m.group == "attn" else 2
    return None


def _tp_collectives(table, model, workload, tp_link, r: Rates, tokens, tp) -> tuple:
    """(time of one TP collective of a block's activations, collectives recomputed in backward,
    collective launches per direction, and per side of `TP_SIDES` the collectives forward, backward
    and recomputed, in units of that time).

    TP with SP (Korthikanti Sec. 4.2.2): per block 2 all-gathers + 2 reduce-scatters forward and
    the same backward (an all-gather's backward is a reduce-scatter: one per side each way); without SP
    2 all-reduces each way (same volume: an all-reduce is two of the units), after the row-parallel
    matmuls forward and the column-parallel ones backward.  Full AC repeats the forward's 4; the 'op'
    policy re-gathers the inputs of recomputed matmuls (2); the 'matmul' policy keeps the collectives'
    outputs.
    """
    n = len(table)
    sel = table.is_ac("selective")
    full = table.is_ac("full")
    op_sac = sel & (workload.selective_policy == "op")
    tp_one = ring_gather_time(tp, tokens * model.dim * r.elt, tp_link.bw, tp_link.alpha)
    # sequence-sharded saves (tp_activations) re-gather the QKV and FFN inputs in backward (2), as
    # the 'op' policy's recomputed matmuls do; a recomputed dense MLP repeats its all-gather and
    # reduce-scatter (2 more)
    regather = np.where(op_sac | (not workload.tp_keeps_gathered), 1.0, 0.0)      # per all-gather side
    mlp_rec = np.where(sel & (workload.recomputes("mlp") and not model.is_moe), 1.0, 0.0)   # per FFN side
    z = np.zeros(n)
    if workload.sequence_parallel:
        fwd, bwd = (1.0, 1.0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0)
        rec = [np.where(full, 1.0, regather), np.where(full, 1.0, z),
               np.where(full, 1.0, regather + mlp_rec), np.where(full, 1.0, mlp_rec)]
    else:
        fwd, bwd = (0.0, 2.0, 0.0, 2.0), (2.0, 0.0, 2.0, 0.0)
        rec = [np.where(full, 0.0, regather), np.where(full, 2.0, z),
               np.where(full, 0.0, regather), np.where(full, 2.0, 2.0 * mlp_rec)]
    tp_rec = sum(rec)
    n_coll = np.where(tp > 1, 4.0 if workload.sequence_parallel else 2.0, 0.0)   # launches per direction
    return tp_one, tp_rec, n_coll, (fwd, bwd, rec)


def _attention_side_only(tp_coll) -> tuple:
    """`_tp_collectives` of a block whose FFN runs whole on every TP rank (a titan-run MoE layer, on its
    sequence-parallel tokens: `Workload.moe_ffn_tp_split`): the attention side's collectives alone."""
    tp_one, _, n_coll, (fwd, bwd, rec) = tp_coll
    keep = [i for i, name in enumerate(TP_SIDES) if name.startswith("attn")]
    fwd = tuple(v if i in keep else 0.0 for i, v in enumerate(fwd))
    bwd = tuple(v if i in keep else 0.0 for i, v in enumerate(bwd))
    rec = [v if i in keep else 0.0 * v for i, v in enumerate(rec)]
    return tp_one, sum(rec), n_coll / 2.0, (fwd, bwd, rec)


def _tp_exposed(mm, model, workload, coeffs, tp, tp_one, sides) -> tuple[np.ndarray, np.ndarray]:
    """Exposed TP collective time of one block per micro-batch, forward and backward.

    Without overlap every collective is on the critical path.  Async TP (TorchTitan's micro-pipelined
    all-gather / reduce-scatter matmuls) and Megatron's TP overlap (Transformer Engine userbuffers)
    decompose each collective into `tp` chunks and run it under the matmul that consumes or produces its
    tensor (Wang et al. 2022, ASPLOS, "Overlap communication with dependent computation via
    decomposition"): chunk k's matmul runs while chunk k+1 moves, so of a collective of time c next to
    matmuls of time g the ring's tp-1 transfers hide under (tp-1)/tp of g and the exposed time is
    max(0, c - tp_overlap * g * (tp-1)/tp).  Each collective hides only under its own matmuls (`TP_SIDES`:
    a GQA model's all-gather before the small QKV projection stays partly exposed however large its
    MLP).  Backward, ``full`` (userbuffers: fused QKV and gate/up weights, the input-gradient
    reduce-scatter overlapped with the weight-gradient GEMM) pairs each side's collectives, the
    recomputed ones included, with its input- and weight-gradient GEMMs (2 g).  ``async`` is what torch's
    ``micro_pipeline_tp`` pass fuses (torch/_inductor/fx_passes/micro_pipeline_tp.py): an all-gather with
    the matmuls that read it, a reduce-scatter with the single matmul that produces it
    (``_find_producer_matmul``).  So backward the row-parallel side's gradient all-gather hides under its
    input-gradient matmul (1 g), a column-parallel side's input-gradient reduce-scatter only when one
    matmul feeds it (autograd sums the separate Q, K, V or gate and up input gradients first: exposed), and
    recomputed forward collectives under their recomputed matmuls (1 g); it needs sequence parallelism."""
    fwd, bwd, rec = sides
    g = [np.zeros_like(tp_one) for _ in TP_SIDES]
    n_mm = [0] * len(TP_SIDES)
    for m, t in mm:
        side = tp_side(m, model.dim)
        if side is not None:
            g[side] = g[side] + t
            n_mm[side] += 1
    overlap = coeffs.tp_overlap
    async_tp = workload.tp_comm_overlap == "async"
    if async_tp and not workload.sequence_parallel:
        overlap = 0.0
    hide = overlap * (tp - 1.0) / np.maximum(tp, 1.0)
    sides_ = range(len(TP_SIDES))
    if not async_tp:
        tpf = sum(np.maximum(0.0, fwd[i] * tp_one - hide * g[i]) for i in sides_)
        tpb = sum(np.maximum(0.0, (bwd[i] + rec[i]) * tp_one - hide * 2 * g[i]) for i in sides_)
        return tpf, tpb
    # even sides all-gather forward (fused with any number of consuming matmuls) and reduce-scatter backward;
    # odd sides the reverse; a reduce-scatter fuses only with one producing matmul
    fwd_hide = [hide * g[i] if (i % 2 == 0 or n_mm[i] == 1) else 0.0 for i in sides_]
    bwd_hide = [hide * g[i] if (i % 2 == 1 or n_mm[i] == 1) else 0.0 for i in sides_]
    tpf = sum(np.maximum(0.0, fwd[i] * tp_one - fwd_hide[i]) for i in sides_)
    tpb = sum(np.maximum(0.0, bwd[i] * tp_one - bwd_hide[i]) + np.maximum(0.0, rec[i] * tp_one - fwd_hide[i])
              for i in sides_)
    return tpf, tpb


def _cp_ring_times(model, coeffs, cp_link, r: Rates, tokens, tp, cp, a_fwd, a_bwd) -> tuple[np.ndarray, np.ndarray]:
    """Exposed CP ring-attention transfers per block (Liu et al. 2023, arXiv:2310.01889), forward and
    backward: cp-1 steps, each passing the K/V chunk forward and K/V plus dK/dV backward, overlapped
    with the step's attention compute."""
    _, d_k, d_v = attention_dims(model)
    kv_bytes = tokens * (d_k + d_v) / tp * r.elt
    step_f = p2p_time(kv_bytes, cp_link.p2p_bw, cp_link.p2p_alpha)
    step_b = p2p_time(2 * kv_bytes, cp_link.p2p_bw, cp_link.p2p_alpha)
    cp_f = (cp - 1) * np.maximum(0.0, step_f - coeffs.cp_overlap * a_fwd / cp)
    cp_b = (cp - 1) * np.maximum(0.0, step_b - coeffs.cp_overlap * a_bwd / cp)
    return np.where(cp > 1, cp_f, 0.0), np.where(cp > 1, cp_b, 0.0)


def _block_times(table, model, workload, coeffs, r: Rates, moe: bool, tokens, tp, attn, tp_coll) -> dict:
    """One dense or MoE block per micro-batch: F, B (input gradients), W (weight gradients), the exposed
    TP collectives each way (tpf, tpb) and the GPU time of F and B (gpu_f, gpu_b)."""
    a_fwd, a_bwd = attn
    tp_one, tp_rec, n_coll, sides = tp_coll
    sp = tp if workload.sequence_parallel else np.ones(len(table))
    ac_full, ac_sel = table.is_ac("full"), table.is_ac("selective")
    op_sac = ac_sel & (workload.selective_policy == "op")
    mm_sac = ac_sel & (workload.selective_policy == "matmul")
    att_sac = ac_sel & (workload.selective_policy == "attention")
    compiled = table.compile
    mm = matmul_times(table, model, workload, coeffs, r, moe)
    g_f, g_rec = gemm_sums(mm)
    e_seq, e_shard = np.array([elementwise_bytes(model, workload, moe, c) for c in (False, True)]).T
    el_f = tokens * (e_seq[compiled.astype(int)] / sp + (e_shard[compiled.astype(int)]
                                                         + ep_regroup_bytes(table, model, workload, moe)) / tp) / r.mem
    el_f = el_f + np.where(table.float8, tokens * float8_cast_bytes(model, moe, compiled, r.elt) / tp / r.mem, 0.0)
    kern = np.where(compiled, kernels_per_block(model, workload, moe, True),
                    kernels_per_block(model, workload, moe, False)) + expert_kernels(table, model, workload, moe)
    # recomputation in backward (Korthikanti Sec. 5, Table 4): full = the whole forward again;
    # 'op' = the unsaved matmuls and all pointwise ops; 'attention' = the attention core.
    mod_rec = _module_recompute(table, model, workload, coeffs, r, moe, tokens, tp, sp, a_fwd)
    rec = np.where(ac_full, g_f + a_fwd + el_f,
                   np.where(op_sac, g_rec + el_f, np.where(mm_sac, el_f, np.where(att_sac, a_fwd, mod_rec))))
    rec_k = np.where(ac_full, 1.0, np.where(op_sac, 0.6, np.where(mm_sac, 0.5, np.where(
        att_sac, 0.1, np.where(ac_sel, mod_rec / np.maximum(g_f + a_fwd + el_f, 1e-30), 0.0)))))
    # backward launches ~2x the forward's kernels (+ the recomputed ones); W is one per weight
    n_mm = float(len({m.name for m in layer_matmuls(model, moe)}))
    lat = coeffs.kernel_latency_s
    gpu_f = g_f + a_fwd + el_f + kern * lat
    gpu_b = g_f + a_bwd + 2 * el_f + rec + ((2.0 + rec_k) * kern - n_mm) * lat   # B: input gradients
    gpu_b = gpu_b + _rebuilt_ffn_input_time(table, model, workload, r, moe, tokens, tp, lat)
    g_w = g_f + n_mm * lat                         # W: weight-gradient GEMMs
    tpf, tpb = _tp_exposed(mm, model, workload, coeffs, tp, tp_one, sides)
    # host side: every kernel and every collective is launched by the CPU; the TP collectives
    # sit on the compute stream (no overlap), so they count on the GPU side as well
    host_f = (kern + n_coll) * r.launch
    host_b = (kern * (2.0 + rec_k) + n_coll * (1.0 + tp_rec / 4)) * r.launch
    f = launch_bound(gpu_f + tpf, host_f, r.sharpness) - tpf
    b = launch_bound(gpu_b + g_w + tpb, host_b, r.sharpness) - g_w - tpb
    # the V schedules under torch.distributed.pipelining (the fsdp2 layout: titan-run, TorchTitan) run the
    # backward as two autograd passes, input gradients then weight gradients, and a fully checkpointed block
    # is recomputed in each (non-reentrant checkpoint recomputes per pass; DeepSeek's DualPipe keeps the
    # weight-gradient inputs instead, the megatron layout): W repeats the block's forward
    w_rec = np.where((workload.state_layout == "fsdp2") & table.is_v_schedule & (table.pp > 1) & ac_full,
                     gpu_f, 0.0)
    return {"f": f, "b": b, "w": g_w + w_rec, "tpf": tpf, "tpb": tpb, "gpu_f": gpu_f, "gpu_b": gpu_b}


def _rebuilt_ffn_input_time(table, model, workload, r: Rates, moe: bool, tokens, tp, lat: float) -> np.ndarray:
    """Backward time of rebuilding the FFN's down-projection input where the block does
    (`Workload.ffn_rebuilds_product`: titan-run's eager blocks without recompute, ``swiglu_impl: fused_ffn``): the
    activation once more, reading gate and up (the GELU input) and writing the product, two kernels (silu and the
    product; one GELU), per token of the rank's ffn width."""
    rebuilds = ffn_rebuild_rows(table, workload)
    if not rebuilds.any():
        return np.zeros(len(table))
    e = r.elt
    width = (model.top_k + model.n_shared_experts) * model.moe_ffn_hidden if moe else model.ffn_hidden
    swiglu = model.mlp == "swiglu"
    traffic = tokens * (3.0 if swiglu else 2.0) * e * width / tp / r.mem
    return np.where(rebuilds, traffic + (2.0 if swiglu else 1.0) * lat, 0.0)


def _module_recompute(table, model, workload, coeffs, r: Rates, moe: bool, tokens, tp, sp, a_fwd) -> np.ndarray:
    """Forward time one block recomputes under selective_ac 'modules' (Megatron's recompute_modules):
    the attention core, the two norms (read and write the residual width), MLA's up projections,
    the dense MLP's or the MoE layer's (router, experts, shared experts) matmuls, the experts'
    activation (read gate and up, write the product) and the shared experts."""
    if workload.selective_ac != "modules":
        return np.zeros(len(table))
    e = r.elt
    rec = np.zeros(len(table))
    if workload.recomputes("core_attn"):
        rec = rec + a_fwd
    if workload.recomputes("layernorm"):
        rec = rec + tokens * 2 * 2 * e * model.dim / sp / r.mem
    names: set[str] = set()
    if workload.recomputes("mla_up_proj") and model.attention == "mla":
        names |= {"wq_b", "wkv_b", "wq"}
    if workload.recomputes("mlp") and not moe:
        names |= {"w1", "w2", "w3", "fc1", "fc2"}
    if moe and workload.recomputes("moe"):
        names |= {m.name for m in layer_matmuls(model, moe) if m.group == "ffn"}
    elif moe and workload.recomputes("shared_experts"):
        names |= {m.name for m in layer_matmuls(model, moe) if m.name.startswith("shared.")}
    if names:
        rec = rec + layer_gemms(table, model, workload, coeffs, r, moe, only=names.__contains__)[0]
    if moe and workload.recomputes("moe_act") and not workload.recomputes("moe"):
        rec = rec + tokens * model.top_k * 3 * e * model.moe_ffn_hidden / tp / r.mem
    return rec


def _expert_tp_gathers(table, model, workload, tp_link, r: Rates, tokens, tp) -> tuple[np.ndarray, np.ndarray]:
    """Exposed TP collectives of Megatron's alltoall dispatcher for TP-split experts (workload ``expert_tp``), one
    MoE block per micro-batch, forward and backward: with sequence parallelism each TP rank routes its sequence
    shard, so after the all-to-all the routed tokens are all-gathered over TP (top_k x tokens x hidden) for the
    split expert GEMMs and their output reduce-scattered before the way back (token_dispatcher.py
    ``gather_from_sequence_parallel_region`` / ``reduce_scatter_to_sequence_parallel_region``), serially; backward
    runs the mirror pair, and full or 'moe' recompute the forward pair again.  The megatron layout only
    (titan-run and TorchTitan gather a block's tokens once before routing, the FFN side's collectives)."""
    z = np.zeros(len(table))
    if not (model.is_moe and workload.state_layout == "megatron" and workload.sequence_parallel
            and workload.experts_tp_split):
        return z, z
    one = ring_gather_time(tp, tokens * model.top_k * model.dim * r.elt, tp_link.bw, tp_link.alpha)
    one = np.where(tp > 1, one, 0.0)
    rec = table.is_ac("full") | (table.is_ac("selective") & workload.recomputes("moe"))
    return 2.0 * one, (2.0 + 2.0 * rec) * one


def _ep_exposed(table, model, hw, coeffs, ep_link, r: Rates, tokens, tp, gpu_f, gpu_b,
                workload) -> tuple[np.ndarray, np.ndarray]:
    """Exposed EP dispatch + combine all-to-alls of one MoE block (Lepikhin et al. 2020,
    arXiv:2006.16668), forward and backward.  DualPipeV overlaps them with the other micro-batch's
    compute; so does Megatron's combined 1F1B (workload ``ep_a2a_overlap: combined_1f1b``), layer
    by layer (megatron/core/models/common/model_chunk_schedule_plan.py, ``schedule_layer_1f1b``):

        comm stream:    combine_bwd      | dispatch_fwd, dispatch_bwd        | combine_fwd
        compute stream: attention fwd    | expert MLP bwd, its wgrad, MLP fwd | attention bwd

    (delay_wgrad_compute puts the experts' weight gradients in the middle phase), so each phase
    exposes max(0, its all-to-alls - its compute).  The first forwards and last backwards of a
    step have no partner: Megatron's warm-up of an interleaved pipeline, (pp - 1) * 2 + (v - 1) * pp
    chunk forwards on the first rank plus the one extra micro-batch the overlap schedules
    (megatron/core/pipeline_parallel/schedules.py), one micro-batch without a pipeline; their share of
    the step's micro-batches keeps its all-to-alls exposed."""
    sp = tp if workload.sequence_parallel else np.ones(len(table))
    lpd = link_params(hw, coeffs)
    lp = (lpd["intra_bw"], lpd["intra_alpha"], lpd["inter_bw"], lpd["inter_alpha"])
    # full recompute, or Megatron's 'moe' recompute module, runs the dispatch and combine again
    moe_rec = table.is_ac("selective") & workload.recomputes("moe")
    ac_full = table.is_ac("full") | moe_rec
    a2a_bytes = tokens / sp * model.top_k * model.dim * r.elt * coeffs.ep_imbalance
    # every routed copy, or each token once per remote node and then over NVLink (workload ep_dispatch:
    # moe_traffic.ib_share, nvlink_relay)
    once = sends_once_per_node(model, workload)
    a2a = all_to_all_time(table.ep, a2a_bytes, ep_link.per_node, *lp,
                          relay=nvlink_relay(model, table.ep, ep_link.per_node, once, hw.rail_optimized),
                          off_fraction=ib_share(model, table.ep, ep_link.per_node, once))
    dual = table.is_schedule("DualPipeV")
    # compute that runs beside SM-resident dispatch kernels (DeepEP, HybridEP) has the other SMs: an all-to-all
    # of time a next to compute c takes max(a, c + share * a), so even a hidden one costs share * a
    share = dispatch_sm_share(model, workload, hw)

    def beside(comm, compute):      # what an all-to-all of time `comm` adds to the compute it overlaps
        return np.maximum(share * comm, comm - compute)
    exp_f = np.where(dual, beside(2 * a2a, gpu_f), (1 - coeffs.ep_overlap) * 2 * a2a)
    exp_b = np.where(dual, beside((2 + 2 * ac_full) * a2a, gpu_b),
                     (1 - coeffs.ep_overlap) * (2 + 2 * ac_full) * a2a)
    runs = a2a_overlap_runs(table, workload) & ~dual      # Megatron's conditions (moe_traffic)
    if not runs.any():
        return exp_f, exp_b
    pp, v, m = table.pp.astype(np.float64), table.stages_per_rank.astype(np.float64), table.n_microbatches
    ffn = {mm.name for mm in layer_matmuls(model, True) if mm.group == "ffn"}
    mlp = layer_gemms(table, model, workload, coeffs, r, True, only=ffn.__contains__)[0]   # fwd = dgrad = wgrad
    phase1 = beside(a2a, np.maximum(gpu_f - mlp, 0.0))      # combine bwd under attention fwd
    phase2 = beside(2 * a2a, 3 * mlp)                       # dispatch fwd + bwd under the MLPs
    phase3 = beside(a2a, np.maximum(gpu_b - mlp, 0.0))      # combine fwd under attention bwd
    warm = np.where(pp > 1, (pp - 1) * 2 + (v - 1) * pp + 1, 1.0)
    alone = np.minimum(1.0, warm / np.maximum(m * v, 1.0))            # share of F and B without a partner
    ov_f = alone * exp_f + (1 - alone) * (phase3 + phase2 / 2)
    ov_b = alone * exp_b + (1 - alone) * (phase1 + phase2 / 2)
    return np.where(runs, ov_f, exp_f), np.where(runs, ov_b, exp_b)


def attention_core_times(model, workload, r: Rates, tokens, tp, cp):
    """Forward and backward time of one block's attention core (scores and mixing) per micro-batch."""
    s = float(workload.seq_len)
    d_qk, d_k, d_v = attention_dims(model)
    d_o = model.n_heads * (model.v_head_dim if model.attention == "mla" else model.head_dim)
    if workload.attention_impl == "fused":
        a_fwd = 2.0 * tokens * (s / 2) * (d_qk + d_o) / tp / r.attn          # causal half
        a_bwd = FLASH_BWD * a_fwd
    else:  # materialized: full s x s batched GEMMs + softmax/dropout traffic (Megatron non-flash)
        scores = tokens * s * model.n_heads / tp
        traffic = scores * (4 * r.elt + ((2 * r.elt + 1) if workload.dropout else 0.0))
        a_fwd = 2.0 * tokens * s * (d_qk + d_o) / tp / r.gemm + traffic / r.mem
        a_bwd = 4.0 * tokens * s * (d_qk + d_o) / tp / r.gemm + traffic / r.mem   # same traffic backward
    # ring attention merges each step's partial result into fp32 accumulators (out/LSE forward;
    # dQ, dK, dV backward): read partial, read and write the accumulator, per step after the first
    merge = (cp - 1) * tokens * (8.0 + r.elt) / tp / r.mem
    return a_fwd + merge * d_o, a_bwd + merge * (d_qk + d_k + d_v)


def head_times(model, workload, r: Rates, tokens, tp, compiled=False) -> dict:
    """LM head + loss on the last stage (the rank holding it may pace the pipeline): the head GEMM on this rank's
    vocabulary shard (vocab // tp rows), the fp32 cross-entropy traffic, and the host launches of
    the embedding, final norm, head and loss kernels (`head_kernels`), forward and backward.  A loss compiled
    with the model (`compiled`, ``memory.loss_compiled``) moves 4 e bytes per logit (forward reads the logits
    twice, for the row maximum and the sum of exponentials; backward reads them and writes their gradient)
    in 2 kernels instead of the eager fp32 passes; other fused losses keep the eager figure (Megatron's
    cross_entropy_loss_fusion still upcasts and keeps an fp32 exp of the logits)."""
    vshard = np.floor(model.vocab_size / tp)
    head_f = gemm_time(tokens, model.dim, vshard, r.gemm, r.mem, r.elt, r.elt, r.sms)
    loss = tokens * model.vocab_size / tp * np.where(compiled, 4 * r.elt, 36 + 2 * r.elt) / r.mem
    gpu_head = 3 * head_f + loss
    k_head = head_kernels(workload) - np.where(compiled, 6.0, 0.0)     # the loss's 8 kernels as 2
    stretch = launch_bound(gpu_head, 3 * k_head * r.launch, r.sharpness) / np.maximum(gpu_head, 1e-30)
    f, b, w = stretch * (head_f + loss / 3), stretch * (head_f + 2 * loss / 3), stretch * head_f
    return {"F": f, "B": b, "W": w, "head_F": f, "head_B": b, "head_W": w, "head_BW": b + w}


def tied_embedding_sync(table, model, workload, pp_link) -> np.ndarray:
    """Exposed all-reduce of a tied embedding's gradient between the first and the last pipeline
    stage, per step (seconds).  Under pipelining the embedding (stage 0) and the LM head (the last
    stage) are two copies of one weight on two ranks; after the last backward, before the optimizer,
    the two ranks all-reduce its gradient over their own two-rank group: Megatron-LM
    ``finalize_model_grads`` -> ``_allreduce_word_embedding_grads`` (main gradients: fp32, or bf16 with
    grad_dtype bf16), DeepSpeed ``PipelineEngine._exec_reduce_tied_grads`` (``dist.all_reduce`` of the
    weight's gradient; its BF16 optimizer's fp32 copy, ``weight._hp_grad``, under grad_accum hp_copy),
    titan-run ``TiedEmbedding.sync_grads`` (executor/parallel/pipeline.py: the fsdp2 layout's gradient shards,
    after FSDP's reduce-scatter).  The V schedules put the last stage on rank 0, next to the embedding: nothing to
    synchronise."""
    if not (model.tie_embeddings or model.mtp_layers):    # MTP reads the embedding on the head's stage: a copy too
        return np.zeros(len(table))
    shard = table.fsdp_size if workload.state_layout == "fsdp2" else 1
    nbytes = (4.0 if workload.grad_accum_mode == "hp_copy" else workload.grad_elem_bytes) \
        * model.vocab_size * model.dim / table.tp / shard
    t = all_reduce_time(2, nbytes, pp_link.p2p_bw, pp_link.p2p_alpha)
    return np.where((table.pp > 1) & ~table.is_v_schedule, t, 0.0)


def bubble_microbatches(table, F, B, W) -> np.ndarray:
    """Pipeline bubble, seconds, from per-micro-batch F/B/W of a pipeline stage.

    * GPipe, 1F1B: (pp-1)(F+B+W) -- Narayanan et al. 2021 (arXiv:2104.04473) Sec. 2.2.1:
      bubble fraction (p-1)/m of the ideal time;
    * Interleaved1F1B: (pp-1)(F+B+W)/v -- ibid. Sec. 2.2.2;
    * ZBVZeroBubble: chunks are half a rank; (pp-1)(F_c + B_c - 2W_c) -- Qi et al. 2024
      (arXiv:2401.10241) Sec. 2.2 (ZB-H2 bubble, which ZB-V reaches with 1F1B memory, Sec. 6);
    * DualPipeV: (pp-1)(F&B_c + B_c + W_c - 3W_c) with F&B ~ F + B + W -- DeepSeek-V3 report
      (arXiv:2412.19437) Table 2 ("full backward" B there = our B + W), V-shaped over pp ranks.
    """
    pp = table.pp.astype(np.float64) - 1
    v = table.stages_per_rank.astype(np.float64)
    full = F + B + W
    bub = pp * full / v
    z = table.is_schedule("ZBVZeroBubble")
    bub = np.where(z, pp * np.maximum(F + B - 2 * W, 0.0) / 2, bub)
    d = table.is_schedule("DualPipeV")
    bub = np.where(d, pp * np.maximum(F + 2 * B - W, 0.0) / 2, bub)
    return np.where(table.pp > 1, bub, 0.0)


# the columns the per-micro-batch times of a rank depend on (TP/CP/EP links have strides 1 / tp / tp)
STAGE_COLUMNS = ("tp", "cp", "ep", "microbatch", "pp", "stages_per_rank", "schedule", "ac", "compile", "float8")


def step_time_breakdown(table, model, hw, workload, coeffs) -> dict[str, np.ndarray]:
    n = len(table)
    r = Rates(hw, workload, coeffs)
    links = axis_links(table, hw, coeffs, workload.ep_stride_tp)
    # per-micro-batch stage times: computed once per distinct stage configuration, then broadcast
    rep, inverse = unique_rows(table, STAGE_COLUMNS)
    sub = table.take(rep)
    st = stage_times(sub, model, hw, workload, coeffs, axis_links(sub, hw, coeffs, workload.ep_stride_tp), r)
    st = {k: np.asarray(v)[inverse] for k, v in st.items()}
    nmb = table.n_microbatches.astype(np.float64)
    per_mb_compute = st["F"] + st["B"] + st["W"]
    Fc = st["F"] + st["tp_f"] + st["cp_f"] + st["ep_f"]
    Bc = st["B"] + st["tp_b"] + st["cp_b"] + st["ep_b"]
    # the warm-up and cool-down run through the other stages, which do not hold the LM head and
    # loss (Narayanan et al. 2021, Sec. 2.2.1: the bubble is (p-1) forward and backward passes of
    # a stage); the V schedules put the last stage on rank 0, so there the head stays in
    v_shape = table.is_v_schedule
    body = np.where(v_shape, 0.0, 1.0)
    W = st["W"] - body * st["head_W"]
    # titan-run's split-backward (V) schedules over compiled blocks run each micro-batch's whole backward in its input
    # pass (executor/parallel/pipeline.py: torch's deferred weight pass through compiled blocks gives wrong weight
    # gradients), so no weight work fills the bubble: W counts with B
    whole = (table.is_v_schedule & table.compile) if workload.state_layout == "fsdp2" else np.zeros(n, dtype=bool)
    bubble = bubble_microbatches(table, Fc - body * st["head_F"], Bc - body * st["head_B"] + np.where(whole, W, 0.0),
                                 np.where(whole, 0.0, W))

    facts = layout_facts(table, model, **workload.layout_keys)    # per layout, kept in the table's memo
    dp, opt_bytes = data_parallel(table, model, hw, workload, coeffs, links, r, st, facts=facts)

    # -- pipeline point-to-point: activations of one micro-batch per stage boundary, each way
    ppl = links["pp"]
    sp = table.tp if workload.sequence_parallel else 1
    p2p = p2p_time(table.microbatch * workload.seq_len / table.cp * model.dim * r.elt / sp, ppl.p2p_bw, ppl.p2p_alpha)
    pp_p2p = np.where(table.pp > 1, 2.0 * (nmb * table.stages_per_rank + table.pp - 1) * p2p, 0.0)

    dp = dp + tied_embedding_sync(table, model, workload, ppl)

    # CPU hosts running more processes than cores: the work of each process takes longer
    slow = hw.oversubscription(table.world_size)
    accum = grad_accum_bytes(table, model, workload, facts["rp"])
    other = (slow * (opt_bytes + accum) / r.mem + coeffs.step_overhead_s
             + nmb * coeffs.microbatch_overhead_s)
    return {
        "compute": slow * nmb * per_mb_compute,
        "tp_comm": nmb * (st["tp_f"] + st["tp_b"]),
        "cp_comm": nmb * (st["cp_f"] + st["cp_b"]),
        "ep_comm": nmb * (st["ep_f"] + st["ep_b"]),
        "dp_comm": dp + np.zeros(n),
        "pp_p2p": pp_p2p,
        "pp_bubble": slow * bubble,
        "other": other + np.zeros(n),
    }
