"""Per-rank memory, as a breakdown, for every candidate of a `CandidateTable`.

Keys (bytes, worst rank): params, grads, optimizer, activations, logits, fsdp_buffers,
overhead.  The worst rank is the heaviest of the first pipeline rank (embedding, the most
in-flight micro-batches), the last (LM head and logits; under the V schedules rank 0 holds
both ends) and the busiest (most MoE blocks, then most blocks): `cost_models.layout`.
"""
from __future__ import annotations

import numpy as np

from search_spaces.plan import BACKENDS

from .activations import (embedding_activation_bytes, head_activation_bytes, per_layer_activation_bytes,
                          pipeline_extra_bytes)
from .data_parallel import MOE_TP_BUCKET_BYTES, moe_tp_grad_bytes
from .layout import (RANKS, expert_shard_fraction, in_flight_microbatches, in_flight_on_rank,  # noqa: F401
                     rank_in_flight, rank_index, rank_params)

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "logits", "fsdp_buffers", "overhead")

# fp32 cross-entropy on [tokens, vocab/tp] logits: the fp32 log-softmax output kept for
# backward, its gradient and the input gradient live together at the start of backward
# (torch.nn.functional.cross_entropy on .float() logits, as TorchTitan and Megatron's
# vocab-parallel loss do): 3 x 4 bytes per logit.
LOGIT_BYTES = 12.0

# DeepSpeed's ZeRO reduce_bucket_size default, in elements (deepspeed/runtime/zero/constants.py
# ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT, v0.5-0.6): the gradients ZeRO-1/2 reduce at once
# (`deepspeed_step_segments`)
DEEPSPEED_REDUCE_BUCKET = 5e8




def logit_bytes(table, workload) -> tuple[np.ndarray, np.ndarray]:
    """(bytes per logit kept from the loss stage's forward to its backward, bytes per logit added at
    the turn).  Eager (``loss_impl: eager``): the fp32 log-softmax output is kept (plus, with pp > 1,
    the stage's e-byte output the pipeline keeps for the stage backward), and its gradient and the
    input gradient join it at the turn (LOGIT_BYTES in all).  Fused (``loss_impl: fused``; e.g.
    flash-attn's cross_entropy, Megatron's in-place vocab-parallel loss): the kernel keeps only its
    e-byte input (the same tensor as the stage output) and a per-token log-sum-exp, and writes one
    e-byte gradient at the turn.  ``auto`` under the fsdp2 layout is this executor's: at tp 1 its loss compiled
    with compile on (Inductor fuses upcast, log-softmax and NLL) or its fused Function (both fused,
    `loss_fused`), eager on vocab-sharded logits (tp > 1)."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    fused = loss_fused(table, workload)
    eager_kept = 4.0 + np.where(table.pp > 1, e, 0.0)
    return np.where(fused, e, eager_kept), np.where(fused, e, LOGIT_BYTES - 4.0)


def loss_compiled(table, workload) -> np.ndarray:
    """[n] bool: the candidate's loss is compiled by Inductor with its model (``loss_impl: auto`` under the fsdp2
    layout, compile on, tp 1: titan-run, executor/parallel/tensor_parallel.py ``loss_compiled``, and TorchTitan
    since 2025-04).  Upcast, log-softmax and NLL fuse into row reductions: forward reads the logits for the
    row maximum and the sum of exponentials, backward reads them once more and writes their gradient."""
    if not workload.compiles_loss(True, 1):        # the workload's part of the one rule: layout and loss_impl
        return np.zeros(len(table), dtype=bool)
    return np.asarray(table.compile, dtype=bool) & (np.asarray(table.tp) == 1)   # the candidate's: compile, tp 1


def loss_fused(table, workload) -> np.ndarray:
    """[n] bool: the candidate's loss keeps the logits, not an fp32 copy (``Workload.loss_fused_at`` per
    candidate): ``loss_impl`` fused, or ``auto`` under the megatron layout, or compiled (`loss_compiled`), or
    ``auto`` under fsdp2 at tp 1 (titan-run's fused Function, executor/parallel/fused_loss.py)."""
    titan_fused = workload.state_layout == "fsdp2" and workload.loss_impl == "auto"
    return (loss_compiled(table, workload) | (workload.loss_mode == "fused")
            | (titan_fused & (np.asarray(table.tp) == 1)))


# --------------------------------------------------------------------------- the breakdown
def nccl_communicators(table) -> np.ndarray:
    """NCCL communicators a rank initializes: one per process group of more than one rank that runs a
    collective (executor/mesh.py: the mesh axes, the FSDP group dp_shard x cp, the expert groups, the
    dp x cp group of the loss and gradient norm) and the default (world) group when it is none of them."""
    one = np.ones(len(table), dtype=np.int64)
    fsdp, ep = table.fsdp_size, table.ep
    groups = [table.pp > 1, table.tp > 1, table.cp > 1, fsdp > 1, table.dp_replicate > 1,
              (table.dp_replicate > 1) & (fsdp > 1),                  # dp_cp (HSDP): loss / grad-norm reductions
              (ep > 1) & (ep != fsdp),                               # the EP all-to-all group
              (ep > 1) & (fsdp // ep > 1)]                           # expert FSDP (efsdp)
    axes = sum(((table.pp > 1), (table.tp > 1), (table.cp > 1), (fsdp > 1), (table.dp_replicate > 1))).astype(np.int64)
    return sum(g.astype(np.int64) for g in groups) + np.where(axes > 1, one, 0)


def nccl_buffer_bytes(table, hw) -> np.ndarray:
    """Bytes of NCCL buffers per rank: ``hw.nccl_buffer_gib`` per communicator (none on CPU, gloo).
    They are allocated outside PyTorch's caching allocator, so torch.cuda.max_memory_reserved (the peak
    TorchTitan and Megatron report) does not include them; the device must hold them."""
    if hw.device == "cpu":
        return np.zeros(len(table))
    return hw.nccl_buffer_gib * 2.0 ** 30 * nccl_communicators(table)


def memory_breakdown(table, model, workload, coeffs, *, caching_allocator: bool = True,
                     hw=None) -> dict[str, np.ndarray]:
    """Per-rank bytes by category for the worst pipeline rank (`memory_by_rank`'s heaviest)."""
    by_rank = memory_by_rank(table, model, workload, coeffs, caching_allocator=caching_allocator, hw=hw)
    totals = np.array([sum(by_rank[w].values()) for w in RANKS])
    worst = np.argmax(totals, axis=0)                # ties: the first of RANKS
    first, last, busiest = (by_rank[w] for w in RANKS)
    is_first, is_last = worst == 0, worst == 1
    return {k: np.where(is_first, first[k], np.where(is_last, last[k], busiest[k])) for k in MEMORY_KEYS}


def memory_by_rank(table, model, workload, coeffs, *, caching_allocator: bool = True,
                   hw=None) -> dict[str, dict[str, np.ndarray]]:
    """{'first'|'last'|'busiest': per-rank bytes by category} (`cost_models.layout` names the ranks).

    `hw` (a HardwareSpec) gives the GPU-side terms: its caching allocator's fragmentation
    (``allocator_fragmentation``, reserved/allocated - 1) on the activations, logits and FSDP
    buffers, and ``nccl_buffer_gib`` per NCCL communicator the rank holds (`nccl_communicators`),
    both in ``overhead``; without `hw`, ``coeffs.allocator_fragmentation`` when `caching_allocator`.
    CPU tensors are freed to the system allocator at once, so CPU plans have no fragmentation.
    """
    n = len(table)
    caching_allocator, frag, nccl = _allocator_terms(table, coeffs, caching_allocator, hw)
    shared = _shared_activation_terms(table, model, workload, coeffs)
    rp = rank_params(table, model, **workload.layout_keys)
    results = {}
    for which in RANKS:
        if workload.state_layout == "fsdp2":
            params, grads, optimizer, fsdp, fsdp_at_turn, end_rs = _fsdp2_state_bytes(
                table, model, workload, rp, which, shared["dense_act"], caching_allocator)
        else:
            params, grads, optimizer, fsdp, fsdp_at_turn, end_rs = _megatron_state_bytes(table, workload, rp, which,
                                                                                         caching_allocator)
        acts, logits, freed = _activation_bytes(table, model, rp, which, shared, coeffs, caching_allocator,
                                                fsdp, fsdp_at_turn, workload.pp_weighted)
        fsdp = fsdp + np.maximum(0.0, end_rs - freed)     # the deferred reduce-scatters' excess over what is freed
        if workload.state_layout == "fsdp2" and model.is_moe and not workload.moe_ffn_tp_split:
            # titan-run's sum of the MoE gradients over TP after backward, when the activations are gone: one
            # bucket's flat copy at a time (data_parallel.MOE_TP_BUCKET_BYTES); only its excess over the turn's
            # activations and buffers can raise the peak
            bucket = np.minimum(moe_tp_grad_bytes(table, model, rp, rp[f"{which}_layers"][1]), MOE_TP_BUCKET_BYTES)
            fsdp = fsdp + np.where(table.tp > 1, np.maximum(0.0, bucket - (acts + logits + fsdp)), 0.0)
        overhead = coeffs.memory_overhead_bytes + frag * (acts + logits + fsdp) + nccl
        # With one backward pass over the step's activations (pp == 1 with one micro-batch, or
        # GPipe: all forwards first) the activation peak comes at the forward/backward turn, before
        # any gradient exists; gradients and the activations then never coexist in full (measured:
        # the baseline plus the activations reproduce those peaks, no gradient bytes live at them),
        # so the peak is the larger of the two phases over the shared parameters and optimizer state.
        # (CPU only: the caching allocator's reserved memory keeps the activation phase's segments,
        # so on GPU the gradients add to it, as the TorchTitan references in bench/validate_reference.py show.)
        one_pass = ((table.pp == 1) & (table.n_microbatches == 1)) | ((table.pp > 1) & table.is_schedule("GPipe"))
        one_pass = one_pass & (not caching_allocator)
        grads = np.where(one_pass, np.maximum(0.0, grads - (acts + logits + fsdp)), grads)
        results[which] = dict(params=params, grads=grads, optimizer=optimizer, activations=acts, logits=logits,
                              fsdp_buffers=fsdp, overhead=overhead + np.zeros(n))
    return results


def _allocator_terms(table, coeffs, caching_allocator: bool, hw) -> tuple[bool, float, np.ndarray]:
    """(caching allocator?, its fragmentation, NCCL buffer bytes per rank): see `memory_by_rank`."""
    if hw is not None:
        return hw.device != "cpu", hw.allocator_fragmentation, nccl_buffer_bytes(table, hw)
    return caching_allocator, (coeffs.allocator_fragmentation if caching_allocator else 0.0), np.zeros(len(table))


def _shared_activation_terms(table, model, workload, coeffs) -> dict:
    """The activation and logit terms every pipeline rank shares (before its in-flight count)."""
    dense_act, ws_dense = per_layer_activation_bytes(table, model, workload, coeffs, moe=False)
    moe_act, ws_moe = (per_layer_activation_bytes(table, model, workload, coeffs, moe=True)
                       if model.is_moe else (0.0, 0.0))
    tokens = table.microbatch * workload.seq_len / table.cp
    # On the loss stage with pp > 1 the pipeline keeps every in-flight micro-batch's stage output
    # (the logits, e bytes each) for the stage backward, and the loss its fp32 log-softmax output;
    # one micro-batch's logit gradients (8 bytes) join them at the turn.  GPipe keeps all
    # n_microbatches (measured: 16 x (logits + log-softmax) on the last stage, the first stage
    # lower by that); the other schedules run the loss stage's backward right after its forward.
    head_infl = np.where((table.pp > 1) & table.is_schedule("GPipe"), table.n_microbatches, 1.0)
    logit_kept, logit_turn = logit_bytes(table, workload)
    # multi-token prediction (ModelSpec.mtp_layers): each module's hidden states go through the shared head with
    # the main model's (Megatron-core concatenates them before the output layer), so the head rank's logits
    # and head tensors are (1 + mtp_layers) times one micro-batch's
    heads = 1.0 + model.mtp_layers
    head_act = heads * head_activation_bytes(table, model, workload, table.compile)
    v = table.stages_per_rank.astype(np.float64)
    return dict(e=4.0 if workload.dtype == "fp32" else 2.0, tokens=tokens, dense_act=dense_act, moe_act=moe_act, working_set=np.maximum(ws_dense, ws_moe),
                head_infl=head_infl, head_extra=(head_infl - 1) * head_act,
                logits_head=heads * tokens * model.vocab_size / table.tp * (head_infl * logit_kept + logit_turn),
                head_act=head_act,
                # rank-independent facts `_activation_bytes` reads for each rank
                emb_grad_full=dtensor_embedding_grad_full(table), other_chunks=(v - 1.0) / v,
                v_shape=table.is_schedule("ZBVZeroBubble") | table.is_schedule("DualPipeV"),
                one_stage=table.stages_per_rank == 1,
                logits_turn=heads * tokens * model.vocab_size / table.tp * (logit_kept + logit_turn),
                pipe=pipeline_extra_bytes(table, model, workload),
                emb_act=embedding_activation_bytes(table, model, workload))


def dtensor_embedding_grad_full(table) -> np.ndarray:
    """Whether the embedding's weight gradient is computed at the full vocabulary although the weight is
    vocab-sharded: dtensor TP with the embedding sharded (executor/parallel/parallelize.py
    tp_shards_embedding: not under compile), see `_fsdp2_state_bytes`."""
    return (table.tp > 1) & (table.backend == BACKENDS.index("dtensor")) & ~table.compile.astype(bool)


def _regathered_unit(rp, which: str, caching_allocator: bool) -> np.ndarray:
    """Parameters of the FSDP unit a pipelined backward re-gathers at its peak (`_fsdp2_state_bytes`): the largest
    block in allocated bytes, the largest unit (the embedding or head where larger) on a caching allocator."""
    return rp[f"{which}_unit"] if caching_allocator else rp[f"{which}_block_unit"]


def _fsdp2_state_bytes(table, model, workload, rp, which: str, dense_act,
                       caching_allocator: bool = True) -> tuple[np.ndarray, ...]:
    """(params, grads, optimizer, fsdp buffers, fsdp buffers at the loss turn, the deferred reduce-scatters'
    buffers) of rank `which` under the fsdp2 layout: fp32 master parameters, gradients and AdamW moments, all
    sharded.  Without a caching allocator (CPU: allocated bytes) the phases that follow the blocks' backward --
    the embedding's re-gather, a deferred sync's reduce-scatters -- reuse what that backward freed; on GPU the
    reserved segments of both phases add up (the TorchTitan 405B PP rows' measured peaks need them)."""
    # the executor applies FSDP when some rank shares the data-parallel work, or on one rank for
    # bf16 mixed precision (executor/parallel/__init__.py: uses_fsdp)
    fsdp_applied = (table.dp_cp > 1) | (workload.dtype != "fp32")
    e = 4.0 if workload.dtype == "fp32" else 2.0
    fsdp_group = table.fsdp_size.astype(np.float64)
    # pipelining defers the gradient sync to the last micro-batch (workload pp_grad_sync: last_microbatch,
    # torch.distributed.pipelining); every_microbatch reduce-scatters each one into the shard, as pp == 1 does
    accumulate_unsharded = (table.pp > 1) & (table.n_microbatches > 1) & workload.pp_defers_grad_sync
    dense_p, expert_p, unit = rp[f"{which}_dense"], rp[f"{which}_expert"], rp[f"{which}_unit"]
    local = dense_p + expert_p
    shard_p = dense_p / fsdp_group + expert_p * expert_shard_fraction(table, model)
    params = 4.0 * shard_p                                 # fp32 master copy, sharded
    grads = np.where(accumulate_unsharded, 4.0 * local, 4.0 * shard_p)
    optimizer = 2.0 * workload.moment_elem_bytes * shard_p   # AdamW exp_avg, exp_avg_sq (moment_dtype)
    rs = unit * (e + 4.0)                                  # unsharded grad + fp32 reduce buffer
    # parameters stay gathered for the whole step when FSDP does not reshard after forward, when
    # pipelining defers gradient sync, and under the V schedules, where the executor turns
    # resharding off (torch's ZBV/DualPipeV + FSDP reshard gives wrong grads; pipeline.py)
    v_sched = (table.pp > 1) & (table.is_schedule("ZBVZeroBubble") | table.is_schedule("DualPipeV"))
    keep = accumulate_unsharded | ~table.reshard_after_forward | v_sched
    gathered = np.where(keep, e * local, 2.0 * e * unit)
    # Pipelined FSDP (1F1B, GPipe, Interleaved1F1B): the schedule reshards between micro-
    # batches and re-gathers each block in every backward, with the next block prefetched;
    # each gather holds its flat all-gather output next to the unsharded copy-out
    # (measured, fsdp2 x pp2 1F1B on gloo: 4 x 3 MiB of a 3 MiB block at the peak).
    # In allocated bytes the blocks are re-gathered during the blocks' backward, the embedding's unit only after
    # it, when that micro-batch's activations are freed (dry run, llama3-8b widths, pp 2 x fsdp 2, 2 blocks a
    # stage: the stage's blocks gathered at the peak, not the embedding; docs/memory_audit.md, "FSDP2 with the
    # pipeline's deferred gradient sync and few blocks per stage"); on GPU the largest unit's, as before.
    regather = accumulate_unsharded & ~v_sched & table.reshard_after_forward & (fsdp_group > 1)
    gathered = np.where(regather, np.maximum(gathered, 4.0 * e * _regathered_unit(rp, which, caching_allocator)),
                        gathered)
    # The reduce-scatter buffers of a block exist in backward while that block's saved
    # activations are being freed, so only their excess over one layer's activations
    # raises the peak (which sits at the forward/backward turn).  A deferred sync reduce-scatters
    # after the last micro-batch's backward: in allocated bytes `end_rs`, which `memory_by_rank`
    # counts only beyond what that backward freed.
    deferred = accumulate_unsharded & (not caching_allocator)
    rs_exposed = np.where(deferred, 0.0, np.maximum(0.0, rs - dense_act))
    end_rs = np.where(fsdp_applied & deferred, rs, 0.0)
    fsdp = np.where(fsdp_applied, gathered + rs_exposed, 0.0)
    # ... but at the loss turn of each micro-batch the blocks are resharded again (reshard after
    # forward; the schedule turns off only the reshard after backward): the root's head and one
    # unit are gathered then, not the stage (dry run, llama3-8b pp 2 fsdp 4, loss rank's peak:
    # 0.98 GiB unsharded = the LM head, of 7.5 GiB kept gathered in backward)
    fsdp_at_turn = np.where(fsdp_applied & regather, 2.0 * e * unit, fsdp)
    # DTensor TP's vocab-sharded embedding (RowwiseParallel, Shard(0)) gets a *replicated* weight gradient:
    # torch 2.14 has no Shard(0) strategy for aten.embedding_dense_backward (torch/distributed/tensor/_ops/
    # _embedding_ops.py: colwise, batch-partial and partial only), and FSDP2 redistributes a gradient to the
    # parameter's placements only when it reduces it (_fsdp_param.py _get_grad_inner_tensor).  When the
    # pipeline defers the sync, the fp32 accumulated gradient is the full [vocab, dim] until REDUCE_GRAD,
    # (tp - 1) / tp of it beyond the local shard `grads` counts (dry run, llama3-70b TP 8 x PP 4, rank 0:
    # one [128256, 8192] fp32 gradient, 3.91 GiB, where the shard is 0.49 GiB).
    extra = np.where(accumulate_unsharded & fsdp_applied & rp[f"{which}_has_emb"] & dtensor_embedding_grad_full(table),
                     4.0 * model.vocab_size * model.dim * (1.0 - 1.0 / table.tp), 0.0)
    return params, grads, optimizer, fsdp + extra, fsdp_at_turn + extra, end_rs


def _megatron_state_bytes(table, workload, rp, which: str, caching_allocator: bool = False) -> tuple[np.ndarray, ...]:
    """As `_fsdp2_state_bytes` for the Megatron layout: bf16 params, main grads in ``grad_dtype``
    (fp32: Megatron-LM; bf16: NeMo / Megatron-Bridge recipes), AdamW moments in ``moment_dtype``, ZeRO stages.

    ``grad_accum: hp_copy`` (DeepSpeed's BF16 optimizer) keeps two gradients per parameter, neither sharded: the
    fp32 accumulator (``fp32_groups_gradients_flat``, a zeros_like of the flat bf16 parameters) and the e-byte
    ``.grad`` autograd writes, which the pipeline engine leaves allocated (``update_hp_grads(clear_lp_grads=
    False)`` after each backward: deepspeed/runtime/pipe/engine.py ``_exec_backward_pass`` and bf16_optimizer.py,
    olruwase/bf16-updates ab61edb0 of 2022-03-09, the commit BLOOM's chronicles name, merged as #1801); the
    chronicles: "The additional memory usage is 4bytes x params and it's not sharded across gpus" over fp16,
    whose gradients accumulate in the e-byte ``.grad``.

    16-bit gradients accumulated by autograd in ``.grad`` (``grad_dtype: bf16``, ``grad_accum: autograd``:
    DeepSpeed's ZeRO-1/2 fp16 and bf16 path) under an fp32 master copy: the reduction's bucket copies and the step's
    copies of the gradient partition (its fp32 partition among them) are allocated after the activations are
    freed, in segments the caching allocator then keeps reserved next to theirs (`deepspeed_step_segments`;
    BLOOM's chronicles, section 'Best TFLOPs': 73 GB at DP 1 and 51 GB at DP 2 on the same 200B layout).
    Counted on a caching allocator only (on CPU the step's tensors reuse the freed activations' memory); without
    ZeRO the fp32 gradients of every local parameter.
    Megatron-core's distributed optimizer copies its bf16 gradient shard to fp32 as well
    (``_copy_model_grads_to_main_grads``), but no published Megatron-core memory figure shows that copy held in
    the reserved pool, so its fused accumulation (``grad_accum: fused``) does not count it.
    Under ``hp_copy`` the accumulation itself, ``hp_grad.add_(lp.grad.to(fp32))`` per parameter after every
    micro-batch's backward (bf16_optimizer.py ``update_hp_grads``), makes an fp32 temporary of each gradient in
    turn while the other micro-batches' activations are alive: the largest tensor's (a vocabulary shard of
    the embedding on the end stages) is a segment of its own in the caching allocator's pool.  The pipeline engine
    then all-reduces the fp32 buffer (``_bf16_reduce_grads`` -> engine.py ``allreduce_bucket``): the buffer of each
    parameter group is one tensor, which ``flatten`` returns as it is, but ``tensor.to(communication_data_type)``
    copies it to 16 bits first (``communication_data_type`` is fp16 under any ZeRO stage, bf16 without: engine.py
    at ab61edb0), 2 bytes per local parameter at once, after the activations are freed: a segment of its own too."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    dense_p, expert_p = rp[f"{which}_dense"], rp[f"{which}_expert"]
    local = dense_p + expert_p
    dp = table.dp_cp.astype(np.float64)
    # whole experts (expert_tp 1) are data-parallel over the TP ranks too: the same optimizer shard per rank
    edp = dp / table.ep * (1.0 if workload.experts_tp_split else table.tp)
    sh = dense_p / dp + expert_p / edp
    z = workload.zero
    master = workload.master_elem_bytes                    # fp32 training needs no separate master copy
    params = e * (sh if z >= 3 else local)
    grads = workload.grad_elem_bytes * (sh if z >= 2 else local)
    if workload.grad_accum_mode == "hp_copy":              # the BF16 optimizer's low-precision .grad, kept
        grads = grads + e * local
        if caching_allocator:    # update_hp_grads' fp32 copy of one .grad at a time, the largest tensor's
            grads = grads + 4.0 * rp[f"{which}_tensor"]
            # the reduction's 16-bit copy of the whole fp32 gradient buffer, after the activations are freed
            grads = grads + 2.0 * local
    moments = 2.0 * workload.moment_elem_bytes               # exp_avg, exp_avg_sq (moment_dtype)
    optimizer = (moments + master) * (sh if z >= 1 else local)  # (fp32 master params +) 2 Adam moments
    if caching_allocator and master >= 4.0 and workload.grad_elem_bytes < 4.0 and workload.grad_accum_mode == "autograd":
        if z >= 1:           # the reduce and step transients of DeepSpeed's ZeRO-1/2, in segments of their own
            grads = grads + deepspeed_step_segments(table, workload, sh, rp[f"{which}_tensor"])
        else:
            optimizer = optimizer + 4.0 * local                           # the step's fp32 gradients
    fsdp = fsdp_at_turn = np.zeros(len(table))
    return params, grads, optimizer, fsdp, fsdp_at_turn, fsdp


def deepspeed_step_segments(table, workload, shard, largest) -> np.ndarray:
    """Bytes the caching allocator reserves for DeepSpeed ZeRO-1/2's gradient reduction and optimizer step
    (16-bit gradients by autograd under an fp32 master copy), beyond the backward's peak.

    deepspeed/runtime/zero/stage_1_and_2.py (2151c787a, 2022-02-18, the DeepSpeed BLOOM's fp16 runs used), in order,
    each tensor freed before the next but the last two:
    1. the reduction: ZeRO-1 forces ``contiguous_gradients`` off (runtime/engine.py ``_configure_zero_optimizer``:
       "Overlap and contiguous grads are meaningless in stage 1"), so ``reduce_ipg_grads`` goes through
       ``buffered_reduce_fallback`` -> ``allreduce_bucket``, ``self.flatten(bucket)``: a flat copy of one bucket of
       up to ``reduce_bucket_size`` (DEEPSPEED_REDUCE_BUCKET) elements, or of one larger tensor alone; ZeRO-2 with
       a pipeline allocates its ``ipg_buffer`` of that size instead (``reduce_gradients(pipeline_parallel=True)``);
    2. ``step`` -> ``check_overflow`` -> ``_has_inf_or_nan(grad)``: ``x.float().sum()`` of each gradient view of
       the rank's partition, 4 bytes per element of the largest;
    3. ``get_grad_norm_direct``: ``g.data.double().norm(2)``, 8 bytes per element of the largest;
    4. ``self.flatten(self.averaged_gradients[i]).to(fp32)``: the partition flattened in 16 bits, then its fp32
       copy, which lives until the update (4 + 2 bytes per partition element at once).
    The largest view is the rank's largest tensor or its whole partition, whichever is smaller (the first
    data-parallel rank's partition starts with the first parameter, the embedding on the first stage).
    The activations are freed by then, but their blocks are a few [s, b, h] tensors each, too small for any of
    these: each request takes the smallest free block of the segments made so far that holds it (best fit, as the
    caching allocator does for large blocks), else a segment of its own; the sum of those segments is returned."""
    e = workload.grad_elem_bytes
    view = np.minimum(largest, shard)
    bucket = np.maximum(DEEPSPEED_REDUCE_BUCKET, largest) if workload.zero == 1 else \
        np.where(table.pp > 1, DEEPSPEED_REDUCE_BUCKET, 0.0)
    size = np.zeros((0, len(table)))           # segments (rows) per candidate (columns), and the bytes in use
    used = np.zeros_like(size)

    def alloc(nbytes):
        nonlocal size, used
        room = np.where(size - used >= nbytes, size - used, np.inf)
        best = np.argmin(room, axis=0) if len(size) else np.zeros(len(table), dtype=int)
        fits = np.isfinite(room[best, np.arange(len(table))]) if len(size) else np.zeros(len(table), dtype=bool)
        take = (np.arange(len(size))[:, None] == best[None, :]) & fits[None, :] & (nbytes > 0)
        used = used + np.where(take, nbytes, 0.0)
        new = np.where(fits | (nbytes <= 0), 0.0, nbytes)
        size, used = np.vstack([size, new[None, :]]), np.vstack([used, new[None, :]])
        return take, new > 0

    def free(where, nbytes):
        nonlocal used
        take, made = where
        used = used - np.where(np.vstack([take, np.zeros((len(size) - len(take), len(table)), bool)]), nbytes, 0.0)
        used[len(take)] -= np.where(made, nbytes, 0.0)

    for nbytes in (e * bucket, 4.0 * view, 8.0 * view):
        free(alloc(nbytes), nbytes)
    flat = alloc(e * shard)
    alloc(4.0 * shard)
    free(flat, e * shard)
    return size.sum(axis=0)


def _activation_bytes(table, model, rp, which: str, shared: dict, coeffs, caching_allocator: bool,
                      fsdp, fsdp_at_turn, weighted: bool = False) -> tuple[np.ndarray, ...]:
    """(activations, logits, the part of both the step's last backward frees) of rank `which`: its in-flight
    micro-batches' blocks, the pipeline buffers, the backward working set and the loss turn's tensors
    (`_shared_activation_terms`)."""
    rank = rank_index(table, model, which, weighted)
    infl = rank_in_flight(table, model, which, weighted)
    pipe, working_set, head_act = shared["pipe"], shared["working_set"], shared["head_act"]
    # the embedding's backward on the rank holding it: under dtensor TP its replicated weight gradient
    # (e x vocab x dim, `dtensor_embedding_grad_full`) and the all-gathered output gradient it is computed
    # from ([tokens, dim]) are live at once, after the blocks' backward (dry run, llama3-70b TP 8 x PP 4,
    # rank 0: the step's peak, at aten.embedding_dense_backward: 1.96 + 0.125 GiB), when that micro-batch's
    # blocks have freed what they kept (one micro-batch's block tensors fewer than the in-flight count)
    nd, nm = rp[f"{which}_layers"]
    per_mb = nd * shared["dense_act"] + nm * shared["moe_act"]
    e = shared["e"]
    emb_bwd = np.where(rp[f"{which}_has_emb"] & shared["emb_grad_full"],
                       e * model.vocab_size * model.dim + e * shared["tokens"] * model.dim - per_mb, 0.0)
    working_set = np.maximum(working_set, emb_bwd)
    has_head = rp[f"{which}_has_head"]
    # the loss stage's output is the logits: its other stages' outputs only (none with one stage per rank)
    per_mb = per_mb + pipe["boundary"] * np.where(has_head, shared["other_chunks"], 1.0)
    per_mb = per_mb + np.where(rp[f"{which}_has_emb"], shared["emb_act"], 0.0)   # embedding norm, dropout mask
    # Two peak candidates after the last forward: the loss turn (final norm, head input and the
    # logit tensors of the current micro-batch) and, once those are freed, a block's backward
    # (`working_set`); the older in-flight micro-batches' head tensors persist in both.
    turn = np.where(has_head, head_act + shared["logits_turn"], 0.0)
    # On GPU the caching allocator keeps the segments freed by one phase reserved (sized for the
    # logits, not for a block's tensors), so the reserved peak holds both: there they add up.
    transient = working_set + turn if caching_allocator else np.maximum(working_set, turn)
    # torch's per-micro-batch receive buffers (`pipeline_extra_bytes` ``recv``): one set per direction of
    # each stage the rank holds, none for the first stage's input and the last stage's output gradient
    directions = 2.0 * table.stages_per_rank - rp[f"{which}_has_emb"] - has_head
    # the sends (`pipeline_extra_bytes` ``sends_out``, ``sends_grad``): an output from each stage but the last,
    # an input gradient from each but the first, less a V schedule's same-rank hand-over (stages pp - 1 and pp
    # on rank pp - 1: the forward output and the input gradient stay local)
    handover = np.where(shared["v_shape"] & (rank == table.pp - 1), 1.0, 0.0)
    out_directions = table.stages_per_rank - has_head - handover
    grad_directions = table.stages_per_rank - rp[f"{which}_has_emb"] - handover
    sends = (out_directions * pipe["sends_out"] + grad_directions * pipe["sends_grad"]
             + np.where(grad_directions > 0, pipe["grads_held"], 0.0))
    own = (infl * per_mb + working_set + pipe["deferred_w"]
           + np.where(has_head, shared["head_extra"], 0.0)) * coeffs.activation_memory_scale
    acts = own + (sends + directions * pipe["recv"]) * coeffs.pipeline_buffer_memory_scale
    # the turn's tensors beyond the backward phase's may sit in what the resharded blocks left free
    turn_excess = np.maximum(0.0, (transient - working_set) - (fsdp - fsdp_at_turn))
    logits = np.where(has_head, shared["logits_head"] - shared["logits_turn"], 0.0) + turn_excess
    # Where the pipeline re-gathers each block in backward and keeps it gathered (`fsdp_at_turn` < `fsdp`:
    # reshard after forward, the schedule's reshard after backward off), a block's parameters are gathered
    # as its backward frees that micro-batch's activations of it, and all of them stay gathered only once the
    # backward is done (the next forward reshards them block by block as it makes its activations).  So the
    # peaks are the loss turn (`fsdp_at_turn`), the start of a backward (all in-flight micro-batches, the
    # block and its prefetched successor gathered: 4 e x the largest unit, as `_fsdp2_state_bytes` counts a
    # re-gather) and the end of a backward (one micro-batch fewer but its first block's, all gathered), not
    # the sum of all in-flight activations and all gathered blocks.  With P = in-flight blocks, T = turn +
    # fsdp_at_turn, X = working set + fsdp, c = the freed blocks and g = fsdp - the backward start's gathers:
    #   max(P + T, P + X - g, P - c + X) = P + max(X, T) - min(c, g, max(0, X - T)).
    # (titan-run --dry-run --memory, llama3-405b TP 8 x PP 16 x FSDP 128, last rank: at the step's peak, the
    # loss turn, 1.98 GiB of gathered parameters and buffers of the stage's 6.98.)  One stage per rank only:
    # under the interleaved schedules the other chunks' forwards reshard them in between.
    regather = (fsdp_at_turn < fsdp) & shared["one_stage"]
    blocks = nd * shared["dense_act"] + nm * shared["moe_act"]
    first_block = np.where(nd > 0, shared["dense_act"], shared["moe_act"])
    freed = np.maximum(0.0, blocks - first_block) * coeffs.activation_memory_scale
    local = rp[f"{which}_dense"] + rp[f"{which}_expert"]
    gathered_later = np.maximum(0.0, e * local - 4.0 * e * _regathered_unit(rp, which, caching_allocator))
    credit = np.minimum(np.minimum(freed, gathered_later),
                        np.maximum(0.0, (working_set + fsdp) - (transient + fsdp_at_turn)))
    acts = acts - np.where(regather, credit, 0.0)
    # what the step's last backward has freed: the blocks' and the head's tensors, not the pipeline's send and
    # receive buffers, which may be kept to the step's end
    return acts, logits, np.maximum(0.0, own - np.where(regather, credit, 0.0)) + logits
