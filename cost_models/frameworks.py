"""Framework regimes: the workload keys a training framework's runs use (overlaps included).

`titan-plan estimate --framework NAME` (and `titan-plan plan`) starts from these instead of this
executor's defaults, so a published configuration of another framework is one flag away; explicit
workload flags and a plan file's ``workload:`` still win.  bench/validate_reference.py maps every
published row through the same table (its `framework:` field), so what is validated is what the
flag gives.

A regime sets only what the framework decides for every run.  What a run chooses itself stays a
flag: the degrees, the recompute (``--ac``, Megatron's ``--selective-ac modules --recompute-modules``),
sequence parallelism where optional, fused kernels (``--compile``), float8, MoE overlap flags, and
Megatron's token dispatcher (``--ep-dispatch``: ``alltoall`` or ``flex`` with DeepEP / HybridEP is a recipe's
choice).  ``ep_dispatch: auto`` gives titan-run and TorchTitan (the fsdp2 layout) ``every_copy``, what
their all_to_all_single sends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from search_spaces.typed import did_you_mean, show

from .specs import SpecError


@dataclass(frozen=True)
class Framework:
    name: str
    describes: str                                   # one line: which stack, which era
    workload: Mapping[str, Any] = field(default_factory=dict)      # Workload keys it fixes (its overlaps too)
    why: str = ""                                    # where each setting comes from
    ac_choices: tuple[str, ...] | None = None        # the recompute settings its code has, when not all three
    #   (`titan-plan estimate` without --ac compares only these)
    plan: Mapping[str, Any] = field(default_factory=dict)   # plan keys its runs set (`plan_defaults`)
    reshard: tuple[bool, bool] | None = None         # FSDP's reshard_after_forward without / with a pipeline
    one_unit_chunks: bool = False                    # its interleaved schedule's chunks are one unit each:
    #   V = (layers + 2) / PP under the weighted split (`plan_defaults`)
    schedule_free: bool = False                      # its runs take the pipeline schedule titan-plan picks
    #   (`titan-plan estimate` without --schedule estimates each; other stacks run their default, 1F1B)

    def plan_defaults(self, layout: Mapping[str, Any], n_layers: int) -> dict[str, Any]:
        """The plan keys this regime's runs set that `layout` (a question's partial plan) leaves out: compile for
        the fused kernels (:attr:`fused_kernels`), the regime's `plan` keys (a schedule only with a pipeline), and
        under `one_unit_chunks` an interleaved schedule's stages per rank.  `titan-plan estimate` applies them;
        bench/validate_reference.py's rules for its rows give the same plans (tests/test_reference_cli.py)."""
        out: dict[str, Any] = {}
        if self.fused_kernels and "compile" not in layout:
            out["compile"] = True
        pp = int(layout.get("pp") or 1)
        if self.reshard is not None and "reshard_after_forward" not in layout:
            out["reshard_after_forward"] = self.reshard[pp > 1]
        for k, v in self.plan.items():
            if k not in layout and (k not in ("schedule", "stages_per_rank") or pp > 1):
                out[k] = v
        if (self.one_unit_chunks and pp > 1 and "stages_per_rank" not in layout
                and {**layout, **out}.get("schedule") == "Interleaved1F1B"):
            v = (n_layers + 2) // pp
            if v >= 2:
                out["stages_per_rank"] = v
            elif "schedule" in out:        # one unit per stage at most: no interleaving to default to
                del out["schedule"]
        return out

    @property
    def fused_kernels(self) -> bool:
        """Its kernels are hand-fused (Megatron's fused softmax, bias-GeLU / SwiGLU, layernorm and cross-entropy;
        Transformer Engine): the stacks that hold Megatron's state.  `titan-plan estimate` predicts them as a
        compiled plan when neither --compile / --no-compile nor the plan file says otherwise, as
        bench/validate_reference.py maps their published rows."""
        return self.workload.get("state_layout") == "megatron"


_MEGATRON = {"state_layout": "megatron", "zero": 1, "selective_ac": "attention", "grad_dtype": "fp32"}

FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (
    Framework("titan-run", "this executor (the defaults)", schedule_free=True),
    Framework("torchtitan", "TorchTitan (FSDP2, DTensor TP, torch.distributed.pipelining)",
              {"selective_ac": "op", "norm_impl": "composite", "gqa_kv": "expanded",
               "pp_recv_buffers": "persistent", "loss_impl": "compiled", "swiglu_impl": "eager",
               "pp_grad_sync": "last_microbatch", "pp_sent_tensors": "kept"},
              reshard=(True, False),
              why="FSDP reshards after forward except under a pipeline (reshard_after_forward_policy 'default': "
                  "'not pp_enabled', torchtitan/distributed/fsdp.py: 'For PP, do not reshard after forward to avoid "
                  "per-microbatch all-gathers'); selective AC is TorchTitan's op policy (activation_checkpoint.selective_ac_option = 'op': "
                  "every other matmul output kept); its norms are PyTorch's nn.RMSNorm (eager ops, fused by "
                  "Inductor when compiled); its llama Attention repeats K and V to n_heads (repeat_kv) before "
                  "F.scaled_dot_product_attention, without enable_gqa (torchtitan/models/llama/model.py), so "
                  "SDPA saves the expanded copies; its SwiGLU is the plain code, silu(w1 x) * w3 x, whose "
                  "autograd keeps silu(gate) too; its loss is F.cross_entropy on the fp32 upcast, compiled with "
                  "the model since 2025-04 (build_cross_entropy_loss); its pipeline stages are torch's PipelineStage, which keeps "
                  "one receive buffer per micro-batch and direction for the stage's life, and whose backward "
                  "turns FSDP's gradient sync off for all but the last micro-batch; its multi-stage schedules "
                  "wait every send at the end of the step, holding the sent tensors"),
    Framework("composer", "MosaicML Composer / llm-foundry (PyTorch FSDP)",
              {"selective_ac": "op", "loss_impl": "fused", "swiglu_impl": "eager"},
              reshard=(True, True),
              why="PyTorch FSDP's FULL_SHARD (llm-foundry's default sharding_strategy): resharded after forward; "
                  "llm-foundry's fused cross-entropy (loss_fn: fused_crossentropy); its GLU FFN is the plain "
                  "code, act(gate(x)) * up(x)"),
    Framework("megatron-lm", "Megatron-LM / Megatron-core with the distributed optimizer",
              dict(_MEGATRON),
              why="distributed optimizer (ZeRO-1), fp32 main gradients for bf16 (arguments.py: 'accumulate and "
                  "all-reduce gradients in fp32 for bfloat16 data type'), fused kernels; selective recompute is "
                  "core attention (Korthikanti et al. 2022, Sec. 4.3)"),
    Framework("megatron-2022", "Megatron-LM of 2022 (Korthikanti et al.; NeMo-Megatron 2022): fused softmax",
              {**_MEGATRON, "attention_impl": "materialized", "dropout": True},
              why="no flash attention yet: QK^T, the fused scaled-masked softmax, dropout and PV, all kept"),
    Framework("megatron-bridge", "NVIDIA Megatron-Bridge / NeMo 2 performance recipes (Megatron-core)",
              {**_MEGATRON, "grad_dtype": "bf16", "loss_impl": "fused", "tp_comm_overlap": "full"},
              why="the recipes set grad_reduce_in_fp32 = False, cross_entropy_loss_fusion and TP communication "
                  "overlap (userbuffers) on"),
    Framework("megatron-deepspeed", "Megatron-DeepSpeed of 2022 (BLOOM) with DeepSpeed's BF16 optimizer",
              {**_MEGATRON, "attention_impl": "materialized", "dropout": True, "sequence_parallel": False,
               "grad_accum": "hp_copy", "dp_comm_overlap": "none", "pp_split": "layers"},
              why="fused softmax and dropout, no sequence parallelism; the pipeline cut by the transformer layers "
                  "alone (GPTModelPipe's partition_method 'type:transformer', DeepSpeed's balanced partition: the "
                  "earlier stages take the extra layers; BLOOM's final runs passed --pp-partition-method "
                  "'type:transformer|embedding' from 2022-02-28 on, chronicles-prequel.md 'Rebalancing layers': "
                  "say --pp-split weighted for those); the BF16 optimizer copies each micro-"
                  "batch's gradients into fp32 (update_hp_grads) and all-reduces them whole (pipe/engine.py "
                  "_bf16_reduce_grads); the pipeline engine's ReduceGrads runs after the last backward "
                  "(deepspeed/runtime/pipe/schedule.py), so nothing hides it; its recompute is whole layers "
                  "(--checkpoint-activations) or none: the selective recompute of Korthikanti et al. "
                  "(arXiv:2205.05198, Megatron-LM 2022-06) is not in the 2021-2022 forks",
              ac_choices=("none", "full")),
    Framework("llama3-meta", "Meta's Llama 3 training stack (arXiv:2407.21783 Sec. 3.3.2: FSDP x TP x PP x CP)",
              {"selective_ac": "op", "norm_impl": "fused", "swiglu_impl": "fused_ffn", "gqa_kv": "native",
               "tp_activations": "sharded", "pp_sent_tensors": "freed", "pp_grad_sync": "every_microbatch",
               "pp_split": "weighted"},
              plan={"schedule": "Interleaved1F1B"}, one_unit_chunks=True, reshard=(False, False),
              why="'for model shards we do not reshard after forward computation'; 'we use an interleaved schedule "
                  "with V pipeline stages on one pipeline rank', whose first chunk holds only the embedding once "
                  "a layer is removed from the first and the last stage, so a chunk is one unit: V = (L + 2) / PP; "
                  "its TP is Korthikanti et al.'s sequence parallelism (cited), which keeps the sequence shard; "
                  "'we balance the pipeline by reducing one Transformer layer each from the first and the last "
                  "stages' (the weighted split); "
                  "'we proactively deallocate ... the input and output tensors of each pipeline stage'; 'our use "
                  "of FSDP ... shards optimizer states and gradients' (each micro-batch's, under the pipeline); "
                  "kernels inferred, not stated: the 8K stage ran without activation checkpointing on 80 GB "
                  "(Sec. 3.3.2), which eager kernels cannot (116 GiB on the 16,384-GPU layout), so a fused norm, "
                  "the FFN as one function keeping gate and up (xformers' SwiGLU op rebuilds the product in its "
                  "backward; LLaMA 1's hand-written backward keeps 'the outputs of linear layers', "
                  "arXiv:2302.13971 Sec. 2.4) and attention taking GQA K/V as they are (docs/memory_audit.md); "
                  "the rest as "
                  "TorchTitan's (PyTorch FSDP2 and DTensor)"),
    Framework("deepseek-hai-llm", "DeepSeek's HAI-LLM (arXiv:2412.19437 Sec. 3.2-3.3: ZeRO-1, fused kernels, FP8)",
              {**_MEGATRON, "moment_dtype": "bf16", "float8_cache": "fine_grained", "selective_ac": "modules",
               "recompute_modules": ("layernorm", "mla_up_proj", "moe_act")},
              why="ZeRO-1 data parallelism with fp32 master weights and gradients (Sec. 3.3.3), the megatron "
                  "layout's state and kernels; BF16 AdamW moments and the fine-grained FP8 activation caching "
                  "of Sec. 3.3.3 (read with --float8); its selective recompute is the report's modules: 'We "
                  "recompute all RMSNorm operations and MLA up-projections during back-propagation' (Sec. 3.2.3) "
                  "and the SwiGLU output, whose inputs are cached (Sec. 3.3.3)"),
)}
ALIASES = {"nemo": "megatron-bridge",          # NeMo 2 runs Megatron-core through the same recipes
           "megatron": "megatron-lm",         # the stack a megatron state layout implies (planner.inputs)
           "megatron-core": "megatron-lm", "mcore": "megatron-lm"}


def _spelling(name: str) -> str:
    """A framework name as written by hand: case, spaces and underscores aside ('Megatron_LM' is megatron-lm)."""
    return "-".join(str(name).strip().lower().replace("_", " ").replace("-", " ").split())


def get_framework(name: str) -> Framework:
    """The named regime (or its alias); an unknown name is refused in one line with the allowed names."""
    key = ALIASES.get(_spelling(name), _spelling(name))
    if key not in FRAMEWORKS:
        names = framework_names()
        raise SpecError(f"framework {show(name)} is not known{did_you_mean(name, names)} "
                        f"(allowed: {', '.join(names)})")
    return FRAMEWORKS[key]


def framework_names() -> tuple[str, ...]:
    """Every name --framework accepts: the regimes, then their aliases."""
    return (*FRAMEWORKS, *ALIASES)


def framework_help() -> str:
    """One phrase per regime, for --help."""
    return "; ".join([f"{f.name}: {f.describes}" for f in FRAMEWORKS.values()] +
                     [f"{a}: as {b}" for a, b in ALIASES.items()])
