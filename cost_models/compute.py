"""Per-kernel compute costs on one device: achievable rates, GEMM time, pointwise traffic,
kernel counts and the host (CPU) side of launching them.

Everything broadcasts over numpy arrays (one entry per candidate); `step_time` composes
these into per-micro-batch stage times.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .flops import COL, ROW, attention_dims, layer_matmuls
from .moe_traffic import sends_once_per_node

# Tile shapes cuBLAS/CUTLASS pick from for 16-bit tensor-core GEMMs (NVIDIA, "Matrix
# Multiplication Background User's Guide", DU-09799-001, Sec. 2.3: 256x128, 128x128, 128x64,
# 64x64, ...; skinny 32x128 / 128x32 for small m or n).  A tile's relative throughput is its data
# reuse: per k-step it loads tm+tn rows and does tm*tn MACs, so FLOPs per byte loaded ~
# tm*tn/(tm+tn) (ibid. Sec. 2.3: "larger tiles have more data reuse"); 128x128 (64) and larger
# run at the full achievable rate, smaller tiles in proportion.  (tm, tn, relative rate)
TILES = tuple((tm, tn, min(1.0, tm * tn / (tm + tn) / 64.0))
              for tm, tn in ((256, 128), (128, 128), (128, 64), (64, 64), (32, 128), (128, 32)))
# Operand alignment (ibid. Sec. 2.2, "Tensor Core Requirements": tensor-core GEMMs are most
# efficient when the leading dimensions are multiples of 16 bytes).  Ampere's asynchronous
# global->shared copies (cp.async, PTX ISA) move 4, 8 or 16 B per thread; a 16-bit operand
# whose leading dimension is odd (2-byte alignment) cannot use them and is loaded through
# registers, 2 B at a time, which halves the mainloop rate: the load rate scales with the
# access width below FULL_RATE_ACCESS_BYTES.  Observed: nanoGPT pads GPT-2's vocabulary 50257 ->
# 50304 "for efficiency" (karpathy/nanoGPT model.py, GPTConfig), which its author reported as
# a ~25% training speed-up on A100 (Feb 2023), i.e. LM-head GEMMs ~1.8x slower on the odd
# dimension; vTrain's A100 runs (unpadded vocabulary) show the head 1.5-2x slower at tp=1 too.
FULL_RATE_ACCESS_BYTES = 4.0
MIN_SPLIT_K = 256   # shallowest k slice of a split-K GEMM (elements)
# Transformer Engine's GroupedLinear (Megatron-core's TEGroupedMLP, the experts of every megatron-layout
# MoE row) runs the experts' GEMMs as one cuBLAS GEMM per expert, round-robin over a fixed pool of
# compute streams: ``multi_stream_cublas_gemm`` in transformer_engine/common/gemm/cublaslt_gemm.cu
# (``get_compute_stream(i % num_streams)``), ``num_compute_streams = 4`` in common/util/multi_stream.cpp
# (NVIDIA/TransformerEngine d0067d0; the CUTLASS single-kernel path is opt-in, bf16 only, Hopper only).
TE_GEMM_STREAMS = 4
# Per-tensor current scaling (Megatron-Bridge's "FP8-CS" recipes) quantizes each tensor with three
# kernels: amax, scale from amax, cast (Float8CurrentScalingQuantizer::quantize_impl in
# transformer_engine/pytorch/csrc/quantizer.cpp); a GroupedLinear quantizes each expert's slice on its own
# ("Currently only have fused kernel for FP8 delayed scaling ... Quantize kernels individually",
# multi_tensor_quantize_impl in pytorch/csrc/extensions/cast.cpp).
CURRENT_SCALING_KERNELS = 3


class Rates:
    """Achievable throughputs of one device (FLOP/s, B/s) for a workload and coefficients."""

    def __init__(self, hw, workload, coeffs):
        e = hw.efficiency
        fp32 = workload.dtype == "fp32"
        self.peak = (hw.peak_tflops_fp32 if fp32 else hw.peak_tflops_bf16) * 1e12
        self.gemm = self.peak * e["gemm"] * coeffs.gemm_efficiency_scale
        self.fp8 = (hw.peak_tflops_fp8 * 1e12 * e["fp8_gemm"] * coeffs.fp8_gemm_efficiency_scale
                    if hw.supports_float8 and not fp32 else self.gemm)
        self.attn = self.peak * e["attention"] * coeffs.attention_efficiency_scale
        self.mem = hw.memory_bw_gbs * 1e9 * e["memory_bound"] * coeffs.memory_bound_efficiency_scale
        self.elt = 4.0 if fp32 else 2.0
        self.sms = int(hw.sm_count or 0)                          # 0: no tile/wave quantization
        launch = coeffs.kernel_launch_s if coeffs.kernel_launch_s > 0 else hw.kernel_launch_us * 1e-6
        self.launch = launch * coeffs.host_overhead_scale                 # host seconds per kernel
        self.sharpness = float(coeffs.launch_overlap_sharpness)


def _pow2_alignment(*dims) -> np.ndarray:
    """Largest power of two (elements, capped at 8) dividing every dimension."""
    g = np.zeros(np.broadcast(*dims).shape, dtype=np.int64)
    for d in dims:
        g = np.gcd(g, np.rint(np.asarray(d, dtype=np.float64)).astype(np.int64))
    g = np.where(g > 0, g, 8)
    return np.minimum(g & -g, 8)


def gemm_time(m, k, n, rate, mem_bw, in_bytes, out_bytes, sms: int = 0, groups=1.0):
    """Time of `groups` [m,k]x[k,n] matmuls issued as one (grouped) kernel: a roofline (Williams
    et al. 2009, CACM 52(4)) of their operand traffic and their tensor-core time, which counts

    * tile and wave quantization (NVIDIA Matrix Multiplication Background Guide, Sec. 3.1-3.2):
      each output is cut into tm x tn tiles, one per SM at a time, so the kernel takes
      ceil(tiles / sms) waves of one full tile each; the cheapest of `TILES` is taken (as
      cuBLAS' heuristics do), smaller tiles at their lower reuse-bound rate; with fewer tiles
      than SMs the k loop is split (split-K) and the fp32 partials written and summed;
    * operand alignment (ibid. Sec. 2.2): a leading dimension (k or n of a row-major operand;
      m never is one) that is not a multiple of 16 B forces narrower vector loads, and below
      `FULL_RATE_ACCESS_BYTES` the loads limit the rate in proportion to their width.
    """
    m, k, n = (np.asarray(x, dtype=np.float64) for x in (m, k, n))
    flops = 2.0 * groups * m * k * n
    access = _pow2_alignment(k, n) * np.asarray(in_bytes, dtype=np.float64)
    rate = rate * np.minimum(1.0, access / FULL_RATE_ACCESS_BYTES)
    compute = flops / rate
    if sms > 0:
        best = None
        for tm, tn, rel in TILES:
            tiles = groups * np.ceil(m / tm) * np.ceil(n / tn)
            # split-K (CUTLASS "GEMM split-K parallel"): too few tiles for the SMs -> the k loop is cut
            # into `split` slices (each >= MIN_SPLIT_K deep) whose fp32 partial tiles are then summed
            split = np.clip(np.floor(sms / tiles), 1.0, np.maximum(1.0, np.floor(k / MIN_SPLIT_K)))
            waves = np.ceil(tiles * split / sms)
            t = waves * (2.0 * tm * tn * k / split) / (rate / sms * rel) + (split - 1) * groups * m * n * 8.0 / mem_bw
            best = t if best is None else np.minimum(best, t)
        compute = np.maximum(best, compute)
    traffic = groups * (in_bytes * (m * k + k * n) + out_bytes * m * n)
    return np.maximum(compute, traffic / mem_bw)


def launch_bound(gpu, host, sharpness: float):
    """Time of a kernel sequence whose GPU work is `gpu` and whose host (CPU) launch work is
    `host` (seconds, arrays).  The CPU enqueues kernels asynchronously and each kernel starts at
    max(its launch, the previous kernel's end) -- the CPU-GPU dependency model of Daydream (Zhu
    et al. 2020, USENIX ATC, Sec. 4) -- so with perfect run-ahead the slower side sets the pace,
    max(gpu, host); with no run-ahead at all every kernel pays max(its launch, its work), a sum
    over kernels.  Real loops sit between: long GEMMs let the CPU run ahead, the many short
    pointwise kernels that follow drain the queue and wait for it.  This is the smooth maximum
    (gpu^p + host^p)^(1/p) with p = `sharpness` (p -> infinity: the plain maximum); p = 4 puts
    the crossover (gpu = host) 19% above the maximum, as vTrain's A100 runs show (e.g. a GPT
    layer at h=1024, tp=1: ~3 ms host floor, ~4 ms GPU work at micro-batch 4, measured 5 ms)."""
    gpu, host = np.asarray(gpu, dtype=np.float64), np.asarray(host, dtype=np.float64)
    if not np.isfinite(sharpness):
        return np.maximum(gpu, host)
    top = np.maximum(np.maximum(gpu, host), 1e-30)
    return top * ((gpu / top) ** sharpness + (host / top) ** sharpness) ** (1.0 / sharpness)


def matmul_times(table, model, workload, coeffs, r: Rates, moe: bool) -> list[tuple]:
    """(matmul, forward time of this rank's shard of it) for each weight matmul of a block, in forward
    order (`flops.layer_matmuls`); a routed expert's entry covers the rank's local experts."""
    tp = table.tp.astype(np.float64)
    tokens = table.microbatch * workload.seq_len / table.cp
    f8 = table.float8
    out = []
    for m in layer_matmuls(model, moe):
        k = np.floor(m.k / tp) if m.shard == ROW else m.k + 0 * tp     # this rank's shard
        n = np.floor(m.n / tp) if m.shard == COL else m.n + 0 * tp
        low = f8 & (m.name != "router")
        rate = np.where(low, r.fp8, r.gemm)
        in_b = np.where(low, 1.0, r.elt)
        if m.expert:
            local = model.n_experts / table.ep
            rows = tokens * model.top_k * coeffs.ep_imbalance / local       # tokens per local expert
            t = expert_gemm_time(rows, k, n, rate, r, in_b, local, per_expert_gemms(workload))
        else:
            t = gemm_time(tokens, k, n, rate, r.mem, in_b, r.elt, r.sms)
        out.append((m, t))
    return out


def gemm_sums(mm: list[tuple], only: Callable[[str], bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(forward time of the matmuls of `matmul_times`' list `mm`, forward time of those the 'op' selective
    policy recomputes: the 2nd, 4th, ... in forward order); with `only`, of the matmuls whose name it accepts."""
    fwd, recomputed = 0.0, 0.0
    for i, (m, t) in enumerate(mm):
        if only is not None and not only(m.name):
            continue
        fwd = fwd + t
        if i % 2:
            recomputed = recomputed + t
    return fwd, recomputed


def layer_gemms(table, model, workload, coeffs, r: Rates, moe: bool,
                only: Callable[[str], bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`gemm_sums` of a block's matmuls (all of them, or those whose name `only` accepts)."""
    z = np.zeros(len(table))
    fwd, recomputed = gemm_sums(matmul_times(table, model, workload, coeffs, r, moe), only)
    return fwd + z, recomputed + z


def per_expert_gemms(workload) -> bool:
    """True when the routed experts run as one GEMM kernel per expert (Transformer Engine's GroupedLinear:
    the megatron layout, whose MoE rows are Megatron-core's TEGroupedMLP), False when they run as one grouped
    kernel per weight (``torch._grouped_mm``: titan-run's executor/models/moe.py, TorchTitan)."""
    return workload.state_layout == "megatron"


def expert_gemm_time(rows, k, n, rate, r: Rates, in_bytes, local, per_expert: bool):
    """Time of one expert weight's GEMMs over the `local` experts of a rank, `rows` tokens each: one grouped
    kernel whose tiles share the waves, or (`per_expert`) one cuBLAS GEMM per expert issued round-robin over
    `TE_GEMM_STREAMS` streams, so at most that many share the SMs: full rounds of `TE_GEMM_STREAMS`
    concurrent GEMMs and a last round of the rest, each round quantized into waves on its own."""
    if not per_expert:
        return gemm_time(rows, k, n, rate, r.mem, in_bytes, r.elt, r.sms, groups=local)
    local = np.asarray(local, dtype=np.float64)
    s = float(TE_GEMM_STREAMS)
    full = np.floor(local / s)
    rest = local - full * s
    t_full = gemm_time(rows, k, n, rate, r.mem, in_bytes, r.elt, r.sms, groups=np.minimum(local, s))
    t_rest = gemm_time(rows, k, n, rate, r.mem, in_bytes, r.elt, r.sms, groups=np.maximum(rest, 1.0))
    return np.where(local <= s, t_full, full * t_full + np.where(rest > 0, t_rest, 0.0))


def expert_kernels(table, model, workload, moe: bool) -> np.ndarray:
    """[n] kernels one MoE block launches in forward on top of `kernels_per_block` (which counts the routed
    experts as one grouped GEMM per weight), in the model's convention that backward launches twice the
    forward's kernels.

    Per-expert GEMMs (`per_expert_gemms`): a SwiGLU expert MLP is two GroupedLinears in Megatron (fc1, gate
    and up fused; fc2), each one GEMM per local expert forward and a dgrad plus a wgrad GEMM per expert
    backward: 2 x local forward instead of the 3 counted (2 x local - 2 for a two-matmul MLP), and the
    2x backward rule then gives the 4 x local backward GEMMs exactly.  Under float8 each expert's fc1 and
    fc2 inputs (forward) and output gradients (backward) are quantized on their own, `CURRENT_SCALING_KERNELS`
    each: 6 x local forward and 6 x local backward, which enter as 4 x local forward kernels so that the
    step's count, forward plus twice that, is exact (12 x local).  None for one grouped kernel per weight."""
    if not (moe and model.is_moe and per_expert_gemms(workload)):
        return np.zeros(len(table))
    local = model.n_experts / table.ep.astype(np.float64)
    counted = float(sum(1 for m in layer_matmuls(model, True) if m.expert))
    gemms = 2.0 * local - counted
    per_pass = 2.0 * CURRENT_SCALING_KERNELS * local          # two quantized tensors per expert and pass
    quant = np.where(table.float8, 2.0 * per_pass / 3.0, 0.0)   # forward + 2 x this = the two passes
    return gemms + quant


def elementwise_bytes(model, workload, moe: bool, compiled: bool) -> tuple[float, float]:
    """Memory traffic of the non-matmul ops of one block forward, bytes per token: (seq, shard).

    Eager counts each op's reads and writes: TorchTitan's fp32 RMSNorm (upcast, pow, mean,
    mul, downcast, weight: ~36 B/element in bf16), complex-fp32 RoPE on Q and K, the
    residual adds, SiLU and the gate product, the transpose copy of the attention output.
    Compiled (or hand-fused, as in Megatron) kernels read their inputs and write their
    outputs once (norm fused with the residual add, fused SwiGLU/RoPE).  Backward moves
    about twice the forward traffic.
    """
    e = 4.0 if workload.dtype == "fp32" else 2.0
    h = model.dim
    d_qk, d_k, _ = attention_dims(model)
    d_o = model.n_heads * (model.v_head_dim if model.attention == "mla" else model.head_dim)
    drop = 3.0 * (2 * e + 1) if workload.dropout else 0.0
    if moe:
        width = model.top_k * model.moe_ffn_hidden + model.n_shared_experts * model.moe_ffn_hidden
        permute = model.top_k * 4 * e * h              # gather to experts and scatter back
    else:
        width, permute = model.ffn_hidden, 0.0
    act = (5 * e if model.mlp == "swiglu" else 2 * e) if not compiled else (3 * e if model.mlp == "swiglu" else 2 * e)
    if not compiled:
        norms = 2 * (36.0 if e == 2 else 28.0)
        seq = (norms + 6 * e + drop) * h
        shard = (16 + 2 * e) * (d_qk + d_k) + 2 * e * d_o + act * width + permute
    else:
        seq = (10 * e + (drop / 3 if drop else 0.0)) * h
        shard = 2 * e * (d_qk + d_k) + act * width + permute
    return seq, shard


def ep_regroup_bytes(table, model, workload, moe: bool) -> np.ndarray:
    """[n] Extra memory traffic per token of one MoE block forward when expert parallelism hands a rank its
    tokens grouped by source rank: the received top_k copies are regrouped by local expert before the
    experts and put back before the combine (a gather and a scatter, each reading and writing the copy:
    4 e h per copy).  This executor's ``ExpertParallelExperts`` (``x_recv[perm]``, ``index_copy_``),
    TorchTitan's ``_permute`` / ``_unpermute`` and Megatron-core's ``alltoall`` dispatcher
    (``sort_chunks_by_idxs`` both ways) do it whenever a rank holds more than one expert; the per-node
    dispatch (DeepEP, HybridEP: Megatron's ``flex``) permutes once after the dispatch, which is
    `elementwise_bytes`' own pass.  Backward moves twice this, as the other pointwise traffic."""
    if not (moe and model.is_moe):
        return np.zeros(len(table))
    e = 4.0 if workload.dtype == "fp32" else 2.0
    ep = table.ep.astype(np.float64)
    regroups = (ep > 1) & (model.n_experts / ep > 1) & (not sends_once_per_node(model, workload))
    return np.where(regroups, model.top_k * 4 * e * model.dim, 0.0)


def kernels_per_block(model, workload, moe: bool, compiled: bool) -> float:
    """Kernels one block launches in forward (backward launches about twice as many).

    Matmuls (one per weight; routed experts as one grouped GEMM per weight -- the per-expert kernels of
    Transformer Engine's GroupedLinear are `expert_kernels`, added per candidate), the attention
    core (1 fused kernel, or QK^T, softmax, [dropout,] PV when materialized), and the
    pointwise ops: eager TorchTitan-style code issues ~30 (fp32 RMSNorm ~8 each, complex
    RoPE ~6 per tensor, SwiGLU, residual adds, layout copies), compiled/fused code ~6.
    An MoE block adds routing (gate softmax/top-k, sort, histogram, gather/scatter: ~12).
    """
    mm = layer_matmuls(model, moe)
    n = len({m.name for m in mm})
    n += 1 if workload.attention_impl == "fused" else (4 if workload.dropout else 3)
    n += 6.0 if compiled else 30.0
    n += 3.0 if workload.dropout else 0.0
    n += 12.0 if moe else 0.0
    return float(n)


def float8_cast_bytes(model, moe: bool, compiled, e: float):
    """Extra traffic of tensorwise float8 training per token of one block, forward share (the
    backward's 2x is applied with the other pointwise traffic): each linear's input is scaled
    and cast forward (amax read, read, 1-byte write), its output gradient and input again
    backward (Micikevicius et al. 2022, arXiv:2209.05433, Sec. 4: per-tensor scaling).
    Compiled code fuses the amax into the producer (one read fewer)."""
    per = np.where(compiled, e + 1.0, 2 * e + 1.0)
    width = 0.0
    for m in layer_matmuls(model, moe):
        if m.name == "router":
            continue
        width += (model.top_k if m.expert else 1.0) * (m.k + m.n + m.k) / 3.0
    return per * width


def head_kernels(workload) -> float:
    """Kernels of the per-micro-batch work outside the blocks, forward (backward ~2x): embedding
    lookup, final norm and LM head (3; GPT models add the learned position embedding, its add and
    dropout: 3), and the fp32 cross-entropy, eager in this executor and in Megatron (upcast, max,
    subtract, exp, sum, log, gather, mean: 8; vocabulary-parallel, with their all-reduces)."""
    return 3.0 + (3.0 if workload.dropout else 0.0) + 8.0
