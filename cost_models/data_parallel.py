"""Data parallelism's share of a step: exposed gradient / parameter collectives, the optimizer's
memory traffic and the per-micro-batch gradient accumulation pass, for every candidate.

`data_parallel` covers the fsdp2 layout (FSDP2 / HSDP: per-block all-gathers and
reduce-scatters hidden under the block's compute) and the megatron layout (the distributed
optimizer's once-per-step reduce-scatter and all-gather); `grad_accum_bytes` the traffic of
adding each micro-batch's weight gradients (``workload.grad_accum``).  `cost_models.step_time`
adds them to the step.
"""
from __future__ import annotations

import numpy as np

from .comm import all_reduce_time, group_link, ring_gather_time
from .compute import Rates
from .layout import layer_mix, layers_per_rank, rank_params
from .flops import param_counts as model_param_counts


def layout_facts(table, model, weighted: bool = False, experts_tp_split: bool = True,
                 moe_ffn_tp_split: bool = True) -> dict:
    """The layout facts `data_parallel` needs (rank parameters, blocks and block mix of the busiest rank);
    `weighted`: workload ``pp_split: weighted``; `experts_tp_split`, `moe_ffn_tp_split`: workload ``expert_tp``."""
    return {"rp": rank_params(table, model, weighted, experts_tp_split, moe_ffn_tp_split),
            "nblocks": layers_per_rank(table, model, weighted),
            "mix": layer_mix(table, model, first=False, weighted=weighted)}


def data_parallel(table, model, hw, workload, coeffs, links, r: Rates, st,
                  facts: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(exposed data-parallel communication per step, optimizer-step memory traffic in bytes).

    fsdp2 (Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277, Sec. 3.3-3.4; ZeRO-3 volume,
    Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 7): per block an all-gather of its bf16
    parameters before forward (again before backward when reshard_after_forward) and a
    reduce-scatter of its fp32 gradients after backward; HSDP adds an all-reduce of the
    sharded gradients over dp_replicate.  The next block's all-gather is prefetched under the
    current block's compute: exposed = max(0, comm - dp_overlap * compute) per block, plus the
    first all-gather and the last reduce-scatter.  Without pipelining this repeats every
    micro-batch (gradients are synchronised each one); with pipelining the schedule defers the
    reduce-scatter to the last micro-batch and keeps parameters gathered (torch.distributed.
    pipelining), so one all-gather pass and one reduce-scatter pass per step (plus a backward
    all-gather per micro-batch when reshard_after_forward); with workload ``pp_grad_sync:
    every_microbatch`` (the Llama 3 paper's FSDP) every micro-batch reduce-scatters its gradients,
    under its forward and backward compute in the pipeline's steady state.
    Dense blocks shard over dp_shard*cp, experts over dp_shard*cp/ep.
    megatron: the distributed optimizer (zero >= 1, ZeRO-1) reduce-scatters the main gradients
    (fp32 in Megatron-LM; bf16 with grad_dtype bf16, NeMo / Megatron-Bridge recipes) and
    all-gathers bf16 parameters once per step, overlapped with the last micro-batch's backward
    and the first one's forward (Megatron-LM --overlap-grad-reduce / --overlap-param-gather);
    zero = 0 all-reduces the main gradients, and so does DeepSpeed's BF16 optimizer (``grad_accum: hp_copy``)
    with its optimizer sharded: fp32 gradients all-reduced, bf16 partitions all-gathered after the step; so does
    DeepSpeed's ZeRO-1 (``grad_accum: autograd`` at zero 1): its 16-bit gradients all-reduced whole, then the
    partitions all-gathered.
    Optimizer: AdamW is memory-bound -- per fp32 parameter it reads p, g, m, v and writes p, m, v
    (28 B), plus 8 B for the gradient-norm clip (fsdp2); Megatron adds the bf16 copy.
    """
    facts = facts or layout_facts(table, model, **workload.layout_keys)   # (`facts`: computed once per layout, broadcast)
    if workload.state_layout == "fsdp2":
        win = overlap_windows(table, links, st, facts["nblocks"], links["fsdp"].intra)
        dp, opt = _fsdp2_data_parallel(table, coeffs, links, r, win, facts, workload.pp_defers_grad_sync)
        return dp + _moe_tp_grad_sum(table, model, workload, links, facts), opt
    dp_link = group_link(table.dp_cp.astype(np.float64), table.tp, hw, coeffs)
    win = overlap_windows(table, links, st, facts["nblocks"], dp_link.intra)
    return _megatron_data_parallel(table, model, workload, coeffs, win, facts["rp"], dp_link)


# collectives that run on the compute stream, synchronously, inside a block (step_time's exposed tp_f / tp_b and
# cp_f / cp_b); the EP all-to-alls are left out (they cross the network whenever EP spans nodes, and inside a node
# the expert weights' own data-parallel group is another link again)
WINDOW_AXES = ("tp", "cp")


def overlap_windows(table, links, st, nblocks, dp_intra) -> dict:
    """The windows the data-parallel collectives hide under: a block's forward (``blockF``) and backward
    (``blockBW``), and a micro-batch's forward (``F``) and backward (``B`` + ``W``), each the compute of `st` plus
    the TP and CP collectives the compute stream waits on (`WINDOW_AXES`) where those stay inside a node and the
    data-parallel group crosses nodes (`dp_intra`: the DP group inside one node or not).  The DP collectives run on
    their own stream (FSDP2's all-gather and reduce-scatter streams; Megatron's overlapped buckets), so while a
    block waits on its tensor-parallel all-gather over NVLink the reduce-scatter of another block's gradients keeps
    the network busy: that time hides DP traffic as compute does.  Where both can share a link (DP inside the node, or
    TP across nodes) the wait is not counted.  No coefficient: the windows are the model's own exposed times."""
    nb = np.maximum(np.asarray(nblocks, dtype=np.float64), 1.0)
    xf = xb = 0.0
    for ax in WINDOW_AXES:
        other = links[ax].intra & ~np.asarray(dp_intra, dtype=bool) & (getattr(table, ax) > 1)
        xf = xf + np.where(other, st[f"{ax}_f"], 0.0)
        xb = xb + np.where(other, st[f"{ax}_b"], 0.0)
    out = dict(st)
    out.update(blockF=st["blockF"] + xf / nb, blockBW=st["blockBW"] + xb / nb, F=st["F"] + xf, B=st["B"] + xb)
    return out


# titan-run sums the MoE gradients over TP in buckets of at most this many bytes (executor/moe_step.py
# ``sum_moe_grads_over_tp``): one all-reduce per bucket, and one bucket's flat copy as its temporary
# (cost_models.memory), instead of a flat copy of all MoE gradients at the end of backward.
MOE_TP_BUCKET_BYTES = 64 * 2**20


def moe_tp_grad_bytes(table, model, rp, nm) -> np.ndarray:
    """[n] fp32 bytes of the MoE gradient shards a rank with `nm` MoE blocks sums over TP after backward (titan-run,
    ``moe_ffn_tp_split`` False): the router and shared experts FSDP-sharded, the routed experts over FSDP / EP."""
    fsdp_n = table.fsdp_size.astype(np.float64)
    return 4.0 * nm * (rp["moe_ffn_block"] / fsdp_n + rp["moe_expert_block"] / (fsdp_n / table.ep))


def _moe_tp_grad_sum(table, model, workload, links, facts: dict) -> np.ndarray:
    """titan-run's MoE layers run whole on each TP rank's own sequence-parallel tokens (``moe_ffn_tp_split``
    False), so after backward each rank holds gradients of different tokens: all-reduces over TP of the MoE
    gradient shards per step, one per bucket of `MOE_TP_BUCKET_BYTES` (executor/moe_step.py
    ``sum_moe_grads_over_tp``; the spmd_types backend reduces the same pending sums), fp32, on the busiest rank's
    MoE blocks, exposed."""
    if not model.is_moe or workload.moe_ffn_tp_split:
        return np.zeros(len(table))
    total = moe_tp_grad_bytes(table, model, facts["rp"], facts["mix"][1])
    buckets = np.maximum(1.0, np.ceil(total / MOE_TP_BUCKET_BYTES))
    tl = links["tp"]
    per = all_reduce_time(table.tp, total / buckets, tl.bw, tl.alpha, tl.tree_latency)
    return np.where(table.tp > 1, buckets * per, 0.0)


def _fsdp2_data_parallel(table, coeffs, links, r: Rates, st, facts: dict,
                         defer_grad_sync: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """`data_parallel` for the fsdp2 layout (FSDP2 / HSDP, per-block collectives); `defer_grad_sync`:
    workload ``pp_grad_sync`` is ``last_microbatch`` (else every pipeline micro-batch reduce-scatters)."""
    rp = facts["rp"]
    nmb = table.n_microbatches.astype(np.float64)
    nblocks = np.asarray(facts["nblocks"]).astype(np.float64)
    ov = coeffs.dp_overlap
    fs, efs, rep = links["fsdp"], links["efsdp"], links["dp_replicate"]
    fsdp_n = table.fsdp_size.astype(np.float64)
    efsdp_n = fsdp_n / table.ep
    nd, nm = facts["mix"]
    nb = np.maximum(nd + nm, 1)
    dense_blk = (nd * rp["dense_block"] + nm * rp["moe_dense_block"]) / nb     # average block
    exp_blk = nm * rp["moe_expert_block"] / nb

    def block_collective(nbytes):   # all-gather or reduce-scatter of one block, dense and expert groups
        # (the expert group's collective exists only where there are expert weights: a dense
        # model must not pay its (p-1) latency steps)
        return (ring_gather_time(fsdp_n, dense_blk * nbytes, fs.bw, fs.alpha)
                + np.where(exp_blk > 0, ring_gather_time(efsdp_n, exp_blk * nbytes, efs.bw, efs.alpha), 0.0))
    ag, rs = block_collective(r.elt), block_collective(4.0)   # bf16 parameters, fp32 gradients
    ar = all_reduce_time(table.dp_replicate, 4.0 * (dense_blk / fsdp_n + exp_blk / efsdp_n), rep.bw, rep.alpha,
                         rep.tree_latency)
    # the root unit (executor/parallel/fsdp.py: fully_shard(model) after the blocks): what this rank
    # holds outside its blocks -- embedding and/or LM head and final norm (the last rank's blocks, which
    # can be fewer than the busiest rank's)
    nd_last, nm_last = rp["last_layers"]
    root = rp["last_dense"] - nd_last * rp["dense_block"] - nm_last * rp["moe_dense_block"]
    ag_h = ring_gather_time(fsdp_n, root * r.elt, fs.bw, fs.alpha)
    rs_h = ring_gather_time(fsdp_n, root * 4.0, fs.bw, fs.alpha)
    # the V schedules run with resharding off: the executor keeps their parameters gathered
    # (torch's ZBV/DualPipeV + FSDP reshard gives wrong grads; executor/parallel/pipeline.py)
    v_sched = (table.pp > 1) & (table.is_schedule("ZBVZeroBubble") | table.is_schedule("DualPipeV"))
    rsf = (table.reshard_after_forward & ~v_sched).astype(np.float64)
    # Per block, in its compute window (Zhao et al. 2023, Sec. 3.4, Fig. 6: forward all-gather of
    # the next block, backward all-gather of the previous block and reduce-scatter of this one's
    # gradients).  Collectives of one window share the same links (FSDP2 issues them on separate
    # streams, NCCL runs them concurrently over the same NICs), so what a window cannot hide is
    # the SUM of its collectives less the window's compute -- not each one against it alone.
    # Deeper prefetching does not change the steady state: the link stays serial, so a block whose
    # collectives outlast its compute exposes the difference however early they are issued.
    # The root is gathered first, before any compute it could hide under (its forward pre-hook runs
    # before the embedding; PyTorch FSDP notes, "FSDP Prefetch Nuances": "the 1st all-gather will
    # not be able to overlap with anything"), and reduce-scattered last, after the whole backward:
    # both exposed, as are the first block's all-gather and the last reduce-scatter of the blocks.
    fwd_pass = ag_h + ag + nblocks * np.maximum(0.0, ag - ov * st["blockF"])
    # without a pipeline the last block keeps its parameters after forward (backward starts with it; executor
    # fsdp.py keep_last): one backward all-gather fewer
    kept = rsf * (table.pp == 1)
    rs_pass = (rs_h + rs + (nblocks - kept) * np.maximum(0.0, rs + ar + rsf * ag - ov * st["blockBW"])  # with its RS
               + kept * np.maximum(0.0, rs + ar - ov * st["blockBW"]))
    ag_b_pass = nblocks * np.maximum(0.0, ag - ov * st["blockBW"])   # a backward without one (pp > 1)
    piped = fwd_pass + rs_pass + rsf * np.maximum(nmb - 1, 0) * ag_b_pass
    # pp_grad_sync every_microbatch: every micro-batch reduce-scatters its gradients (blocks and root), and with
    # reshard_after_forward also gathers its blocks in forward and in backward; without it the parameters stay
    # gathered for the step (as `memory` charges them: one forward pass of gathers).  In the pipeline's steady
    # state a rank alternates forwards and backwards, so a micro-batch's collectives share the link under its
    # forward and backward compute together; the first gathers stay exposed, and the last micro-batch's
    # backward (the cool-down runs backwards only) is the deferred schedule's reduce-scatter pass.
    per_mb = nblocks * (rs + ar + 2.0 * rsf * ag) + rs_h + 2.0 * rsf * ag_h
    steady = np.maximum(0.0, per_mb - ov * nblocks * (st["blockF"] + st["blockBW"]))
    every = fwd_pass + rs_pass + np.maximum(nmb - 1, 0) * steady
    dp = np.where(table.pp == 1, nmb * (fwd_pass + rs_pass), piped if defer_grad_sync else every)
    dp = np.where(fsdp_n * table.dp_replicate > 1, dp, 0.0)
    opt_bytes = 36.0 * (rp["last_dense"] / fsdp_n + rp["last_expert"] / efsdp_n)
    return dp, opt_bytes


def grad_accum_bytes(table, model, workload, rp) -> np.ndarray:
    """Memory traffic per step (bytes) of adding each micro-batch's weight gradients to the step's
    (``workload.grad_accum``), on the worst rank's parameters:

    * autograd: ``grad += g`` on every micro-batch after the first reads both and writes one, in
      the gradients' dtype -- on the unsharded gradients when pipelining defers the gradient sync
      (fsdp2, pp > 1, ``pp_grad_sync: last_microbatch``), else on this rank's shard after each
      micro-batch's reduce-scatter (fsdp2) or on the whole local gradients (megatron);
    * fused: the weight-gradient GEMM accumulates into the main gradients (beta = 1): nothing;
    * hp_copy: DeepSpeed's BF16 optimizer after every micro-batch (``update_hp_grads``,
      deepspeed/runtime/bf16_optimizer.py, called by the pipeline engine's backward pass): the
      bf16 gradient is read, cast into an fp32 temporary (written, read) and added to the fp32
      copy (read, written): 2 + 4 + 4 + 4 + 4 = 18 B per parameter.
    """
    nmb = table.n_microbatches.astype(np.float64)
    dense_p, expert_p = rp["last_dense"], rp["last_expert"]
    local = dense_p + expert_p
    mode = workload.grad_accum_mode
    if mode == "fused":
        return np.zeros(len(table))
    if mode == "hp_copy":
        return 18.0 * local * nmb
    g = workload.grad_elem_bytes
    if workload.state_layout == "fsdp2":
        shard = dense_p / table.fsdp_size + expert_p / table.expert_fsdp_size
        held = np.where((table.pp > 1) & workload.pp_defers_grad_sync, local, shard)
    else:
        held = local
    return 3.0 * g * held * np.maximum(nmb - 1.0, 0.0)


# Megatron-LM's default gradient bucket: max(40M, 1M x dp) parameters
# (megatron/core/distributed/distributed_data_parallel.py, DistributedDataParallel.__init__:
# ``bucket_size = max(40000000, 1000000 * dp_group.size())``, "larger DP sizes need larger buckets to
# ensure collectives do not become latency-bound", DistributedDataParallelConfig.bucket_size)
MEGATRON_MIN_BUCKET = 40e6
MEGATRON_BUCKET_PER_DP_RANK = 1e6


def megatron_bucket_params(dp) -> np.ndarray:
    """Megatron-LM's default DDP bucket size (parameters) for a data-parallel group of `dp` ranks."""
    return np.maximum(MEGATRON_MIN_BUCKET, MEGATRON_BUCKET_PER_DP_RANK * np.asarray(dp, dtype=np.float64))


def megatron_last_bucket(bucket, head, block, n_blocks, emb) -> np.ndarray:
    """Parameters in the last gradient bucket of a Megatron DDP buffer: the one whose reduce-scatter
    starts only when the backward is over, and whose parameters the next forward all-gathers first.

    Megatron walks the parameters in reverse (backprop) order -- LM head and final norm (`head`, on
    the stage that holds them), the `n_blocks` blocks from the last, the embedding (`emb`) -- and closes
    a bucket as soon as it holds >= `bucket` parameters
    (param_and_grad_buffer.py, ``_compute_default_per_buffer_param_layout``); the remainder, which
    ends with the embedding, is the last bucket.  Walked at block granularity (a block's tensors are
    not split here): the first bucket closes after the head and j1 = ceil((bucket - head) / block)
    blocks (none if the head alone fills it), each later one after m = ceil(bucket / block) blocks, so
    the last holds the (n - j1) mod m leftover blocks and the embedding -- or everything when the
    first bucket never closes before the embedding.
    """
    bucket, head, block = (np.asarray(x, dtype=np.float64) for x in (bucket, head, block))
    n = np.asarray(n_blocks, dtype=np.float64)
    blk = np.maximum(block, 1.0)
    j1 = np.where(head >= bucket, 0.0, np.ceil(np.maximum(bucket - head, 0.0) / blk))
    m = np.maximum(np.ceil(bucket / blk), 1.0)
    rest = np.mod(np.maximum(n - j1, 0.0), m) * block + emb
    total = head + n * block + emb
    return np.where(j1 > n, total, np.minimum(rest, total))


def _megatron_tail_params(table, model, rp) -> np.ndarray:
    """The last gradient bucket (parameters, dense buffer) of pipeline rank 0, whose model chunk 0 holds
    the embedding and is the last to finish its backward: Megatron buckets only that chunk (ranks
    pp > 0 and interleaved chunks after the first get one bucket, their sync "not on the critical
    path": DistributedDataParallel.__init__, ``disable_bucketing or pp_rank > 0``; training.py,
    ``disable_bucketing=(model_chunk_idx > 0)``).  The head sits on chunk 0 only without pipelining."""
    emb = np.asarray(rp["first_has_emb"], dtype=np.float64) * (model_param_counts(model)["embedding"]
                                                                 / table.tp)
    nd, nm = rp["first_layers"]
    nb = np.maximum(nd + nm, 1)
    block = (nd * rp["dense_block"] + nm * rp["moe_dense_block"]) / nb
    chunk0 = np.ceil((nd + nm) / table.stages_per_rank)          # stage 0 is the largest stage
    head = np.where(table.pp * table.stages_per_rank == 1, rp["first_dense"] - (nd * rp["dense_block"]
                    + nm * rp["moe_dense_block"]) - emb, 0.0)
    dp = table.dp_replicate * table.dp_shard
    return megatron_last_bucket(megatron_bucket_params(dp), np.maximum(head, 0.0), block, chunk0, emb)


def _megatron_data_parallel(table, model, workload, coeffs, st, rp, link) -> tuple[np.ndarray, np.ndarray]:
    """`data_parallel` for the Megatron layout (distributed optimizer, or an all-reduce at zero 0).

    Overlapped (dp_overlap > 0: --overlap-grad-reduce / --overlap-param-gather), the buckets' collectives
    run under the last micro-batch's backward and the first one's forward, but not the last bucket's
    reduce-scatter, issued when the backward is over, nor its all-gather, which the first forward
    pre-hook waits for (finish_param_sync dispatches the next bucket's only then): each exposes at
    least that one bucket (`megatron_last_bucket`)."""
    ov = coeffs.dp_overlap
    dpn = table.dp_cp.astype(np.float64)
    local = rp["last_dense"] + rp["last_expert"]
    g = workload.grad_elem_bytes                  # fp32 main gradients, or bf16 (grad_dtype)
    tail = np.minimum(_megatron_tail_params(table, model, rp), local)
    # zero >= 1 reduce-scatters the main gradients and all-gathers the bf16 parameters; zero 0 all-reduces.
    # DeepSpeed's BF16 optimizer under the pipeline engine shards the optimizer (ZeRO-1) but all-reduces the
    # whole fp32 gradients (pipe/engine.py ``_bf16_reduce_grads``: ``buffered_allreduce_fallback`` of the
    # optimizer's fp32 gradients), then all-gathers its bf16 parameter partitions after the step
    hp_all_reduce = workload.zero >= 1 and workload.grad_accum_mode == "hp_copy"
    if hp_all_reduce:
        g = 4.0
    # DeepSpeed's ZeRO-1 (16-bit gradients accumulated by autograd in .grad: grad_accum autograd) all-reduces the
    # whole gradients too: stage 1 turns contiguous_gradients off, so reduce_ipg_grads takes
    # buffered_reduce_fallback, whose allreduce_bucket sets ``rank = None`` and calls dist.all_reduce (DeepSpeed
    # stage2.py at 2151c787a, BLOOM's; the same in stage_1_and_2.py since), then all-gathers the updated partitions
    ds_all_reduce = workload.zero == 1 and workload.grad_accum_mode == "autograd"

    def reduce(n):
        if workload.zero >= 1 and not (hp_all_reduce or ds_all_reduce):
            return ring_gather_time(dpn, g * n, link.bw, link.alpha)
        return all_reduce_time(dpn, g * n, link.bw, link.alpha, link.tree_latency)

    def gather(n):
        return ring_gather_time(dpn, 2.0 * n, link.bw, link.alpha) if workload.zero >= 1 else 0.0

    red, gath, red_tail, gath_tail = reduce(local), gather(local), reduce(tail), gather(tail)
    dp = (np.maximum(red - ov * (st["B"] + st["W"]), red_tail)
          + np.maximum(gath - ov * st["F"], gath_tail))
    # the optimizer step's traffic per parameter of the shard: 30 bytes with an fp32 master copy and fp32 moments
    # (each read and written), less what bf16 copies save (master_dtype, moment_dtype)
    per = 30.0 - 2.0 * (4.0 - workload.master_elem_bytes) * (workload.dtype != "fp32") \
        - 4.0 * (4.0 - workload.moment_elem_bytes)
    opt_bytes = per * (local / dpn if workload.zero >= 1 else local) + 2.0 * local
    return dp, opt_bytes
