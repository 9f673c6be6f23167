"""Per-rank memory, as a breakdown, for every candidate of a `CandidateTable`.

Keys (bytes, worst rank): params, grads, optimizer, activations, logits, fsdp_buffers,
overhead.  The worst rank is the heaviest of the first pipeline rank (embedding, the most
in-flight micro-batches), the last (LM head and logits; under the V schedules rank 0 holds
both ends) and the busiest (most MoE blocks, then most blocks): `cost_models.layout`.
"""
from __future__ import annotations

import numpy as np

from search_spaces.plan import AC_MODES

from .flops import COL, ROW, attention_dims, layer_matmuls
from .layout import (RANKS, expert_shard_fraction, in_flight_microbatches, in_flight_on_rank,  # noqa: F401
                     layers_per_rank, rank_index, rank_params)

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "logits", "fsdp_buffers", "overhead")

# fp32 cross-entropy on [tokens, vocab/tp] logits: the fp32 log-softmax output kept for
# backward, its gradient and the input gradient live together at the start of backward
# (torch.nn.functional.cross_entropy on .float() logits, as TorchTitan and Megatron's
# vocab-parallel loss do): 3 x 4 bytes per logit.
LOGIT_BYTES = 12.0




def logit_bytes(table, workload) -> tuple[np.ndarray, np.ndarray]:
    """(bytes per logit kept from the loss stage's forward to its backward, bytes per logit added at
    the turn).  Eager (``loss_impl: eager``): the fp32 log-softmax output is kept (plus, with pp > 1,
    the stage's e-byte output the pipeline keeps for the stage backward), and its gradient and the
    input gradient join it at the turn (LOGIT_BYTES in all).  Fused (``loss_impl: fused``; e.g.
    flash-attn's cross_entropy, Megatron's in-place vocab-parallel loss): the kernel keeps only its
    e-byte input (the same tensor as the stage output) and a per-token log-sum-exp, and writes one
    e-byte gradient at the turn."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    if workload.loss_mode == "fused":
        return np.full(len(table), e), np.full(len(table), e)
    return 4.0 + np.where(table.pp > 1, e, 0.0), np.full(len(table), LOGIT_BYTES - 4.0)


# --------------------------------------------------------------------------- activations
# Terms of the bytes a block keeps per token, by how tensor parallelism divides them:
SEQ, SHARD, SCORE, FULL, FULL_TP, SEQ_TP = range(6)
N_TERMS = 6
#   SEQ     residual-stream tensors: divided by tp only with sequence parallelism
#   SHARD   head/FFN-sharded tensors: divided by tp
#   SCORE   per token *and key position* (materialized s x s scores), divided by tp
#   FULL    never divided by tp: with DTensor-style TP (fsdp2 layout, as in TorchTitan) a
#           column-parallel matmul keeps its all-gathered input and a row-parallel one
#           produces its partial sum at full size; Megatron keeps them sequence-sharded
#           (Korthikanti Sec. 4.2.2), so in the megatron layout they are SEQ
#   FULL_TP as FULL but present only when tp > 1 (outputs of all-gathers kept by the
#           'matmul' selective policy; with tp = 1 the same tensor is recomputed)
#   SEQ_TP  as SEQ but present only when tp > 1 (the sequence-sharded outputs of the row-parallel
#           reduce-scatters, which the 'op' and 'matmul' policies keep under DTensor-style TP;
#           with tp = 1 there is no collective and the sum is recomputed)


def layer_activation_terms(model, workload, moe: bool, ac: str, compiled: bool,
                           f8_fraction: float = 1.0) -> np.ndarray:
    """Bytes one block keeps for backward, per token, split into the five terms above.

    Source: Korthikanti et al. 2022 (arXiv:2205.05198), Sec. 4.1 and Table 2, per layer
    sbh(34 + 5as/h) for GPT with dropout and materialized attention:
      attention 11sbh + 5as^2b: QKV input 2, Q and K 4, V 2, out-proj input 2, dropout mask 1,
      softmax output 2as, dropout mask as, dropout output 2as;  MLP 19sbh: fc1 input 2,
      GeLU input 8, GeLU output 8, dropout mask 1;  LayerNorms 4sbh.
    Adapted here: GQA/MLA widths from `attention_dims`; SwiGLU keeps gate and up outputs
    (eager autograd also keeps silu(gate) and the product: 4 tensors of width ffn_hidden,
    a fused/compiled SwiGLU 2); fused (flash/SDPA) attention keeps no s x s scores but its
    output O and the fp32 log-sum-exp (Dao 2023, arXiv:2307.08691); eager TorchTitan
    RMSNorm upcasts to fp32 and keeps the fp32 input plus the bf16 normalized output
    (3x the bf16 width), a fused norm keeps its input; MoE blocks keep the top_k
    dispatched copies of the token, each expert's hidden and output.
    Selective: 'attention' (Megatron, Korthikanti Sec. 4.3) drops the attention core's
    tensors (scores, or O and the LSE); 'op' (TorchTitan) keeps the block input, the
    1st/3rd/5th/... matmul outputs in forward order and the attention outputs; 'matmul'
    (this executor) keeps the block input, every matmul, attention and collective output.
    Full keeps the block input (Korthikanti Table 2: 2sbh).
    """
    if ac == "full":
        t = np.zeros(N_TERMS)
        t[SEQ] = (4.0 if workload.dtype == "fp32" else 2.0) * model.dim
        return t
    if ac == "selective" and workload.selective_ac in ("op", "matmul"):
        return _selective_kept_terms(model, workload, moe, f8_fraction)
    # no recomputation (or the attention-core policy, which only removes the core's tensors)
    return _stored_terms(model, workload, moe, ac == "selective", compiled, f8_fraction)


def _selective_kept_terms(model, workload, moe: bool, f8_fraction: float) -> np.ndarray:
    """`layer_activation_terms` under the 'op' and 'matmul' selective policies: the block input
    and the saved matmul (attention, collective) outputs."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    h = model.dim
    d_o = model.n_heads * (model.v_head_dim if model.attention == "mla" else model.head_dim)
    fused = workload.attention_impl == "fused"
    dtensor = workload.state_layout == "fsdp2"
    row_out = FULL if dtensor else SEQ                # a row-parallel matmul's output
    t = np.zeros(N_TERMS)
    every = workload.selective_ac == "matmul"
    t[SEQ] = e * h                                    # block input
    for i, m in enumerate(layer_matmuls(model, moe)):
        if i % 2 and not every:                       # 'op': 2nd, 4th, ... matmuls are recomputed
            continue
        mult = model.top_k if m.expert else 1.0
        t[SHARD if m.shard == COL else (row_out if m.shard == ROW else FULL)] += mult * e * m.n
    if fused:
        t[SHARD] += e * d_o + 4.0 * model.n_heads
    if every:                                         # all-gathered QKV and FFN inputs (tp > 1)
        t[FULL_TP] += 2 * e * h
    if dtensor:   # the wo and w2 reduce-scatter outputs (tp > 1; TorchTitan's op list saves them too)
        t[SEQ_TP] += 2 * e * h
    return t


def _stored_terms(model, workload, moe: bool, core_dropped: bool, compiled: bool,
                  f8_fraction: float) -> np.ndarray:
    """`layer_activation_terms` without recomputation: norms, dropout masks, the attention's
    Q/K/V and core (unless `core_dropped`, the 'attention' policy) and the FFN's tensors."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    h = model.dim
    d_qk, d_k, d_v = attention_dims(model)
    d_o = model.n_heads * (model.v_head_dim if model.attention == "mla" else model.head_dim)
    fused = workload.attention_impl == "fused"
    dtensor = workload.state_layout == "fsdp2"
    lin = e * f8_fraction                            # a saved linear input
    drop = 1.0 if workload.dropout else 0.0          # one byte per mask element
    t = np.zeros(N_TERMS)
    col_in = FULL if dtensor else SEQ                 # where a column-parallel input lives
    if compiled:
        norm_in = e * h                               # fused norm: its input (+ a per-token rstd)
    elif workload.dtype == "bf16":
        norm_in = 3 * e * h                           # eager: fp32 upcast (2e) + bf16 normalized (e)
    else:
        norm_in = 2 * e * h                           # eager fp32: input and normalized output
    t[SEQ] = 2 * norm_in + 2 * drop * h               # two norms, two dropout masks
    t[col_in] += 2 * lin * h                          # QKV and FFN inputs
    # GQA K/V expansion: the executor (CoreAttention, repeat_interleave) and TorchTitan (repeat_kv)
    # expand K and V to n_heads before SDPA, which saves the expanded copies; the un-expanded
    # K (after RoPE) and V are not saved (repeat's backward needs no input), so they are freed.
    # Megatron's fused kernels take GQA K/V as they are.  (Measured with saved_tensors_hooks on
    # llama3-debug: Q, K and V saved at n_heads * head_dim each.)
    if dtensor and model.attention != "mla":
        d_k = d_v = d_o
    t[SHARD] = e * (d_qk + d_k + d_v) + lin * d_o     # Q, K, V (RoPE applied) and out-proj input
    if fused and not core_dropped:
        # fp32 LSE kept by the SDPA kernel, and its output O.  The flash kernels (CUDA and
        # CPU) write O [b, s, heads, d]-contiguous and return it viewed as [b, heads, s, d], so
        # `out.transpose(1, 2).reshape(b, s, -1)` is a view: O *is* the out-proj input (one
        # storage, counted above) unless float8 saves a separate low-precision copy of it.
        t[SHARD] += 4.0 * model.n_heads + (e * d_o if f8_fraction < 1.0 else 0.0)
    elif not fused and not core_dropped:
        t[SCORE] = model.n_heads * (e + drop * (1.0 + e))  # softmax out (+ dropout mask and output)
    if not moe:
        t[SHARD] += _saved_ffn_bytes(model, model.ffn_hidden, e, lin, compiled)
    else:
        k = model.top_k
        t[SHARD] += k * (lin * h + _saved_ffn_bytes(model, model.moe_ffn_hidden, e, lin, compiled) + e * h)
        if model.n_shared_experts:
            t[SHARD] += _saved_ffn_bytes(model, model.n_shared_experts * model.moe_ffn_hidden, e, lin, compiled)
    return t


def _saved_ffn_bytes(model, width: float, e: float, lin: float, compiled: bool) -> float:
    """Bytes per token an FFN of hidden `width` keeps (`lin`: bytes of a saved linear input)."""
    if model.mlp == "swiglu":                         # gate, up (+ silu(gate) and product when eager)
        return 2 * e * width + (0.0 if compiled else (e + lin) * width)
    return e * width + lin * width                    # GeLU input and output (= fc2 input)


def _ac_table(model, workload, moe: bool, f8_fraction: float) -> np.ndarray:
    """[ac code, compiled, float8] -> the five terms, bytes per token."""
    out = np.zeros((len(AC_MODES), 2, 2, N_TERMS))
    for a, ac in enumerate(AC_MODES):
        for c in (0, 1):
            for f in (0, 1):
                out[a, c, f] = layer_activation_terms(model, workload, moe, ac, bool(c), f8_fraction if f else 1.0)
    return out


def _bytes(terms: np.ndarray, table, workload) -> np.ndarray:
    tp = table.tp.astype(np.float64)
    tokens = table.microbatch * workload.seq_len / table.cp
    sp = tp if workload.sequence_parallel else np.ones_like(tp)
    return tokens * (terms[:, SEQ] / sp + terms[:, SHARD] / tp + terms[:, SCORE] * workload.seq_len / tp
                     + terms[:, FULL] + (terms[:, FULL_TP] + terms[:, SEQ_TP] / sp) * (tp > 1))


def per_layer_activation_bytes(table, model, workload, coeffs, moe: bool) -> tuple[np.ndarray, np.ndarray]:
    """(bytes one block keeps per micro-batch, transient working set of one block's backward).

    The working set is what the block's backward re-materializes on top of what it kept
    (recomputed tensors: the no-AC footprint minus the kept one) plus the gradients of the
    block's input and output in flight (2 residual-stream tensors).
    """
    terms = _ac_table(model, workload, moe, coeffs.float8_saved_input_fraction)
    c, f = table.compile.astype(int), table.float8.astype(int)
    kept = _bytes(terms[table.ac, c, f], table, workload)
    none = _bytes(terms[AC_MODES.index("none"), c, f], table, workload)
    e = 4.0 if workload.dtype == "fp32" else 2.0
    sp = table.tp if workload.sequence_parallel else 1
    grads = 2.0 * e * model.dim * table.microbatch * workload.seq_len / table.cp / sp
    # the FFN's backward holds the gradients of two hidden-width tensors at once (e.g. of the
    # SwiGLU product's factors) while freeing its own saved tensors; measured on llama3-debug
    # (fsdp, mb 8): the peak sits in the last block's FFN backward, ~15 MiB over all blocks' saved
    # tensors, vs 2 residual + 2 hidden gradients = 16 MiB.
    width = model.moe_ffn_hidden * model.top_k if moe else model.ffn_hidden
    ffn_grads = 2.0 * e * width * table.microbatch * workload.seq_len / table.cp / table.tp
    # DTensor TP with sequence parallelism: the SP -> TP all-gather's flat output lives next to the
    # cat that reorders it along the sequence dim, and in backward a row-parallel partial sum is
    # held at full size for its reduce-scatter (measured on tp 2: 4 + 2 MiB of such buffers of a
    # 2 MiB [tokens, dim] tensor at the peak): two full-size residual tensors on top.
    tp_bufs = np.where((table.tp > 1) & (workload.state_layout == "fsdp2") & workload.sequence_parallel,
                       2.0 * e * model.dim * table.microbatch * workload.seq_len / table.cp, 0.0)
    return kept, np.maximum(none - kept, 0.0) + grads + ffn_grads + tp_bufs


def pipeline_extra_bytes(table, model, workload, moe: bool = False) -> dict[str, np.ndarray]:
    """Per-rank bytes of pipeline mechanics that do not scale like one block's activations.

    Measured with the profiler's live allocations at the peak on llama3-debug (pp 2, CPU, torch 2.14):

    * ``boundary``: each in-flight micro-batch keeps its stage output (the last block's residual
      output, one [tokens, dim] tensor per stage chunk) in the stage's forward cache until its
      backward, on top of what the blocks save.  For pp == 1 this tensor is the final norm's input,
      counted by `head_activation_bytes`.
    * ``sends``: the multi-stage schedules (Interleaved1F1B, ZBVZeroBubble, DualPipeV run by torch's
      PipelineScheduleMulti / _PipelineScheduleRuntime) keep every P2P send's work -- and with it
      the sent activation or input gradient -- until the end of the step; a rank sends a forward
      output from each non-last chunk and an input gradient from each non-first chunk: about
      (2v - 1) * n_microbatches residual-width tensors live at the end of the step.
    * ``deferred_w``: ZBVZeroBubble splits backward into I (input grad) and W (weight grad) and runs
      W late; until then each pending (chunk, micro-batch) keeps the gradients of every matmul's
      output (the dW = g^T x operands).  Their forward tensors are among the pp in-flight
      micro-batches; at the peak of the rank holding the loss stage (pp 2, v 2: 2 micro-batches of
      forward tensors and the output gradients of 1 chunk = 0.5 of the rank's layers) about
      (pp - 1) / v micro-batches' worth of output gradients are pending.
    """
    e = 4.0 if workload.dtype == "fp32" else 2.0
    tp = table.tp.astype(np.float64)
    sp = tp if workload.sequence_parallel else np.ones_like(tp)
    tokens = table.microbatch * workload.seq_len / table.cp
    pp, v = table.pp.astype(np.float64), table.stages_per_rank.astype(np.float64)
    resid = e * model.dim * tokens / sp
    multi = (table.is_schedule("Interleaved1F1B") | table.is_schedule("ZBVZeroBubble")
             | table.is_schedule("DualPipeV")) & (table.pp > 1)
    piped = table.pp > 1
    # torch.distributed.pipelining only (the fsdp2 layout); Megatron frees a sent output's data
    # (deallocate_output_tensor) and waits its sends per micro-batch
    torch_pp = workload.state_layout == "fsdp2"
    boundary = np.where(piped & ~multi & torch_pp, v * resid, 0.0)
    sends = np.where(multi & torch_pp, (2 * v - 1) * table.n_microbatches * resid, 0.0)
    out_width = 0.0 * tp
    for m in layer_matmuls(model, moe):
        mult = model.top_k if m.expert else 1.0
        out_width = out_width + mult * m.n / (tp if m.shard == COL else (1.0 if m.shard == ROW else 1.0))
    zbv = table.is_schedule("ZBVZeroBubble") & piped
    deferred_w = np.where(zbv, (pp - 1) / v * layers_per_rank(table, model) * e * out_width * tokens, 0.0)
    return {"boundary": boundary, "sends": sends, "deferred_w": deferred_w}


def head_activation_bytes(table, model, workload, compiled) -> np.ndarray:
    """Bytes the loss stage keeps per in-flight micro-batch for the final norm and the LM head's
    input: the norm's input and normalized output (2 x the width when eager fp32, see
    `layer_activation_terms`) and the head's (under DTensor TP all-gathered) input."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    h = model.dim
    tp = table.tp.astype(np.float64)
    sp = tp if workload.sequence_parallel else np.ones_like(tp)
    tokens = table.microbatch * workload.seq_len / table.cp
    norm_in = np.where(compiled, e * h, (3 if workload.dtype == "bf16" else 2) * e * h)
    head_in = e * h / (1.0 if workload.state_layout == "fsdp2" else sp)
    return tokens * (norm_in / sp + head_in)


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
    return {k: np.choose(worst, [by_rank[w][k] for w in RANKS]) for k in MEMORY_KEYS}


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
    rp = rank_params(table, model)
    results = {}
    for which in RANKS:
        if workload.state_layout == "fsdp2":
            params, grads, optimizer, fsdp, fsdp_at_turn = _fsdp2_state_bytes(table, model, workload, rp, which,
                                                                              shared["dense_act"])
        else:
            params, grads, optimizer, fsdp, fsdp_at_turn = _megatron_state_bytes(table, workload, rp, which)
        acts, logits = _activation_bytes(table, model, rp, which, shared, coeffs, caching_allocator,
                                         fsdp, fsdp_at_turn)
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
    e = 4.0 if workload.dtype == "fp32" else 2.0
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
    return dict(dense_act=dense_act, moe_act=moe_act, working_set=np.maximum(ws_dense, ws_moe),
                head_infl=head_infl,
                logits_head=tokens * model.vocab_size / table.tp * (head_infl * logit_kept + logit_turn),
                head_act=head_activation_bytes(table, model, workload, table.compile),
                logits_turn=tokens * model.vocab_size / table.tp * (logit_kept + logit_turn),
                pipe=pipeline_extra_bytes(table, model, workload))


def _fsdp2_state_bytes(table, model, workload, rp, which: str, dense_act) -> tuple[np.ndarray, ...]:
    """(params, grads, optimizer, fsdp buffers, fsdp buffers at the loss turn) of rank `which`
    under the fsdp2 layout: fp32 master parameters, gradients and AdamW moments, all sharded."""
    # the executor applies FSDP when some rank shares the data-parallel work, or on one rank for
    # bf16 mixed precision (executor/parallel/__init__.py: uses_fsdp)
    fsdp_applied = (table.dp_cp > 1) | (workload.dtype != "fp32")
    e = 4.0 if workload.dtype == "fp32" else 2.0
    fsdp_group = table.fsdp_size.astype(np.float64)
    accumulate_unsharded = (table.pp > 1) & (table.n_microbatches > 1)   # pipelining: no grad sync until last
    dense_p, expert_p, unit = rp[f"{which}_dense"], rp[f"{which}_expert"], rp[f"{which}_unit"]
    local = dense_p + expert_p
    shard_p = dense_p / fsdp_group + expert_p * expert_shard_fraction(table, model)
    params = 4.0 * shard_p                                 # fp32 master copy, sharded
    grads = np.where(accumulate_unsharded, 4.0 * local, 4.0 * shard_p)
    optimizer = 8.0 * shard_p                              # AdamW exp_avg, exp_avg_sq (fp32)
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
    regather = accumulate_unsharded & ~v_sched & table.reshard_after_forward & (fsdp_group > 1)
    gathered = np.where(regather, np.maximum(gathered, 4.0 * e * unit), gathered)
    # The reduce-scatter buffers of a block exist in backward while that block's saved
    # activations are being freed, so only their excess over one layer's activations
    # raises the peak (which sits at the forward/backward turn).
    rs_exposed = np.maximum(0.0, rs - dense_act)
    fsdp = np.where(fsdp_applied, gathered + rs_exposed, 0.0)
    # ... but at the loss turn of each micro-batch the blocks are resharded again (reshard after
    # forward; the schedule turns off only the reshard after backward): the root's head and one
    # unit are gathered then, not the stage (dry run, llama3-8b pp 2 fsdp 4, loss rank's peak:
    # 0.98 GiB unsharded = the LM head, of 7.5 GiB kept gathered in backward)
    fsdp_at_turn = np.where(fsdp_applied & regather, 2.0 * e * unit, fsdp)
    return params, grads, optimizer, fsdp, fsdp_at_turn


def _megatron_state_bytes(table, workload, rp, which: str) -> tuple[np.ndarray, ...]:
    """As `_fsdp2_state_bytes` for the Megatron layout: bf16 params, main grads in ``grad_dtype``
    (fp32: Megatron-LM; bf16: NeMo / Megatron-Bridge recipes), ZeRO stages."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    dense_p, expert_p = rp[f"{which}_dense"], rp[f"{which}_expert"]
    local = dense_p + expert_p
    dp = table.dp_cp.astype(np.float64)
    edp = dp / table.ep
    sh = dense_p / dp + expert_p / edp
    z = workload.zero
    master = 4.0 if workload.dtype == "bf16" else 0.0      # fp32 training needs no separate master copy
    params = e * (sh if z >= 3 else local)
    grads = workload.grad_elem_bytes * (sh if z >= 2 else local)
    optimizer = (8.0 + master) * (sh if z >= 1 else local)  # (fp32 master params +) 2 Adam moments
    fsdp = fsdp_at_turn = np.zeros(len(table))
    return params, grads, optimizer, fsdp, fsdp_at_turn


def _activation_bytes(table, model, rp, which: str, shared: dict, coeffs, caching_allocator: bool,
                      fsdp, fsdp_at_turn) -> tuple[np.ndarray, np.ndarray]:
    """(activations, logits) of rank `which`: its in-flight micro-batches' blocks, the pipeline
    buffers, the backward working set and the loss turn's tensors (`_shared_activation_terms`)."""
    infl = in_flight_on_rank(table, rank_index(table, model, which))
    pipe, working_set, head_act = shared["pipe"], shared["working_set"], shared["head_act"]
    nd, nm = rp[f"{which}_layers"]
    per_mb = nd * shared["dense_act"] + nm * shared["moe_act"]
    has_head = rp[f"{which}_has_head"]
    per_mb = per_mb + np.where(has_head, 0.0, pipe["boundary"])   # the loss stage's output: logits
    # Two peak candidates after the last forward: the loss turn (final norm, head input and the
    # logit tensors of the current micro-batch) and, once those are freed, a block's backward
    # (`working_set`); the older in-flight micro-batches' head tensors persist in both.
    turn = np.where(has_head, head_act + shared["logits_turn"], 0.0)
    # On GPU the caching allocator keeps the segments freed by one phase reserved (sized for the
    # logits, not for a block's tensors), so the reserved peak holds both: there they add up.
    transient = working_set + turn if caching_allocator else np.maximum(working_set, turn)
    acts = ((infl * per_mb + working_set + pipe["deferred_w"]
            + np.where(has_head, (shared["head_infl"] - 1) * head_act, 0.0)) * coeffs.activation_memory_scale
            + pipe["sends"] * coeffs.pipeline_buffer_memory_scale)
    # the turn's tensors beyond the backward phase's may sit in what the resharded blocks left free
    turn_excess = np.maximum(0.0, (transient - working_set) - (fsdp - fsdp_at_turn))
    logits = np.where(has_head, shared["logits_head"] - shared["logits_turn"], 0.0) + turn_excess
    return acts, logits
