"""What one transformer block (and the loss stage's head) keeps for backward, per token and per rank.

`layer_activation_terms` splits a block's saved bytes per token into terms by how tensor
parallelism divides them (below); `per_layer_activation_bytes` turns them into bytes per
micro-batch for every candidate; `pipeline_extra_bytes` and `head_activation_bytes` add what
pipelining and the LM head keep.  `cost_models.memory` multiplies these by the in-flight
micro-batches of each rank.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from search_spaces.plan import AC_MODES

from .flops import COL, ROW, attention_dims, layer_matmuls
from .layout import LAYOUT_COLUMNS, layers_per_rank, per_layout

# the table columns a block's saved tensors depend on (its shards, micro-batch, checkpointing and kernels)
BLOCK_COLUMNS = ("tp", "cp", "microbatch", "ac", "compile", "float8")

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


# DeepSeek-V3's fine-grained float8 (arXiv:2412.19437 Sec. 3.3.2): one fp32 scale per 1 x 128 activation tile
FP8_TILE = 128
E5M6_BYTES = 1.5     # Sec. 3.3.3: the customized E5M6 format (12 bits) of the linear input after attention


class _Saved(NamedTuple):
    """Bytes per element of what a block caches, by kind (`_saved_bytes`)."""
    lin: float            # a linear's saved input
    attn_out: float       # the input of the linear after attention (the attention output O)
    o_copy: float         # the attention kernel's own copy of O, where it is not that input (0: one storage)
    moe_swiglu_in: float  # an MoE expert's SwiGLU inputs (gate and up)


def _saved_bytes(workload, e: float, f8_fraction: float, float8: bool) -> _Saved:
    """What one block's cached tensors cost per element (``Workload.float8_cache``, with `float8` on).

    Without float8, or with ``float8_cache: auto`` under fsdp2 (:attr:`Workload.float8_cache_mode`), a saved
    linear input costs ``e * f8_fraction`` (the coefficients' ``float8_saved_input_fraction``, 1.0 = torchao's
    high-precision copy) and, when that is below ``e``, the attention kernel keeps its own O next to the
    out-projection's low-precision copy.
    ``fp8``: every linear keeps its 1-byte input (Transformer Engine), O twice as above.  ``fine_grained``
    (DeepSeek-V3 Sec. 3.3.3): linear inputs in fp8 plus one fp32 scale per 1 x 128 tile, O cached once in
    E5M6 for the out-projection's and the attention's backward, the MoE SwiGLU inputs in fp8 as well."""
    mode = workload.float8_cache_mode if float8 else "auto"
    if mode == "fine_grained":
        tile = 1.0 + 4.0 / FP8_TILE
        return _Saved(lin=tile, attn_out=E5M6_BYTES + 4.0 / FP8_TILE, o_copy=0.0, moe_swiglu_in=tile)
    lin = 1.0 if mode == "fp8" else e * f8_fraction
    return _Saved(lin=lin, attn_out=lin, o_copy=e if lin < e else 0.0, moe_swiglu_in=e)


def layer_activation_terms(model, workload, moe: bool, ac: str, compiled: bool,
                           f8_fraction: float = 1.0, *, float8: bool = False, block_ac: str | None = None) -> np.ndarray:
    """Bytes one block keeps for backward, per token, split into the terms above.

    Source: Korthikanti et al. 2022 (arXiv:2205.05198), Sec. 4.1 and Table 2, per layer
    sbh(34 + 5as/h) for GPT with dropout and materialized attention:
      attention 11sbh + 5as^2b: QKV input 2, Q and K 4, V 2, out-proj input 2, dropout mask 1,
      softmax output 2as, dropout mask as, dropout output 2as;  MLP 19sbh: fc1 input 2,
      GeLU input 8, GeLU output 8, dropout mask 1;  LayerNorms 4sbh.
    Adapted here: GQA/MLA widths from `attention_dims` (MLA also keeps its two normalized low-rank
    latents, the up projections' inputs); SwiGLU keeps gate and up outputs (eager autograd also
    keeps silu(gate) and the product: 4 tensors of width ffn_hidden; a compiled SwiGLU 3: gate, up and the
    product, which AOTAutograd's min-cut partitioner never recomputes because fc2's weight gradient must
    materialize it in backward (``ban_recompute_materialized_backward``, torch/_functorch/partitioners.py;
    measured on llama3-debug, torch 2.14: the compiled block saves exactly these three); a fused SwiGLU kernel, ``Workload.swiglu_impl`` (Megatron's
    bias-SwiGLU), 3: its input and the down projection's input; the whole FFN as one function, xformers'
    SwiGLU op, 2: it rebuilds the product in its backward); fused (flash/SDPA) attention keeps no s x s scores but its output O and
    the fp32 log-sum-exp (Dao 2023, arXiv:2307.08691); eager TorchTitan RMSNorm upcasts to fp32
    and keeps the fp32 input plus the bf16 normalized output (3x the bf16 width), a fused norm
    keeps its input, titan-run's eager norm (``norm_impl: auto`` uncompiled) its input and the
    per-token fp32 statistics (`_norm_saved_bytes`); MoE blocks keep the top_k dispatched copies of the token, each expert's
    hidden and, when the combine applies the router weights (``Workload.moe_weighting``), its output.
    Selective: 'attention' (Megatron, Korthikanti Sec. 4.3) drops the attention core's
    tensors (scores, or O and the LSE); 'op' (TorchTitan) keeps the block input, the
    1st/3rd/5th/... matmul outputs in forward order and the attention outputs; 'matmul'
    (this executor) keeps the block input, every matmul, attention and collective output;
    'modules' drops what each of Megatron's `recompute_modules` recomputes (`_module_drops`).
    Full keeps the block input (Korthikanti Table 2: 2sbh).
    With `float8` on, ``Workload.float8_cache`` says what the cached tensors cost (`_saved_bytes`);
    `f8_fraction` is the ``auto`` one (a linear input's bytes relative to the compute dtype's).
    """
    if ac == "full":
        t = np.zeros(N_TERMS)
        t[SEQ] = (4.0 if workload.dtype == "fp32" else 2.0) * model.dim
        return t
    if ac == "selective" and workload.selective_policy in ("op", "matmul"):
        return _selective_kept_terms(model, workload, moe, f8_fraction)
    # no recomputation, the attention-core policy (which only removes the core's tensors) or modules
    core_dropped = ac == "selective" and (workload.selective_policy == "attention" or workload.recomputes("core_attn"))
    saved = _saved_bytes(workload, 4.0 if workload.dtype == "fp32" else 2.0, f8_fraction, float8)
    # `block_ac`: the AC mode of the block whose forward this is (a checkpointed block's recompute keeps what
    # ac none keeps, with titan-run's rebuilt FFN input off: `Workload.ffn_rebuilds_product`)
    rebuild = workload.ffn_rebuilds_product(ac=block_ac or ac, compiled=compiled, float8=float8)
    t = _stored_terms(model, workload, moe, core_dropped, compiled, saved, rebuild)
    if ac == "selective" and workload.selective_ac == "modules":
        t = t - _module_drops(model, workload, moe, compiled, saved)
    return t


def _selective_kept_terms(model, workload, moe: bool, f8_fraction: float) -> np.ndarray:
    """`layer_activation_terms` under the 'op' and 'matmul' selective policies: the block input
    and the saved matmul (attention, collective) outputs."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    h = model.dim
    d_o = model.n_heads * (model.v_head_dim if model.attention == "mla" else model.head_dim)
    fused = workload.attention_impl == "fused"
    gathered = workload.tp_keeps_gathered
    row_out = FULL if gathered else SEQ               # a row-parallel matmul's output
    t = np.zeros(N_TERMS)
    every = workload.selective_policy == "matmul"
    t[SEQ] = e * h                                    # block input
    for i, m in enumerate(layer_matmuls(model, moe)):
        if i % 2 and not every:                       # 'op': 2nd, 4th, ... matmuls are recomputed
            continue
        mult = model.top_k if m.expert else 1.0
        t[SHARD if m.shard == COL else (row_out if m.shard == ROW else FULL)] += mult * e * m.n
    if fused:
        t[SHARD] += e * d_o + 4.0 * model.n_heads
    if every:                                         # all-gathered QKV and FFN inputs (tp > 1), or their shards
        t[FULL_TP if gathered else SEQ_TP] += 2 * e * h
    if gathered:  # the wo and w2 reduce-scatter outputs (tp > 1; TorchTitan's op list saves them too)
        t[SEQ_TP] += 2 * e * h
    return t


def _stored_terms(model, workload, moe: bool, core_dropped: bool, compiled: bool,
                  saved: _Saved, rebuild: bool | None = None) -> np.ndarray:
    """`layer_activation_terms` without recomputation: norms, dropout masks, the attention's
    Q/K/V and core (unless `core_dropped`, the 'attention' policy) and the FFN's tensors."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    h = model.dim
    d_qk, d_k, d_v = attention_dims(model)
    d_o = model.n_heads * (model.v_head_dim if model.attention == "mla" else model.head_dim)
    fused = workload.attention_impl == "fused"
    lin = saved.lin                                  # a saved linear input
    drop = 1.0 if workload.dropout else 0.0          # one byte per mask element
    t = np.zeros(N_TERMS)
    col_in = FULL if workload.tp_keeps_gathered else SEQ    # where a column-parallel input lives
    t[SEQ] = 2 * _norm_saved_bytes(model, workload, compiled, e, h) + 2 * drop * h   # two norms, two dropout masks
    t[col_in] += 2 * lin * h                          # QKV and FFN inputs
    # GQA K/V expansion (``Workload.gqa_kv``): TorchTitan (repeat_kv) expands K and V to n_heads before
    # SDPA, which saves the expanded copies; the un-expanded K (after RoPE) and V are not saved (repeat's
    # backward needs no input), so they are freed.  titan-run (CoreAttention: SDPA with enable_gqa; the
    # ring's flash kernels under CP) and Megatron's fused kernels take GQA K/V as they are.  (Measured
    # with saved_tensors_hooks on llama3-debug: Q at n_heads * head_dim, K and V at n_kv_heads * head_dim
    # natively, n_heads * head_dim each expanded; tests/test_gqa_native.py.)
    if workload.gqa_kv_expanded and model.attention != "mla":
        d_k = d_v = d_o
    t[SHARD] = e * (d_qk + d_k + d_v) + saved.attn_out * d_o     # Q, K, V (RoPE applied) and out-proj input
    if model.attention == "mla":                      # the normalized latents: the up projections' inputs
        t[FULL] += lin * (model.kv_lora_rank + (model.q_lora_rank or 0))
    if fused and not core_dropped:
        # fp32 LSE kept by the SDPA kernel, and its output O.  The flash kernels (CUDA and
        # CPU) write O [b, s, heads, d]-contiguous and return it viewed as [b, heads, s, d], so
        # `out.transpose(1, 2).reshape(b, s, -1)` is a view: O *is* the out-proj input (one
        # storage, counted above) unless float8 saves a separate low-precision copy of it.
        t[SHARD] += 4.0 * model.n_heads + saved.o_copy * d_o
    elif not fused and not core_dropped:
        t[SCORE] = model.n_heads * (e + drop * (1.0 + e))  # softmax out (+ dropout mask and output)
    t[SHARD] += _ffn_terms(model, workload, moe, compiled, e, saved, rebuild).sum()
    return t


def _norm_saved_bytes(model, workload, compiled: bool, e: float, h: int) -> float:
    """Bytes per token one pre-norm keeps (see `layer_activation_terms`; `Workload.norm_impl`).

    titan-run's eager norms (``auto`` uncompiled, executor/models/layers.py) keep their input and fp32
    per-token statistics, exactly: RMSNorm (``RMSNormFunction``) the rstd, LayerNorm (``nn.LayerNorm``'s
    one aten kernel) the mean and the rstd (fp32 for 16-bit inputs on CUDA; CPU keeps them in the input
    dtype).  ``eager`` is PyTorch's composite RMSNorm as TorchTitan's ``nn.RMSNorm`` runs it."""
    if workload.norm_fused(compiled):
        return e * h                                  # fused norm: its input (+ a per-token rstd)
    if workload.norm_impl == "auto":
        return e * h + (4.0 if model.norm == "rmsnorm" else 8.0)
    if workload.dtype == "bf16":
        return 3 * e * h                              # eager: fp32 upcast (2e) + bf16 normalized (e)
    return 2 * e * h                                  # eager fp32: input and normalized output


def _ffn_terms(model, workload, moe: bool, compiled: bool, e: float, saved: _Saved,
               rebuild: bool | None = None) -> np.ndarray:
    """Bytes per token (tp-sharded) the FFN keeps: [dense FFN or routed experts' hiddens, the routed
    experts' dispatched inputs and outputs, shared experts, routed experts' activation outputs].
    The routed experts' SwiGLU inputs cost ``saved.moe_swiglu_in`` per element (fp8 under DeepSeek-V3's
    fine-grained recipe, "Inputs of the SwiGLU operator in MoE"; the shared experts, which the report does
    not name, keep the compute dtype)."""
    lin = saved.lin
    fused_mlp = workload.swiglu_fused                 # a fused SwiGLU kernel: its output is the kept fc2 input
    if rebuild is None:                               # ... unless the whole FFN is one function (fused_ffn)
        rebuild = workload.swiglu_recomputes_product  # (or titan-run's rebuilt input: `ffn_rebuilds_product`)
    if not moe:
        return np.array([sum(_saved_ffn_parts(model, model.ffn_hidden, e, lin, compiled, fused_mlp,
                                              rebuilds_product=rebuild)), 0.0, 0.0, 0.0])
    k, w = model.top_k, model.moe_ffn_hidden
    hidden, act_out = _saved_ffn_parts(model, w, e, lin, compiled, fused_mlp, gate_up=saved.moe_swiglu_in,
                                       rebuilds_product=rebuild)
    shared = (sum(_saved_ffn_parts(model, model.n_shared_experts * w, e, lin, compiled, fused_mlp,
                                   rebuilds_product=rebuild))
              if model.n_shared_experts else 0.0)
    outputs = e * model.dim if workload.moe_keeps_expert_outputs else 0.0   # kept by a weighted combine
    return np.array([k * hidden, k * (lin * model.dim + outputs), shared, k * act_out])


def _module_drops(model, workload, moe: bool, compiled: bool, saved: _Saved) -> np.ndarray:
    """What Megatron's `recompute_modules` (selective_ac 'modules') drop from the stored terms, per
    token (megatron/core/transformer: 'layernorm' and 'moe_act' and 'mla_up_proj' discard their
    outputs, 'core_attn', 'mlp', 'moe' and 'shared_experts' checkpoint the submodule, keeping its
    input, which the block keeps anyway).  'core_attn' is applied by `_stored_terms`.
    'layernorm' on MLA also recomputes the two latent norms: the kept latent is then each norm's input
    (``e`` bytes), not the up projection's (``lin``-byte) input."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    lin = saved.lin
    h = model.dim
    d = np.zeros(N_TERMS)
    ffn = _ffn_terms(model, workload, moe, compiled, e, saved)
    if workload.recomputes("layernorm"):              # the norm outputs: the QKV and FFN inputs
        d[FULL if workload.tp_keeps_gathered else SEQ] += 2 * lin * h
        if model.attention == "mla":                  # the latents' norms: their inputs are kept instead
            d[FULL] += (lin - e) * (model.kv_lora_rank + (model.q_lora_rank or 0))
    if workload.recomputes("mla_up_proj") and model.attention == "mla":
        d_qk, d_k, d_v = attention_dims(model)
        d[SHARD] += e * (d_qk + d_k + d_v)            # per-head Q, K (RoPE applied) and V
    if workload.recomputes("mlp") and not moe:
        d[SHARD] += ffn[0]
    if moe and workload.recomputes("moe"):
        d[SHARD] += ffn.sum()
    else:
        if moe and workload.recomputes("moe_act"):
            d[SHARD] += ffn[3]
        if moe and workload.recomputes("shared_experts"):
            d[SHARD] += ffn[2]
    return d


def _saved_ffn_parts(model, width: float, e: float, lin: float, compiled: bool,
                     fused_mlp: bool = False, gate_up: float | None = None,
                     rebuilds_product: bool = False) -> tuple[float, float]:
    """Bytes per token an FFN of hidden `width` keeps, as (the hidden tensors before the activation's
    output, the activation's output = the fc2 input); `lin`: bytes of a saved linear input, `gate_up`: of
    a SwiGLU input element (default `e`); `rebuilds_product`: the whole FFN is one function that keeps gate
    and up and rebuilds the product in its backward (``swiglu_impl: fused_ffn``)."""
    if model.mlp != "swiglu":                         # GeLU input, its output (= fc2 input) unless rebuilt
        return e * width, (0.0 if rebuilds_product else lin * width)
    g = e if gate_up is None else gate_up
    if rebuilds_product:                              # gate and up; the product rebuilt for fc2's weight grad
        return 2 * g * width, 0.0
    if fused_mlp:                                     # one kernel: gate and up; the product is fc2's input
        return 2 * g * width, lin * width
    if compiled:                                      # the partitioner keeps gate, up and the product (fc2's input)
        return 2 * g * width, lin * width
    return (2 * g + e) * width, lin * width           # eager: gate, up, silu(gate); the product


# `_ac_table`'s last row: what a checkpointed block's recomputed forward keeps (ac none's tensors, recomputed
# inside the checkpoint, where titan-run does not rebuild the FFN's down-projection input)
RECOMPUTED = len(AC_MODES)


def _ac_table(model, workload, moe: bool, f8_fraction: float) -> np.ndarray:
    """[ac code (or `RECOMPUTED`), compiled, float8] -> the five terms, bytes per token."""
    out = np.zeros((len(AC_MODES) + 1, 2, 2, N_TERMS))
    for a, ac in enumerate((*AC_MODES, "none")):
        for c in (0, 1):
            for f in (0, 1):
                out[a, c, f] = layer_activation_terms(model, workload, moe, ac, bool(c), f8_fraction if f else 1.0,
                                                      float8=bool(f), block_ac="full" if a == RECOMPUTED else None)
    return out


def _bytes(terms: np.ndarray, table, workload) -> np.ndarray:
    tp = table.tp.astype(np.float64)
    tokens = table.microbatch * workload.seq_len / table.cp
    sp = tp if workload.sequence_parallel else np.ones_like(tp)
    return tokens * (terms[:, SEQ] / sp + terms[:, SHARD] / tp + terms[:, SCORE] * workload.seq_len / tp
                     + terms[:, FULL] + (terms[:, FULL_TP] + terms[:, SEQ_TP] / sp) * (tp > 1))


def ffn_rebuild_rows(table, workload) -> np.ndarray:
    """[n] True where a candidate's blocks rebuild the FFN's down-projection input in backward
    (`Workload.ffn_rebuilds_product` of its AC mode, compile and float8: a lookup over the 12 combinations)."""
    lut = np.array([[[workload.ffn_rebuilds_product(ac=ac, compiled=bool(c), float8=bool(f)) for f in (0, 1)]
                     for c in (0, 1)] for ac in AC_MODES], dtype=bool)
    return lut[table.ac, table.compile.astype(int), table.float8.astype(int)]


@per_layout(BLOCK_COLUMNS)
def per_layer_activation_bytes(table, model, workload, coeffs, moe: bool) -> tuple[np.ndarray, np.ndarray]:
    """(bytes one block keeps per micro-batch, transient working set of one block's backward).

    The working set is what the block's backward re-materializes on top of what it kept
    (recomputed tensors: the no-AC footprint minus the kept one) plus the gradients of the
    block's input and output in flight (2 residual-stream tensors).
    """
    terms = _ac_table(model, workload, moe, coeffs.float8_saved_input_fraction)
    c, f = table.compile.astype(int), table.float8.astype(int)
    kept = _bytes(terms[table.ac, c, f], table, workload)
    none_code = AC_MODES.index("none")
    none = _bytes(terms[np.where(table.ac == none_code, none_code, RECOMPUTED), c, f], table, workload)
    e = 4.0 if workload.dtype == "fp32" else 2.0
    sp = table.tp if workload.sequence_parallel else 1
    grads = 2.0 * e * model.dim * table.microbatch * workload.seq_len / table.cp / sp
    # the FFN's backward holds the gradients of two hidden-width tensors at once (e.g. of the
    # SwiGLU product's factors) while freeing its own saved tensors; measured on llama3-debug
    # (fsdp, mb 8): the peak sits in the last block's FFN backward, ~15 MiB over all blocks' saved
    # tensors, vs 2 residual + 2 hidden gradients = 16 MiB.
    width = model.moe_ffn_hidden * model.top_k if moe else model.ffn_hidden
    ffn_grads = 2.0 * e * width * table.microbatch * workload.seq_len / table.cp / table.tp
    # an FFN that rebuilds its down projection's input (`Workload.ffn_rebuilds_product`) makes it again in
    # backward, one more hidden-width tensor next to those gradients (measured on llama3-debug, fp32, mb 8, 4
    # blocks with 6 MiB products: the step peak fell by 18 MiB = 4 products not kept - the one made again)
    ffn_grads = ffn_grads * np.where(ffn_rebuild_rows(table, workload), 1.5, 1.0)
    # DTensor TP with sequence parallelism: the SP -> TP all-gather's flat output lives next to the
    # cat that reorders it along the sequence dim, and in backward a row-parallel partial sum is
    # held at full size for its reduce-scatter (measured on tp 2: 4 + 2 MiB of such buffers of a
    # 2 MiB [tokens, dim] tensor at the peak): two full-size residual tensors on top.
    tp_bufs = np.where((table.tp > 1) & workload.tp_keeps_gathered & workload.sequence_parallel,
                       2.0 * e * model.dim * table.microbatch * workload.seq_len / table.cp, 0.0)
    return kept, np.maximum(none - kept, 0.0) + grads + ffn_grads + tp_bufs


# Input gradients a rank of a multi-stage schedule still holds at its activation peak when it waits each send at
# the point the schedule's program proves complete (titan-run, `pipeline_extra_bytes` ``grads_held``).
HELD_GRAD_SENDS = 2.0
HELD_GRAD_SENDS_ZBV = 3.0


@per_layout(LAYOUT_COLUMNS + ("tp", "cp", "microbatch", "n_microbatches"))
def pipeline_extra_bytes(table, model, workload, moe: bool = False) -> dict[str, np.ndarray]:
    """Per-rank bytes of pipeline mechanics that do not scale like one block's activations.

    Measured with the profiler's live allocations at the peak on llama3-debug (pp 2, CPU, torch 2.14):

    * ``boundary``: each in-flight micro-batch keeps its stage output (the last block's residual
      output, one [tokens, dim] tensor per stage chunk) in the stage's forward cache until its
      backward, on top of what the blocks save.  For pp == 1 this tensor is the final norm's input,
      counted by `head_activation_bytes`.
    * ``sends_out`` / ``sends_grad``: the multi-stage schedules (Interleaved1F1B, ZBVZeroBubble,
      DualPipeV run by torch's PipelineScheduleMulti / _PipelineScheduleRuntime) keep every P2P send's
      work -- and with it the sent activation or input gradient -- until the end of the step:
      n_microbatches residual-width tensors per direction a rank sends over P2P.  The caller multiplies
      ``sends_out`` by the rank's forward send directions (an output from each stage but the last) and
      ``sends_grad`` by its backward ones (an input gradient from each stage but the first), none across
      a V schedule's same-rank hand-over (rank pp - 1 holds stages pp - 1 and pp).  Measured with
      titan-run's profiled peak (pp 2, v 2, 8 and 16 micro-batches), torch's runtime as is: 3 per
      micro-batch on both ranks of Interleaved1F1B, 2 on both of ZBVZeroBubble and DualPipeV.
    * ``grads_held``: titan-run (``pp_sent_tensors: released``) lets a sent output go once its gradient is
      back, so the outputs are the in-flight ``boundary`` tensors, and a sent input gradient at the point of
      the schedule's program where the peer's next message shows the peer has used it
      (executor/parallel/pipeline_sends.py): at a rank's activation peak at most ``HELD_GRAD_SENDS`` of them
      are held (``HELD_GRAD_SENDS_ZBV`` under ZBVZeroBubble), read off torch 2.14's programs for pp 2-16,
      v 2-8 (tests/test_pipeline_sends.py), whatever the micro-batch count; measured, the profiled peak no
      longer grows with the micro-batch count on any schedule (bench/bench_pp_recv_memory.py).
    * ``deferred_w``: ZBVZeroBubble splits backward into I (input grad) and W (weight grad) and runs
      W late; until then each pending (chunk, micro-batch) keeps the gradients of every matmul's
      output (the dW = g^T x operands).  Their forward tensors are among the pp in-flight
      micro-batches; at the peak of the rank holding the loss stage (pp 2, v 2: 2 micro-batches of
      forward tensors and the output gradients of 1 chunk = 0.5 of the rank's layers) about
      (pp - 1) / v micro-batches' worth of output gradients are pending.
    * ``recv`` (workload ``pp_recv_buffers: persistent``, TorchTitan): torch's PipelineStage
      allocates one receive buffer per micro-batch, at the first step, and keeps it: the stage input
      of every non-first stage (``_prepare_forward_infra``: ``for chunk in range(num_microbatches)``)
      and the output gradient of every non-last stage
      (``_setup_backward_recv_info``: ``for mb_index in range(num_microbatches)``), torch 2.14
      torch/distributed/pipelining/stage.py; n_microbatches residual-width tensors per such stage and
      direction.  The caller multiplies by the rank's directions (2v, less one for holding the first
      and one for the last stage; a V hand-over's buffers are allocated too, then replaced).
      titan-run (``per_microbatch``, executor/parallel/pipeline.py) drops them once the stage has
      taken the tensor and allocates each when its receive is posted: a received activation then
      lives as the first block's saved input, a received gradient until its backward has run.
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
    torch_pp = workload.pp_keeps_sent      # workload pp_sent_tensors: kept or released (auto for fsdp2)
    held_outputs = workload.pp_keeps_sent_outputs     # kept: a multi-stage schedule holds every send to the end
    boundary = np.where(piped & torch_pp & (~multi | (not held_outputs)), v * resid, 0.0)
    sends_grad = np.where(multi & torch_pp & held_outputs, table.n_microbatches * resid, 0.0)   # per direction
    sends_out = np.where(multi & torch_pp & held_outputs, table.n_microbatches * resid, 0.0)
    held = np.where(table.is_schedule("ZBVZeroBubble"), HELD_GRAD_SENDS_ZBV, HELD_GRAD_SENDS)
    grads_held = np.where(multi & torch_pp & (not held_outputs), held * resid, 0.0)     # per rank that sends any
    out_width = 0.0 * tp
    for m in layer_matmuls(model, moe):
        mult = model.top_k if m.expert else 1.0
        out_width = out_width + mult * m.n / (tp if m.shard == COL else (1.0 if m.shard == ROW else 1.0))
    zbv = table.is_schedule("ZBVZeroBubble") & piped
    deferred_w = np.where(zbv, (pp - 1) / v * layers_per_rank(table, model, workload.pp_weighted) * e * out_width * tokens, 0.0)
    # torch's PipelineStage as TorchTitan runs it; titan-run and Megatron receive per micro-batch
    recv = np.where(piped & torch_pp & workload.pp_recv_persistent, table.n_microbatches * resid, 0.0)
    return {"boundary": boundary, "sends_out": sends_out, "sends_grad": sends_grad, "grads_held": grads_held,
            "deferred_w": deferred_w, "recv": recv}


def head_activation_bytes(table, model, workload, compiled) -> np.ndarray:
    """Bytes the loss stage keeps per in-flight micro-batch for the final norm and the LM head's
    input: what the final norm keeps (`_norm_saved_bytes`) and the head's (under DTensor TP
    all-gathered) input."""
    e = 4.0 if workload.dtype == "fp32" else 2.0
    h = model.dim
    tp = table.tp.astype(np.float64)
    sp = tp if workload.sequence_parallel else np.ones_like(tp)
    tokens = table.microbatch * workload.seq_len / table.cp
    norm_in = np.where(compiled, _norm_saved_bytes(model, workload, True, e, h),
                       _norm_saved_bytes(model, workload, False, e, h))
    head_in = e * h / (1.0 if workload.tp_keeps_gathered else sp)
    return tokens * (norm_in / sp + head_in)


def embedding_activation_bytes(table, model, workload) -> np.ndarray:
    """Bytes the rank holding the embedding keeps per in-flight micro-batch between the embedding and the
    first block: what no block's recompute covers, since the embedding is never checkpointed (DeepSpeed's
    PipelineModule checkpoints only ParallelTransformerLayerPipe chunks of a GPTModelPipe,
    deepspeed/runtime/pipe/module.py ``_is_checkpointable``; Megatron recomputes transformer layers only).

    * the embedding norm (``ModelSpec.embed_norm``, BLOOM's --embed-layernorm: ``torch.nn.LayerNorm`` on the
      all-reduced [b, s, h] embedding, Megatron-DeepSpeed megatron/mpu/layers.py VocabParallelEmbedding): its
      e-byte input and the per-token fp32 statistics (`_norm_saved_bytes` of the eager aten kernel: mean and
      rstd for a LayerNorm, rstd for an RMSNorm); its output is freed, the dropout's backward needs only the mask;
    * the embedding dropout's mask, one byte per element (``Workload.dropout``; Korthikanti et al. 2022,
      arXiv:2205.05198 Sec. 4.4: "the dropout mask of the input embeddings").
    Both are sequence-sharded under sequence parallelism (Megatron scatters the embedding output before its
    dropout).  The dropout's output is the first block's input, counted with the blocks.
    """
    e = 4.0 if workload.dtype == "fp32" else 2.0
    h = model.dim
    tp = table.tp.astype(np.float64)
    sp = tp if workload.sequence_parallel else np.ones_like(tp)
    tokens = table.microbatch * workload.seq_len / table.cp
    norm = (e * h + (8.0 if model.norm == "layernorm" else 4.0)) if model.embed_norm else 0.0
    mask = float(h) if workload.dropout else 0.0
    return tokens * (norm + mask) / sp
