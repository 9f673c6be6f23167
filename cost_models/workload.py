"""The workload: what is trained per step, and the training code's activation regime.

A data spec like the model and hardware specs (``specs.py``), checked by the typed reader
(:func:`search_spaces.typed.check_fields`); plan files carry it under ``workload:``.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from search_spaces.typed import check_fields

from .specs import _COUNT, _POSITIVE, SpecError

# Megatron-core's selective-recompute submodules (TransformerConfig.recompute_modules)
RECOMPUTE_MODULES = Literal["core_attn", "layernorm", "mla_up_proj", "mlp", "moe_act", "moe", "shared_experts"]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained per step: sequence length and global batch (sequences).

    ``state_layout`` says how parameters, gradients and optimizer states are
    held: ``fsdp2`` (this project's executor: fp32 master parameters,
    gradients and AdamW moments, all sharded over the FSDP ranks, with bf16
    copies gathered per block) or ``megatron`` (bf16 parameters, fp32 main
    gradients and parameters, AdamW moments: 18 bytes per parameter, replicated
    over data parallel unless ``zero`` >= 1 shards the optimizer).

    The last four keys describe the training code's activation regime; the defaults are
    this project's executor (TorchTitan-style).  They exist so that published runs of other
    frameworks can be expressed: ``attention_impl: materialized`` keeps the s x s softmax
    scores (Megatron-LM without flash attention; the 5as/h term of Korthikanti et al.
    2022), ``dropout`` keeps dropout masks, ``sequence_parallel: false`` replicates the
    norm/dropout activations over TP ranks (Korthikanti Table 2, "tensor parallel"), and
    ``selective_ac`` says what ``ac: selective`` keeps: ``matmul`` (every matmul, attention and
    collective output; pointwise ops are recomputed), ``op`` (TorchTitan's per-op policy: every
    other matmul output, the attention outputs and the reduce-scatters) -- titan-run runs both;
    ``auto`` (the default) is ``matmul``, or ``op`` where `titan-plan` (search and estimate) finds
    that only it lets a faster layout fit (`selective_policy`) -- or
    ``attention`` (Megatron: recompute the attention core only, Korthikanti Sec. 4.3) or
    ``modules`` (Megatron-core's ``recompute_granularity: selective`` with the submodules named by
    ``recompute_modules``; see below).

    ``recompute_modules`` (with ``selective_ac: modules``) lists Megatron-core's selective-recompute
    submodules (TransformerConfig.recompute_modules, megatron/core/transformer/transformer_config.py):
    ``core_attn`` (the attention core, Megatron's default), ``layernorm`` (the two pre-norms'
    outputs are discarded and recomputed from their inputs), ``mla_up_proj`` (MLA's up projections and
    RoPE: the per-head Q, K and V are recomputed from the kept low-rank latents), ``mlp`` (a dense
    block's whole FFN, keeping its input), ``moe_act`` (the experts' activation output, the expert
    down projection's input), ``moe`` (the whole MoE layer: router, dispatch, experts and combine,
    keeping its input) and ``shared_experts`` (the shared experts' FFN).  NeMo and Megatron-Bridge
    recipes set them per model (e.g. DeepSeek-V3 on 1,024 H100: ``mla_up_proj`` and ``mlp``).

    ``tp_activations`` is what a tensor-parallel block keeps of the tensors its collectives move:
    ``gathered`` (DTensor-style TP as in TorchTitan and this executor: a column-parallel matmul keeps
    its all-gathered input, a row-parallel one its full-size partial sum) or ``sharded`` (Megatron's
    sequence parallelism, Korthikanti et al. 2022 Sec. 4.2.2: the sequence shard is kept and the
    all-gather is run again in backward); ``auto`` is ``gathered`` for fsdp2 and ``sharded`` for
    megatron.
    ``norm_impl`` is the norm kernel: ``eager`` (PyTorch ops: the fp32 upcast and the normalized
    output are kept, 3x the bf16 width in bf16) or ``fused`` (one kernel keeping its input and a
    per-token rstd: Apex/TE, Triton -- e.g. TorchTitan's ``norm_type = "fused_rmsnorm"`` of 2024 --
    or a compiled block); ``auto`` is fused when the plan compiles, else titan-run's own eager norm
    (an autograd Function keeping its input and the per-token fp32 rstd, executor/models/layers.py);
    ``composite`` is PyTorch's ``nn.RMSNorm`` / ``nn.LayerNorm`` as TorchTitan runs them: fused by
    Inductor when the plan compiles, else ``eager``.

    ``ep_a2a_overlap`` is whether the MoE dispatch and combine all-to-alls run under compute:
    ``none`` (this executor, and Megatron by default: each all-to-all sits on the critical path) or
    ``combined_1f1b`` (Megatron-core's ``overlap_moe_expert_parallel_comm`` with
    ``delay_wgrad_compute``, as Megatron-Bridge's performance recipes set it for some MoE models: the
    forward of one micro-batch and the backward of another run layer by layer together, and each
    all-to-all of one hides under a computation of the other,
    megatron/core/models/common/model_chunk_schedule_plan.py ``schedule_layer_1f1b``).  Megatron runs
    it only with EP > 1, an interleaved pipeline when pp > 1, no full recompute and no ``moe`` in
    ``recompute_modules``; a candidate outside those keeps its all-to-alls exposed.

    ``moe_weighting`` is where a MoE block multiplies the expert outputs by the router's weights:
    ``combine`` (this executor, TorchTitan, and Megatron-core before its "memory efficient token
    permutation", megatron-lm commit 2659630, April 2025: the weighted sum at the combine keeps every
    routed expert output, [tokens * top_k, dim], for the weights' gradient) or ``activation`` (Megatron-
    core since that commit, core_r0.13 on: the permuted weights are multiplied into the experts'
    activation, ``activation_func_with_probs``, so the un-permute keeps nothing); ``auto`` is
    ``activation`` for the megatron layout and ``combine`` for fsdp2.

    ``ep_dispatch`` is how the EP dispatch and combine reach experts on other nodes: ``every_copy`` (an
    all-to-all of the top_k routed copies of each token: this executor, TorchTitan's default, Megatron's
    ``alltoall`` dispatcher) or ``per_node`` (DeepEP / Hybrid-EP, Megatron's ``flex`` dispatcher: a token
    crosses the network once per distinct remote node holding one of its experts, then fans out over
    NVLink; the combine reduces per node before the network); ``auto`` is ``every_copy`` for fsdp2 and, for
    megatron, ``per_node`` exactly when the model routes node-limited (``cost_models/moe_traffic.py``,
    ``sends_once_per_node``, which cites the kernels).

    ``pp_sent_tensors`` is what the pipeline runtime does with the tensors a stage has sent: ``kept``
    (torch.distributed.pipelining as TorchTitan runs it: a stage output stays in the stage's forward cache
    until its backward, and the multi-stage schedules keep every P2P send's work -- with the sent
    activation or input gradient -- until the end of the step), ``released`` (titan-run: the same
    runtime, but a sent stage output is let go once its gradient has come back, and a sent input gradient
    once the peer's next message shows the peer has used it, a point read off the schedule's program:
    executor/parallel/pipeline.py ``_releasing_sent_outputs``, pipeline_sends.py) or
    ``freed`` (Megatron-core's ``deallocate_output_tensor`` under ``deallocate_pipeline_outputs``,
    megatron/core/pipeline_parallel/schedules.py: a sent output's data is freed and sends are waited per
    micro-batch; the Llama 3 paper, arXiv:2407.21783 Sec. 3.3.2: "we proactively deallocate ... the input
    and output tensors of each pipeline stage"); ``auto`` is ``released`` for fsdp2 and ``freed``
    for megatron.
    ``pp_recv_buffers`` is how long a pipeline stage keeps the tensors it receives into: ``persistent``
    (torch's PipelineStage allocates one buffer per micro-batch and direction at the first step and keeps
    all of them for the stage's life: TorchTitan) or ``per_microbatch`` (a micro-batch's buffer is
    allocated when its receive is posted and dropped once the stage has taken it: titan-run, Megatron's
    fresh tensors per micro-batch); ``auto`` is ``per_microbatch``.
    ``pp_grad_sync`` is when the data-parallel gradient reduction runs under a pipeline (pp > 1):
    ``last_microbatch`` (torch.distributed.pipelining defers FSDP's reduce-scatter to the last micro-batch,
    so the fsdp2 layout accumulates unsharded fp32 gradients and keeps the parameters gathered; Megatron
    reduces its gradient buffer once per step) or ``every_microbatch`` (FSDP reduce-scatters each
    micro-batch's gradients into the shard, as without a pipeline: the Llama 3 paper, Sec. 3.3.2, "our use
    of FSDP ... shards optimizer states and gradients"; fsdp2 layout only); ``auto`` is ``last_microbatch``
    where titan-run runs it, and what ``titan-plan`` and ``titan-plan estimate`` may set to ``every_microbatch``
    when that makes a faster layout fit (as they do for ``tp_activations``).

    ``pp_split`` is how the layers are cut into pipeline stages (`cost_models.layout.stage_layer_counts`,
    the one split of the cost model and the executor): ``layers`` (the layers as even as possible, the
    earlier stages larger: titan-run's default, Megatron-LM's) or ``weighted`` (the embedding and the LM
    head count as one layer each, so the end stages hold a layer fewer: DeepSpeed's ``partition_method:
    type:transformer|embedding``, BLOOM's runs; Megatron-LM's ``--account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split``; TorchTitan's ``input_weight`` / ``output_weight``; the Llama 3
    paper, arXiv:2407.21783 Sec. 3.3.2, "reducing one Transformer layer each from the first and the last
    stages").

    ``tp_comm_overlap`` and ``dp_comm_overlap`` say whether a run hides its tensor-parallel and its
    data-parallel collectives under compute, as a framework's switches do: ``none`` (on the critical path:
    plain TP, titan-run and TorchTitan without async TP; Megatron with ``overlap_grad_reduce`` /
    ``overlap_param_gather`` off, DeepSpeed's pipeline engine, whose ``ReduceGrads`` is its own
    instruction), ``full`` (as far as the concurrent compute reaches: Megatron's ``tp_comm_overlap``
    userbuffers pipelining each TP collective with its matmul; FSDP2's prefetched all-gathers and
    reduce-scatters, Megatron's overlapped bucket reduction), for TP also ``async`` (TorchTitan's async TP:
    torch's ``micro_pipeline_tp`` pass fuses only an all-gather feeding matmuls and a reduce-scatter fed by
    one matmul, ``step_time._tp_exposed``) or ``auto`` (the coefficients' ``tp_overlap`` /
    ``dp_overlap``: a framework regime's or a calibration file's value, by default none for TP and full
    for DP; TP under the megatron layout on Hopper or later GPUs is full, :meth:`tp_overlap_auto`).
    Either way what stays exposed is max(0, collective - concurrent compute), per block
    (``step_time.py``, ``data_parallel.py``); :meth:`with_overlaps` applies them.

    ``moment_dtype`` is the dtype of AdamW's two moments (exp_avg, exp_avg_sq): ``fp32`` (this executor,
    torch's AdamW on fp32 master parameters, Megatron's default) or ``bf16`` (DeepSeek-V3, arXiv:2412.19437
    Sec. 3.3.3: "We adopt the BF16 data format instead of FP32 to track the first and second moments in the
    AdamW optimizer ... the master weights ... and gradients ... are still retained in FP32"; Megatron-core's
    ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype bf16``): 4 instead of 8 optimizer bytes per parameter, the
    master copy unchanged.
    ``master_dtype`` is the megatron layout's optimizer copy of the parameters (its shard under ZeRO >= 1):
    ``fp32`` (Megatron-LM's distributed optimizer, DeepSpeed) or ``bf16`` (no fp32 copy: the optimizer keeps its
    parameter shard in the bf16 of the model -- Apex's DistributedFusedAdam with ``dtype`` bf16, as NeMo's
    ``optim: {name: distributed_fused_adam, dtype: bf16}`` configures it, e.g. NVIDIA's DGX Cloud Nemotron-4
    340B benchmark; Megatron-core's ``--main-params-dtype``): 2 instead of 4 optimizer bytes per parameter.
    ``expert_tp`` is how a MoE layer's routed experts use tensor parallelism: ``tp`` (each expert's weights split
    over the TP group like a dense FFN's: Megatron-core's default, ``expert_tensor_parallel_size`` = TP, the only
    choice before Megatron-core 0.10) or ``1`` (whole experts on every TP rank, Megatron's
    ``expert_tensor_parallel_size 1`` as Megatron-Bridge's DeepSeek-V3 and Qwen3 recipes set it: the expert
    weights and gradients a rank holds are TP times larger, their optimizer shard the same, and no gather); ``auto``
    is ``tp`` for the megatron layout and ``1`` for fsdp2, where titan-run keeps the whole MoE layer (router, routed
    and shared experts) on every TP rank and runs it on the sequence-parallel tokens.  Under the megatron layout
    with TP > 1 and sequence parallelism, split experts cost Megatron's alltoall dispatcher a TP all-gather of the routed tokens after the all-to-all and a reduce-scatter of the
    experts' output before the way back (top_k x tokens x hidden each; the mirror pair backward), serial with the
    expert GEMMs (megatron/core/transformer/moe/token_dispatcher.py, ``gather_from_sequence_parallel_region`` /
    ``reduce_scatter_to_sequence_parallel_region`` on the TP group), outside Transformer Engine's userbuffer
    overlap.
    ``float8_cache`` is what float8 linears keep for backward (read only with float8 on): ``auto`` (resolved
    by the state layout, :attr:`float8_cache_mode`: for fsdp2 the coefficients' ``float8_saved_input_fraction``,
    by default torchao's tensorwise Float8Linear, which keeps the high-precision input -- titan-run; for
    megatron ``fp8``, Transformer Engine's), ``fp8`` (each linear keeps its 1-byte fp8 input, the attention
    kernel its own output next to the out-projection's fp8 copy: Transformer Engine, whose ``_Linear`` saves
    the fp8 cast of its input or its fp8 transpose for the weight gradient, transformer_engine/pytorch/module/
    linear.py ``saved_inputmat`` / ``saved_inputmat_t``, unless the recipe overrides wgrad precision) or ``fine_grained`` (DeepSeek-V3's
    recipe, Sec. 3.3.3 "Low-Precision Activation": linear inputs cached in fp8 with one fp32 scale per 1x128
    tile; the input of the linear after attention cached once, in E5M6 (1.5 bytes), for both that linear's
    and the attention's backward; the inputs of the MoE experts' SwiGLU cached in fp8).

    ``swiglu_impl`` is the SwiGLU kernel, which sets what an FFN keeps of ``silu(gate) * up``: ``eager``
    (autograd of the plain code: silu keeps gate, the product keeps silu(gate) and up, the down projection
    keeps the product: 4 tensors of width ffn_hidden; a compiled block's partitioner keeps gate and up only
    and recomputes the rest: 2) or ``fused`` (one activation kernel keeping its inputs gate and up, its
    output being the down projection's kept input: 3, compiled or not -- Megatron's bias-SwiGLU
    ``bias_swiglu_impl``, Transformer Engine's, Liger's ``LigerSiLUMulFunction``) or ``fused_ffn`` (one
    autograd function over the whole FFN, gate/up GEMM, activation and down GEMM, which keeps gate and up and
    recomputes the product in its backward for the down projection's weight gradient: 2, compiled or not --
    xformers' ``SwiGLU`` op, whose ``_SwiGLUFusedFunc`` saves the input, gate and up and rebuilds the product
    in ``silu_bw_fused``; LLaMA 1's hand-written backward, arXiv:2302.13971 Sec. 2.4); ``auto`` is ``fused``:
    Megatron's kernel for the megatron layout, titan-run's own autograd Function for fsdp2
    (executor/models/layers.py ``swiglu``; TorchTitan runs the plain code: its regime sets ``eager``), and for
    fsdp2 blocks neither checkpointed nor compiled what ``fused_ffn`` keeps: titan-run's down projection saves
    its input as a recipe rebuilt from gate and up in backward (``rebuilt_input``; a GELU FFN's output from the
    GELU input likewise), `ffn_rebuilds_product`.
    ``gqa_kv`` is how the attention kernel takes grouped-query K and V (models with fewer kv heads than
    heads): ``expanded`` (TorchTitan repeats K and V to n_heads before SDPA, ``repeat_kv``, which saves
    the expanded copies) or ``native`` (the kernel reads the kv heads as they are and keeps K and V at
    n_kv_heads width: titan-run's SDPA with ``enable_gqa`` and its ring attention, flash-attn, cuDNN and
    Transformer Engine attention, hence Megatron); ``auto`` is ``native`` for both layouts.

    ``grad_dtype`` is the megatron layout's main-gradient buffer: ``fp32`` (Megatron-LM, which
    accumulates and reduces a bf16 run's gradients in fp32) or ``bf16`` (NeMo's and
    Megatron-Bridge's performance recipes: ``grad_reduce_in_fp32=False``); it sets the gradient
    bytes per parameter and the data-parallel reduction's bytes.  ``auto`` (not stated) is held as
    ``fp32`` here; `titan-plan estimate` of a bf16 megatron layout compares both and takes bf16 when
    fp32 main gradients do not fit and bf16 ones do, saying so (``planner/whatif.py``,
    ``workload_variants``), as it does for an unstated ``ac``.  The fsdp2 layout's gradients follow
    its fp32 master parameters, so there it must stay ``fp32`` (or ``auto``).
    ``loss_impl`` is the cross-entropy: ``eager`` (``F.cross_entropy`` on fp32-upcast logits, keeping
    the fp32 log-softmax, its gradient and the input gradient at the turn), ``compiled`` (the same
    code compiled by Inductor with the model when the plan compiles at tp 1, else eager: TorchTitan
    since 2025-04) or ``fused`` (a fused or chunked kernel -- Megatron's cross_entropy_loss_fusion,
    flash-attn's / Liger's, a compiled loss -- keeping the logits and per-token statistics, the
    gradient written in the logits' dtype); ``auto`` is, for fsdp2, this executor's choice per
    candidate: compiled with compile at tp 1, else its fused autograd Function at tp 1
    (executor/parallel/fused_loss.py), else (vocab-sharded logits, tp > 1) the eager figure
    (``memory.loss_fused``; :attr:`loss_mode` gives the tp > 1 one), and ``fused`` for megatron,
    whose vocab-parallel cross-entropy (also the unfused one) works in place on one fp32 copy of the
    logits: exp, softmax and the input gradient reuse its storage
    (megatron/core/tensor_parallel/cross_entropy.py), 4 bytes per logit as a fused bf16 kernel's 2 + 2.
    ``grad_accum`` is how a micro-batch's weight gradients join the step's: ``autograd`` (PyTorch's
    AccumulateGrad, ``grad += g`` after the first micro-batch: this executor, TorchTitan, FSDP),
    ``fused`` (the weight-gradient GEMM accumulates into the main-gradient buffer: Megatron's
    gradient_accumulation_fusion, no extra pass) or ``hp_copy`` (DeepSpeed's BF16 optimizer: after
    every micro-batch's backward the pipeline engine adds the bf16 gradients into fp32 copies,
    ``update_hp_grads``); ``auto`` is ``autograd`` for fsdp2 and ``fused`` for megatron.
    """

    seq_len: int = field(metadata=_POSITIVE)
    global_batch: int = field(metadata=_POSITIVE)            # sequences per optimizer step
    dtype: Literal["bf16", "fp32"] = "bf16"                   # compute dtype
    state_layout: Literal["fsdp2", "megatron"] = "fsdp2"
    zero: int = field(default=3, metadata=_COUNT)             # megatron layout: 0 nothing sharded, 1 optimizer sharded
    attention_impl: Literal["fused", "materialized"] = "fused"   # fused: flash / SDPA
    dropout: bool = False
    sequence_parallel: bool = True                            # with tp > 1
    selective_ac: Literal["auto", "matmul", "op", "attention", "modules"] = "auto"
    recompute_modules: tuple[Literal[RECOMPUTE_MODULES], ...] = ("core_attn",)   # with selective_ac: modules
    tp_activations: Literal["auto", "gathered", "sharded"] = "auto"   # what TP blocks keep of gathered tensors
    ep_a2a_overlap: Literal["none", "combined_1f1b"] = "none"   # MoE all-to-alls under the other micro-batch
    moe_weighting: Literal["auto", "combine", "activation"] = "auto"   # where router weights multiply
    ep_dispatch: Literal["auto", "every_copy", "per_node"] = "auto"   # how EP tokens cross nodes
    norm_impl: Literal["auto", "eager", "fused", "composite"] = "auto"     # the RMSNorm/LayerNorm kernel
    swiglu_impl: Literal["auto", "eager", "fused", "fused_ffn"] = "auto"   # the SwiGLU activation kernel
    gqa_kv: Literal["auto", "expanded", "native"] = "auto"    # GQA K/V: repeated to n_heads, or as they are
    grad_dtype: Literal["auto", "fp32", "bf16"] = "auto"              # megatron layout: main gradients
    moment_dtype: Literal["fp32", "bf16"] = "fp32"            # AdamW's exp_avg and exp_avg_sq
    master_dtype: Literal["fp32", "bf16"] = "fp32"            # megatron layout: the optimizer's parameter copy
    expert_tp: Literal["auto", "tp", "1"] = "auto"            # MoE: experts split over TP (tp) or whole (1)
    float8_cache: Literal["auto", "fp8", "fine_grained"] = "auto"   # what float8 linears keep for backward
    loss_impl: Literal["auto", "eager", "compiled", "fused"] = "auto"     # cross-entropy kernel
    grad_accum: Literal["auto", "autograd", "fused", "hp_copy"] = "auto"   # per-micro-batch gradient pass
    pp_sent_tensors: Literal["auto", "kept", "released", "freed"] = "auto"   # pipeline: sent tensors
    pp_recv_buffers: Literal["auto", "persistent", "per_microbatch"] = "auto"   # pipeline: receive buffers
    pp_grad_sync: Literal["auto", "last_microbatch", "every_microbatch"] = "auto"   # pipeline: DP grad sync
    pp_split: Literal["layers", "weighted"] = "layers"        # pipeline: how layers are cut into stages
    tp_comm_overlap: Literal["auto", "none", "full", "async"] = "auto"   # TP collectives under their matmuls
    dp_comm_overlap: Literal["auto", "none", "full"] = "auto"   # DP/FSDP collectives under compute

    def __post_init__(self) -> None:
        check_fields(self, where="workload", error=SpecError)
        if self.grad_dtype == "bf16" and self.state_layout != "megatron":
            raise SpecError(f"workload key 'grad_dtype' is {self.grad_dtype!r} with state_layout "
                            f"{self.state_layout!r}: only the megatron layout holds bf16 gradients (allowed: auto, fp32)")
        if self.master_dtype != "fp32" and self.state_layout != "megatron":
            raise SpecError(f"workload key 'master_dtype' is {self.master_dtype!r} with state_layout "
                            f"{self.state_layout!r}: fsdp2's parameters are the fp32 master copy (allowed: fp32)")
        if self.pp_grad_sync == "every_microbatch" and self.state_layout != "fsdp2":
            raise SpecError(f"workload key 'pp_grad_sync' is {self.pp_grad_sync!r} with state_layout "
                            f"{self.state_layout!r}: the megatron layout reduces its gradient buffer once per step "
                            "(allowed: auto, last_microbatch)")
        if self.selective_ac != "modules" and tuple(self.recompute_modules) != ("core_attn",):
            raise SpecError(f"workload key 'recompute_modules' is {list(self.recompute_modules)} with selective_ac "
                            f"{self.selective_ac!r}: the list is read only with selective_ac 'modules'")
        if not self.recompute_modules:
            raise SpecError("workload key 'recompute_modules' is empty: name at least one module (allowed: "
                            + ", ".join(typing.get_args(RECOMPUTE_MODULES)) + ")")

    @property
    def grad_elem_bytes(self) -> float:
        """Bytes per gradient element the optimizer's gradients are held and reduced in: the megatron
        layout's ``grad_dtype``; fsdp2 keeps fp32 gradients (its master parameters are fp32)."""
        return 2.0 if self.state_layout == "megatron" and self.grad_dtype == "bf16" else 4.0

    @property
    def experts_tp_split(self) -> bool:
        """``expert_tp`` with ``auto`` resolved by the state layout: True when the routed experts' weights are split
        over TP (megatron: Megatron-core's default), False when whole (fsdp2: titan-run)."""
        if self.expert_tp == "auto":
            return self.state_layout == "megatron"
        return self.expert_tp == "tp"

    @property
    def ep_stride_tp(self) -> bool:
        """Whether an EP group's ranks are tp apart (experts split over TP, and titan-run, which carves ep out of
        dp_shard x cp) rather than adjacent: Megatron-core orders its expert ranks tp-cp-ep-dp-pp with the expert
        TP size in the tp slot (parallel_state's expert RankGenerator), so whole experts put an EP group on
        consecutive ranks, across the TP ranks first."""
        return self.state_layout != "megatron" or self.experts_tp_split

    def for_expert_layout(self, ep: int, fsdp_size: int, tp: int) -> tuple["Workload", str | None]:
        """This workload for a plan whose ``ep`` does not divide dp_shard*cp (``fsdp_size``): Megatron-core folds
        the expert layer over all of a stage's tp x cp x dp ranks (constraints.EP_FOLD), which needs whole experts
        (expert_tensor_parallel_size 1: with experts split over TP an EP group is tp ranks apart and stays within
        dp x cp).  Returns (workload, note): an unstated ``expert_tp`` becomes ``1`` with a note; a stated ``tp``
        and the fsdp2 layout (titan-run carves ep out of dp_shard x cp) are refused in one line.  Unchanged, with
        no note, where ep divides dp_shard*cp."""
        if ep <= 1 or fsdp_size % ep == 0:
            return self, None
        if self.state_layout != "megatron":
            raise SpecError(f"plan key 'ep' ({ep}) does not divide dp_shard*cp ({fsdp_size}): expert parallelism "
                            f"folded over the TP ranks is Megatron-core's layout; set workload key 'state_layout' "
                            f"to megatron (with expert_tp 1), or an ep that divides {fsdp_size}")
        if self.expert_tp == "tp":
            raise SpecError(f"plan key 'ep' ({ep}) does not divide dp_shard*cp ({fsdp_size}): with experts split "
                            f"over TP (workload key 'expert_tp' tp) an EP group stays within dp x cp; set "
                            f"expert_tp 1 (Megatron's expert_tensor_parallel_size 1) to fold it over the TP ranks")
        note = None
        wl = self
        if self.expert_tp == "auto":
            wl = dataclasses.replace(self, expert_tp="1")
            note = (f"expert_tp not given: '1', the only Megatron-core layout with ep {ep} over dp*cp {fsdp_size} x "
                    f"tp {tp} (expert parallelism folded over the TP ranks needs whole experts)")
        return wl, note

    @property
    def moe_ffn_tp_split(self) -> bool:
        """Whether a MoE block's router and shared experts are split over TP like a dense FFN (Megatron-core, and
        any layout with ``expert_tp: tp``), or whole on every TP rank with the routed experts: titan-run runs the
        MoE layer on its sequence-parallel tokens with router, routed and shared experts replicated over TP
        (executor/parallel/tensor_parallel.py), no TP collective in it."""
        return self.state_layout == "megatron" or self.experts_tp_split

    @property
    def layout_keys(self) -> dict:
        """What the parameter layout per rank depends on (`layout.rank_params`, `data_parallel.layout_facts`)."""
        return {"weighted": self.pp_weighted, "experts_tp_split": self.experts_tp_split,
                "moe_ffn_tp_split": self.moe_ffn_tp_split}

    @property
    def master_elem_bytes(self) -> float:
        """Bytes of one element of the optimizer's parameter copy (``master_dtype``) in bf16 training; fp32
        training updates its parameters in place (no copy)."""
        if self.dtype == "fp32":
            return 0.0
        return 2.0 if self.master_dtype == "bf16" else 4.0

    @property
    def moment_elem_bytes(self) -> float:
        """Bytes of one AdamW moment element (``moment_dtype``); the optimizer keeps two per parameter."""
        return 2.0 if self.moment_dtype == "bf16" else 4.0

    @property
    def selective_policy(self) -> str:
        """``selective_ac`` with ``auto`` resolved: ``matmul``, titan-run's default policy."""
        return "matmul" if self.selective_ac == "auto" else self.selective_ac

    @property
    def tp_keeps_gathered(self) -> bool:
        """``tp_activations`` with ``auto`` resolved by the state layout: True when TP blocks keep the
        all-gathered inputs (and full-size partial sums), False when they keep sequence shards."""
        if self.tp_activations != "auto":
            return self.tp_activations == "gathered"
        return self.state_layout == "fsdp2"

    @property
    def moe_keeps_expert_outputs(self) -> bool:
        """``moe_weighting`` with ``auto`` resolved by the state layout: True when the combine's weighted
        sum keeps the routed experts' outputs for backward."""
        if self.moe_weighting != "auto":
            return self.moe_weighting == "combine"
        return self.state_layout == "fsdp2"

    @property
    def pp_sent_mode(self) -> str:
        """``pp_sent_tensors`` with ``auto`` resolved by the state layout: ``released`` for fsdp2
        (titan-run), ``freed`` for megatron."""
        if self.pp_sent_tensors != "auto":
            return self.pp_sent_tensors
        return "released" if self.state_layout == "fsdp2" else "freed"

    @property
    def pp_keeps_sent(self) -> bool:
        """True when the pipeline runtime is torch.distributed.pipelining's (``kept`` or ``released``):
        stage outputs cached to their backward; False when it frees what it has sent (``freed``)."""
        return self.pp_sent_mode != "freed"

    @property
    def pp_keeps_sent_outputs(self) -> bool:
        """True when a multi-stage schedule also holds every sent stage output to the step's end (``kept``)."""
        return self.pp_sent_mode == "kept"

    @property
    def pp_recv_persistent(self) -> bool:
        """``pp_recv_buffers`` with ``auto`` resolved: True when the pipeline stage keeps one receive buffer
        per micro-batch and direction for its whole life (torch's PipelineStage as TorchTitan runs it),
        False when a micro-batch's buffer lives from its receive to its last use (titan-run, Megatron's
        fresh tensors per micro-batch): ``auto`` is per_microbatch."""
        return self.pp_recv_buffers == "persistent"

    @property
    def pp_weighted(self) -> bool:
        """True when the pipeline split counts the embedding and the LM head as layers (``pp_split``)."""
        return self.pp_split == "weighted"

    @property
    def pp_defers_grad_sync(self) -> bool:
        """True when, under a pipeline, the gradient reduction waits for the last micro-batch."""
        return self.pp_grad_sync_mode == "last_microbatch"

    @property
    def pp_grad_sync_mode(self) -> str:
        """``pp_grad_sync`` with ``auto`` resolved: ``last_microbatch`` (titan-run's default; the planner takes
        ``every_microbatch`` for an unstated key only where it makes a faster layout fit)."""
        return "every_microbatch" if self.pp_grad_sync == "every_microbatch" else "last_microbatch"

    @property
    def float8_cache_mode(self) -> str:
        """``float8_cache`` with ``auto`` resolved by the state layout: ``fp8`` for megatron (Transformer
        Engine's linears keep their fp8 inputs), else ``auto`` (the coefficients' saved-input fraction)."""
        if self.float8_cache == "auto" and self.state_layout == "megatron":
            return "fp8"
        return self.float8_cache

    @property
    def swiglu_fused(self) -> bool:
        """``swiglu_impl`` with ``auto`` resolved: True for a fused kernel (``fused``, or ``fused_ffn``, the
        whole FFN as one function); ``auto`` is fused for both layouts."""
        if self.swiglu_impl != "auto":
            return self.swiglu_impl in ("fused", "fused_ffn")
        return True                 # Megatron's kernel; titan-run's `swiglu` Function (executor/models/layers.py)

    @property
    def swiglu_recomputes_product(self) -> bool:
        """True when the SwiGLU product ``silu(gate) * up`` is not kept but rebuilt in the backward
        (``swiglu_impl: fused_ffn``; a compiled eager SwiGLU's partitioner does the same, `_saved_ffn_parts`)."""
        return self.swiglu_impl == "fused_ffn"

    def ffn_rebuilds_product(self, *, ac: str, compiled: bool, float8: bool) -> bool:
        """Whether a block's FFN keeps its down projection's input (the SwiGLU product, a GELU's output) or
        rebuilds it in backward from what the activation keeps: ``fused_ffn``, and ``auto`` where titan-run does
        (the fsdp2 layout, blocks neither checkpointed nor compiled: executor/models/layers.py
        ``rebuilt_input``, turned on by executor/parallel/parallelize.py ``set_rebuild_product``).  Not counted
        under float8, whose linear may keep a copy of its own instead."""
        if self.swiglu_impl == "fused_ffn":
            return True
        return (self.swiglu_impl == "auto" and self.state_layout == "fsdp2" and ac == "none" and not compiled
                and not float8)

    @property
    def gqa_kv_expanded(self) -> bool:
        """``gqa_kv`` with ``auto`` resolved: True when K and V are repeated to n_heads before the attention
        kernel (and saved so).  ``auto`` is native for both layouts: titan-run (fsdp2) passes GQA K/V to
        SDPA with ``enable_gqa`` (CoreAttention) and its ring attention's flash kernels take them as they
        are (ring_attention.py), Megatron's fused kernels too; TorchTitan's regime sets ``expanded``."""
        return self.gqa_kv == "expanded"

    def norm_fused(self, compiled: bool) -> bool:
        """``norm_impl`` with ``auto`` / ``composite`` resolved by compile: a compiled block's norm is fused."""
        return compiled if self.norm_impl in ("auto", "composite") else self.norm_impl == "fused"

    def recomputes(self, module: str) -> bool:
        """True when ``ac: selective`` under ``selective_ac: modules`` recomputes `module`."""
        return self.selective_ac == "modules" and module in self.recompute_modules

    @property
    def grad_accum_mode(self) -> str:
        """``grad_accum`` with ``auto`` resolved by the state layout."""
        if self.grad_accum != "auto":
            return self.grad_accum
        return "fused" if self.state_layout == "megatron" else "autograd"

    def compiles_loss(self, compile_: bool, tp: int) -> bool:
        """The loss is compiled with the model (titan-run, executor/parallel/tensor_parallel.py; TorchTitan
        since 2025-04): the fsdp2 layout, ``loss_impl`` auto or compiled, compile on, tp 1 (plain-tensor
        logits).  An explicit ``fused`` is another framework's kernel (Megatron's, flash-attn's), not
        Inductor's.  `memory.loss_compiled` is the same rule over a candidate table."""
        return (self.state_layout == "fsdp2" and self.loss_impl in ("auto", "compiled") and bool(compile_)
                and int(tp) == 1)

    def loss_fused_at(self, compile_: bool, tp: int) -> bool:
        """The loss keeps only the logits (and per-token statistics), not an fp32 copy: compiled
        (`compiles_loss`), ``fused`` (explicit, or ``auto`` under megatron), or titan-run's fused Function
        (``auto`` under fsdp2 at tp 1, executor/parallel/fused_loss.py).  `memory.loss_fused` is the same
        rule over a candidate table."""
        if self.compiles_loss(compile_, tp) or self.loss_mode == "fused":
            return True
        return self.state_layout == "fsdp2" and self.loss_impl == "auto" and int(tp) == 1

    @property
    def loss_mode(self) -> str:
        """``loss_impl`` with ``auto`` resolved by the state layout, as at tp > 1 (titan-run's vocab-sharded
        loss: eager), and ``compiled`` as uncompiled (eager)."""
        if self.loss_impl == "compiled":
            return "eager"
        if self.loss_impl != "auto":
            return self.loss_impl
        return "fused" if self.state_layout == "megatron" else "eager"

    def tp_overlap_auto(self, hw) -> bool:
        """True when ``tp_comm_overlap: auto`` means ``full``: the megatron layout on a GPU generation that
        Transformer Engine's userbuffers TP overlap has recipes for.  NVIDIA's performance recipes turn it on
        with a per-GPU userbuffers config, and ship them for H100, B200 and GB200 only (Megatron-Bridge
        ``COMM_OVERLAP_CONFIG_MAP``, NeMo ``recipes/tp_overlap_configs/userbuffers.py``: no A100 entry); the
        float8-capable NVIDIA (``device: cuda``) presets are those generations.  Older GPUs (A100-era Megatron,
        DeepSpeed), other vendors and the fsdp2 layout keep the coefficients' value."""
        return (self.tp_comm_overlap == "auto" and self.state_layout == "megatron" and hw is not None
                and getattr(hw, "device", "") == "cuda" and bool(getattr(hw, "supports_float8", False)))

    def with_overlaps(self, coeffs, hw=None):
        """`coeffs` with ``tp_overlap`` / ``dp_overlap`` set by ``tp_comm_overlap`` / ``dp_comm_overlap``
        (none -> 0, full -> 1, async -> the coefficients' ``async_tp_overlap``, what TorchTitan's async TP was
        measured to hide); ``auto`` keeps the coefficients' own value, except TP under
        :meth:`tp_overlap_auto` (given the hardware `hw`), which is ``full``, and DP on a CPU host (``device:
        cpu``), which is ``none`` (with context parallelism's ring: gloo's collectives run on the compute's cores)."""
        over = {name: 0.0 if value == "none" else coeffs.async_tp_overlap if value == "async" else 1.0
                for name, value in (("tp_overlap", self.tp_comm_overlap), ("dp_overlap", self.dp_comm_overlap))
                if value != "auto"}
        if self.tp_overlap_auto(hw):
            over["tp_overlap"] = 1.0
        if self.dp_comm_overlap == "auto" and getattr(hw, "device", "") == "cpu":
            # a CPU host has no copy engine: gloo runs each collective (socket copies, the reduction) in host
            # threads on the cores the compute runs on, so FSDP's prefetched all-gathers, its reduce-scatters and
            # the ring attention's exchanges add their time to the step instead of hiding under compute
            over.update(dp_overlap=0.0, cp_overlap=0.0)
        return coeffs.replace(**over) if over else coeffs

    @property
    def global_batch_tokens(self) -> int:
        return self.seq_len * self.global_batch

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists for the tuple keys), as plan files and --json hold them."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
