"""Validate the cost model against published training runs: the shared set
(../shared/reference/published_runs.yaml) and this project's extra set (bench/reference_extra.yaml),
scored separately (`--set shared|extra|both`, default both).

Every row the model can express is mapped -- with ONE set of rules and the SAME presets
and default `Coefficients` for all rows -- onto (ModelSpec, HardwareSpec, Workload, Plan);
we predict tokens/s per GPU and peak memory (or, for the Korthikanti rows, params+optimizer
and activations) and report the absolute percentage error (APE).  Rows the model cannot
express are listed with the reason.  The last line printed is the headline.

Mapping rules (stated once, applied to every row):
* hardware: A100-SXM4-80GB -> a100-80g; H100 / DGX-H100 -> h100-sxm; "H100 96GB HBM2e,
  500W" (TorchTitan's Grand Teton hosts) -> h100-96g-500w; H200 -> h200.
* framework: each row's `framework:` names a regime of cost_models/frameworks.py (`FRAMEWORK_OF`), the
  workload keys and overlaps `titan-plan estimate --framework NAME` gives a user; the row's own facts
  (below) then apply on top.  In words: Megatron rows (Korthikanti, Megatron-LM README, Megatron-Bridge) use the
  megatron state layout (18 B/param) with the distributed optimizer (zero=1) unless the row
  says zero=0 or FSDP; their fused kernels are expressed as compile=True; selective
  recompute means Megatron's attention-core recompute.  TorchTitan rows use fsdp2, the
  'op' selective policy, eager unless "compile" is listed, reshard_after_forward=True (False with a pipeline:
  TorchTitan's apply_fsdp does not reshard after forward when pp > 1).
* overlap features a framework states are the two overlap workload keys (every coefficient stays
  at its default for every row, so each row is a `titan-plan estimate` command line): TP-communication
  overlap (Megatron-LM README "TP overlap flags on"; Megatron-Bridge performance recipes) ->
  tp_comm_overlap = full, i.e. TP collectives hide under the block's matmuls; everything else
  none (plain TP); TorchTitan's async-TP rows -> tp_comm_overlap = async (what torch's
  micro_pipeline_tp pass fuses: each all-gather with the matmuls it feeds, a reduce-scatter with the one
  matmul that produces it; cost_models/step_time.py _tp_exposed).
* Korthikanti rows: GPT with dropout and materialized (non-flash) attention, as in the paper.
  Other Megatron rows use fused attention and no dropout (their recipes' default).
* unstated micro-batch -> 1; pp>1 without vpp -> 1F1B; unstated recompute ("not stated", "per
  recipe") -> what `titan-plan estimate` does without --ac (planner/whatif.py: choose_ac): the
  fastest of none / selective / full that fits the device, else the smallest peak;
  vpp -> Interleaved1F1B with stages_per_rank = vpp; FP8/Float8 -> float8=True.
* recipe facts (bench/reference_recipes.yaml, keyed by row id, each entry citing the recipe file at the
  release of the row's container): when the entry's own layout is the row's (tp, pp, vp, ep, micro-batch,
  global batch), an unstated recompute takes the recipe's (selective with its recompute_modules ->
  selective_ac 'modules'), the workload takes its EP all-to-all overlap (Megatron's
  overlap_moe_expert_parallel_comm -> ep_a2a_overlap 'combined_1f1b'), its token dispatcher (alltoall ->
  ep_dispatch 'every_copy'; flex with DeepEP or HybridEP -> 'per_node'), and overlap_grad_reduce false
  -> dp_comm_overlap = none.  An entry whose layout differs is a record only (another recipe made the row).
* unstated seq_len in TorchTitan's async-TP benchmark -> 8192 (the train_configs default, as
  the other TorchTitan rows; its 70B float8 vanilla-TP figure matches Table 4's); those runs
  need torch.compile for async TP, so compile=True.
* measured Megatron TFLOP/s are turned into tokens/s with Megatron's own FLOPs count
  (`megatron_flops_per_token`, no causal halving).

Rules for the extra set (same loader; a row's `framework:` key, else its id prefix, picks the
framework):
* `model:` may name a preset (`preset: llama3-405b`) or give the dims inline (a mixture of experts with
  `n_experts`, `top_k`, `moe_ffn_hidden`, `n_shared_experts`, `n_dense_layers`), with `mlp`, `norm`
  and `tie_embeddings` where the family differs from Llama's (MPT: gelu, layernorm, tied).
* hardware: a row's `hardware.nic_gbps` / `gpus_per_nic` (the cluster's NICs as its source states
  them, e.g. BLOOM's Jean Zay: 4 Omni-Path 100 Gb/s links per 8-GPU node) replace the preset's.
  A100 40GB -> a100-40g; B200 -> b200; H800 -> the h800 preset if one exists (else
  the row is not expressible).
* `measured.step_time_s` is turned into tokens/s/GPU as global_batch * seq_len / (t * GPUs), and
  `measured.tokens_per_sec_total` (the whole job's) as that / GPUs; `measured.tflops_per_gpu_with_recompute`
  (Narayanan et al. 2021, arXiv:2104.04473, eq. 3, which counts the recompute forward) by that count per token.
* megatron-lm-2021 (Narayanan et al. 2021's Megatron-LM on Selene): the megatron-2022 regime (fused softmax,
  dropout); its rows state zero 0 and no sequence parallelism (neither existed yet).  The same paper's ZeRO-3 rows
  (framework deepspeed-zero3-2021: the DeepSpeed releases before the paper, v0.3.13-14) have no rules: they are
  kept with their reason, no regime describes them (docs/reference_data.md, "ZeRO-3 of 2021 (Narayanan et al.
  Table 2)").
* zero-bubble-2023 (the Zero Bubble paper's rows, Qi et al. 2024): the megatron-2022 regime too -- the paper's
  code at its release (sail-sg/zero-bubble-pipeline-parallelism 475e0629, 2023-12-21) is Megatron-LM's local
  transformer and its example passes neither --use-flash-attn nor dropout flags (defaults: fused scaled-masked
  softmax, attention and hidden dropout 0.1).
* nemo-megatron-2022 (NeMo Megatron 22.09 launcher configs, A100): the Megatron rules with the
  Korthikanti regime (fused softmax, i.e. materialized attention, and dropout; sequence parallel as
  the config says), no TP overlap (userbuffers came later).  megatron-deepspeed-2022 (BLOOM's
  Megatron-DeepSpeed on Jean Zay): the same regime, ZeRO-1 (DeepSpeed's BF16 optimizer), 1F1B.
* mbridge / nemo / Korthikanti rows follow the Megatron rules above (nemo: NeMo 2.0's performance
  recipes turn TP communication overlap on, as mbridge's do -> tp_comm_overlap = full).  composer-fsdp (MosaicML's
  llm-foundry benchmarks: Composer + PyTorch FSDP1) and llama3-meta (the Llama 3 paper: "DP
  stands for FSDP") use the fsdp2 layout, eager (compile=False: neither states a compiler), the
  'op' selective policy; FULL_SHARD -> reshard_after_forward=True, SHARD_GRAD_OP -> False.
  llama3-meta, from the paper's Sec. 3.3.2 (arXiv:2407.21783): reshard_after_forward=False ("for model
  shards we do not reshard after forward computation") and, with pp > 1, Interleaved1F1B ("we use an
  interleaved schedule with V pipeline stages on one pipeline rank"), V one layer per chunk (removing
  one layer from the first stage leaves its first chunk "only the embedding"): V = (L + 2) / PP,
  capped at L // PP, the most a plan splits (405B, PP 16: 8 -> 7); tp_activations = sharded (its TP
  cites Korthikanti et al., whose sequence parallelism keeps the sequence shard, Sec. 4.2.2);
  pp_sent_tensors = freed ("we proactively deallocate ... the input and output tensors of each pipeline
  stage") and pp_grad_sync = every_microbatch ("our use of FSDP ... shards optimizer states and gradients").
* gradient dtype and loss kernel, by framework (Workload.grad_dtype / loss_impl):
  - nemo and mbridge: bf16 main gradients and the fused cross-entropy.  NeMo 1.0 configs (24.07 era):
    `optim: distributed_fused_adam` with `grad_sync_dtype: bf16` and `cross_entropy_loss_fusion: true`
    (NVIDIA/dgxc-benchmarking, nemotron/nemotron4-340b-synth.yaml); NeMo 2.0 performance scripts set
    `recipe.trainer.plugins.grad_reduce_in_fp32 = False` (NVIDIA/NeMo scripts/performance) and NeMo's
    GPTConfig defaults `cross_entropy_loss_fusion = True`; Megatron-Bridge performance configs set
    `cfg.ddp.grad_reduce_in_fp32 = False` (scripts/performance/configs) and their model providers
    `cross_entropy_loss_fusion = True`.
  - composer-fsdp: the fused cross-entropy -- llm-foundry's ComposerMPTCausalLM takes
    `loss_fn` default `fused_crossentropy` (flash_attn.losses.cross_entropy;
    llmfoundry/models/mpt/modeling_mpt.py); its gradients follow FSDP's fp32 master parameters.
  - everything else: fp32 main gradients (Megatron-LM forces accumulate_allreduce_grads_in_fp32 for
    bf16) and loss_impl auto: Megatron's vocab-parallel loss in place on fp32 logits (fused), the
    FSDP stacks' cross_entropy on .float() logits (eager).
* gradient accumulation (Workload.grad_accum): megatron-deepspeed-2022 -> hp_copy (its BF16
  optimizer: the DeepSpeed pipeline engine calls `optimizer.update_hp_grads()` after every
  micro-batch's backward, deepspeed/runtime/pipe/engine.py `_exec_backward_pass`); the other
  Megatron stacks fuse it into the weight-gradient GEMM (gradient_accumulation_fusion, auto);
  the FSDP stacks use autograd's accumulation (auto).  Except BLOOM rows that predate the BF16
  optimizer (their precision field says so, or says fp16, or the table row is dated before 02-28: bigscience
  tr11-176B-ml chronicles-prequel.md, section "Rebalancing layers": from 02-28 "the testing is happening with
  BF16 optimizer", which accumulates gradients in fp32 "compared to fp16 which grad accumulates in fp16"; the
  bf16 runs of 02-17 ran ZeRO-1's own bf16 path, DeepSpeed 8eef742 of 02-16): 16-bit mixed precision, whose
  gradients accumulate in the parameters' .grad (autograd) and are reduced in 16 bits (grad_dtype bf16: 2 bytes).
  BLOOM's models normalize the embedding (ModelSpec.embed_norm: tr11-176B-ml.slurm --embed-layernorm).
  megatron-deepspeed-2022 also has
  dp_comm_overlap = none: DeepSpeed's pipeline `TrainSchedule` issues `ReduceGrads` as its own instruction
  after the last micro-batch's backward (deepspeed/runtime/pipe/schedule.py), so nothing hides it.
* norm kernel (Workload.norm_impl): a row's `norm_type` as its config states it (TorchTitan's 2024
  train configs: `fused_rmsnorm`, a Triton kernel keeping its input, or `rmsnorm`, eager); unstated,
  fused exactly when the row compiles (auto).
* `not_counted: {metric: <reason>}` shows a measured metric without scoring it (the row's fit verdict still
  counts), e.g. a training-average throughput under a schedule the plan stands in for.  So is the throughput of a
  release and model whose framework maintainers document a regression (`DOCUMENTED_REGRESSIONS`, with the
  citation): Megatron-Bridge 25.11's Qwen3 30B-A3B, "2X slower than 25.09" (Megatron-Bridge issue #1998).
* a row's `parallel:` may state `recompute_modules` (Megatron-core's names), `moment_dtype`, `master_dtype` and
  `float8_cache` (Workload keys): DeepSeek-V3's report states its recomputed modules, bf16 AdamW moments and fp8
  caching; the DGX Cloud Nemotron-4 340B benchmark's config a bf16 optimizer state (moments and parameter copy).
* a row's `parallel.pp_partition` states how its layers were cut into pipeline stages: text starting with
  `type:transformer|embed` (DeepSpeed's partition method) or `weighted` gives Workload.pp_split weighted (the
  embedding and the head count as layers), `layers` the layers-only split; unstated, the regime's (for
  megatron-deepspeed-2022 the layers-only split of GPTModelPipe's `partition_method='type:transformer'`: BLOOM's
  chronicles-prequel.md, section 'Rebalancing layers', 2022-02-28: "I implemented and enabled `--pp-partition-method
  'type:transformer|embedding'`", so the contenders dated before it ran the default, and the rows from then on
  state the weighted split).
* `not_scorable: <reason>` keeps a row listed but unscored; `trained: false` marks figures that
  are not from a training run (they are left out of the "predicted to fit" check, as are the
  shared set's Korthikanti Figure 1 no-recompute rows, whose source says they exceed 80 GB).
* `ran_out_of_memory: true` marks a published layout that did not run (the source reports OOM): it
  has no figure to score, and it must be predicted NOT to fit (the OOM check, the other half of the
  memory verdict: a layout the planner calls feasible must not run out of memory).
* `measured.mem_gb_column` (BLOOM's chronicles, bigscience train/tr11-176B-ml/chronicles-prequel.md) is scored as
  `nvidia_smi_gib`, one of the memory metrics: the footnote of section 'Best TFLOPs' says "*Mem = max memory used
  by the first (last) nodes with the word embedding matrix", and the later sections were read "with: `pdsh -w
  jean-zay-iam01 "source ~/.pdshrc; nvidia-smi"`", the job's first node, whose 8 GPUs are pipeline stage 0
  (DeepSpeed's PipeModelDataParallelTopology puts the pipe axis outermost).  nvidia-smi shows a process's whole
  device memory: the caching allocator's reserved segments, NCCL's buffers and the CUDA context.  So the
  prediction is the first pipeline rank's device bytes (`memory_by_rank`: reserved peak with NCCL's buffers;
  under 'Best TFLOPs' the heavier of the first and last ranks) plus the hardware's `cuda_context_gib`; "GB"
  is read as nvidia-smi's MiB / 1024.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.coefficients import Coefficients  # noqa: E402
from cost_models.estimate import GIB, estimate  # noqa: E402
from cost_models.memory import memory_by_rank, nccl_buffer_bytes  # noqa: E402
from cost_models.flops import megatron_flops_per_token  # noqa: E402
from cost_models.frameworks import get_framework  # noqa: E402
from cost_models.specs import PRESET_DIR, load_hardware, load_model, model_from_dict  # noqa: E402
from cost_models.workload import Workload  # noqa: E402
from planner.whatif import AC_ORDER, choose_ac  # noqa: E402
from search_spaces.plan import Plan  # noqa: E402
from search_spaces.table import CandidateTable  # noqa: E402

# Architectures the rows name but do not spell out ("take from the model's HF config").
HF_MODELS = {
    "Qwen3 30B-A3B": "qwen3-30b-a3b",
    "DeepSeek-V3 (dropless)": "deepseek-v3-671b",
    # Qwen/Qwen3-235B-A22B config.json
    "Qwen3 235B-A22B": dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, ffn_hidden=12288,
                            vocab_size=151936, n_experts=128, top_k=8, moe_ffn_hidden=1536),
}
NOT_EXPRESSIBLE = {
    "GPT-OSS": "alternating 128-token sliding-window attention and attention sinks are not in ModelSpec",
}


EXTRA_PATH = Path(__file__).resolve().parent / "reference_extra.yaml"
RECIPES_PATH = Path(__file__).resolve().parent / "reference_recipes.yaml"
SETS = ("shared", "extra")
# each row's `framework:` -> its regime in cost_models/frameworks.py (`titan-plan estimate --framework`)
FRAMEWORK_OF = {"korthikanti": "megatron-2022", "nemo-megatron-2022": "megatron-2022", "megatron": "megatron-lm",
                "mbridge": "megatron-bridge", "nemo": "nemo", "megatron-deepspeed-2022": "megatron-deepspeed",
                "torchtitan": "torchtitan", "composer-fsdp": "composer", "llama3-meta": "llama3-meta",
                "megatron-lm-2021": "megatron-2022",   # Narayanan et al. 2021: the same fused softmax and dropout
                "fms-fsdp": "torchtitan",   # IBM fms-fsdp: PyTorch FSDP, SDPA, eager cross-entropy (no fused kernels)
                "megatron-lm-2024": "megatron-lm",   # Megatron-LM 2023-24 runs stating no overlap flags (Nemotron-4)
                # the Zero Bubble paper's Megatron-LM fork at its release (2023-12): no --use-flash-attn, default dropout
                "zero-bubble-2023": "megatron-2022",
                "deepseek-hai-llm": "deepseek-hai-llm",   # cost_models/frameworks.py cites both stacks' facts
                # MT-NLG 530B's Megatron-DeepSpeed of 2021: the same regime, its 16-bit ZeRO-1 path (no BF16 optimizer)
                "megatron-deepspeed-2021": "megatron-deepspeed"}
# the sources whose framework holds Megatron's state (and fused kernels): the megatron rules below
MEGATRON = tuple(k for k, v in FRAMEWORK_OF.items() if get_framework(v).fused_kernels)
FSDP_STACKS = tuple(k for k in FRAMEWORK_OF if k not in MEGATRON)
MATERIALIZED = tuple(k for k in MEGATRON
                     if get_framework(FRAMEWORK_OF[k]).workload.get("attention_impl") == "materialized")


def reference_dir() -> Path:
    env = os.environ.get("TITAN_REFERENCE_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "reference"


@dataclass
class Case:
    id: str
    model: object
    hw: object
    workload: Workload
    plan: Plan
    measured: dict = field(default_factory=dict)   # tokens_per_s_per_gpu | peak_mem_gib | params_opt_gib | activations_gib
    not_counted: dict = field(default_factory=dict)  # metric -> why it is shown but not scored
    trained: bool = True                           # the figures come from a run that trained
    oom: bool = False                              # the source reports that this layout ran out of memory
    smi_ranks: tuple = ("first",)                  # the pipeline ranks an nvidia-smi reading saw (nvidia_smi_gib)
    publication: str = ""                          # the source (repository or paper) the row's figures come from


def _num(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        m = re.match(r"\s*([0-9][0-9,]*)", v)
        if m:
            return int(m.group(1).replace(",", ""))
    return None


def _hardware(gpu: str) -> str:
    if "A100" in gpu:
        return "a100-40g" if "40GB" in gpu or "40gb" in gpu else "a100-80g"
    if "B200" in gpu:
        return "b200"
    if "H800" in gpu:
        if not (PRESET_DIR / "hardware" / "h800.yaml").is_file():
            raise ValueError("no H800 hardware preset (H800: H100 compute with 400 GB/s NVLink); add "
                             "cost_models/presets/hardware/h800.yaml to score this row")
        return "h800"
    if "96GB" in gpu:
        return "h100-96g-500w"
    if "H200" in gpu:
        return "h200"
    if "H100" in gpu:
        return "h100-sxm"
    raise KeyError(gpu)


def _model(row) -> object:
    m = row["model"]
    name = str(m.get("name", ""))
    for key, why in NOT_EXPRESSIBLE.items():
        if name.startswith(key):
            raise ValueError(why)
    if m.get("preset"):
        return load_model(str(m["preset"]))
    if name in HF_MODELS:
        ref = HF_MODELS[name]
        return load_model(ref) if isinstance(ref, str) else model_from_dict({"name": name, **ref})
    gpt = "GPT" in str(m.get("family", ""))
    h, heads = int(m["hidden"]), int(m["heads"])
    d = dict(name=name or row["id"], dim=h, n_layers=int(m["layers"]), n_heads=heads,
             n_kv_heads=int(_num(m.get("kv_heads")) or heads), vocab_size=int(_num(m["vocab"])),
             ffn_hidden=int(_num(m.get("ffn_hidden")) or 4 * h), max_seq_len=max(8192, _seq(row) or 0))
    if gpt:
        d.update(mlp="gelu", norm="layernorm")
    d.update({k: m[k] for k in ("mlp", "norm", "tie_embeddings") if k in m})
    # a mixture of experts stated inline (ModelSpec's keys): routed experts, top-k, their width, shared experts and
    # the dense layers before the first MoE layer
    d.update({k: int(m[k]) for k in ("n_experts", "top_k", "moe_ffn_hidden", "n_shared_experts", "n_dense_layers")
              if k in m})
    return model_from_dict(d)


def _seq(row):
    return _num(row["model"].get("seq_len"))


@functools.lru_cache(maxsize=None)
def load_recipes(path: Path = RECIPES_PATH) -> dict[str, dict]:
    """bench/reference_recipes.yaml: what the performance recipe behind a row sets, keyed by row id."""
    return dict(yaml.safe_load(path.read_text())["recipes"])


def recipe_for(row, recipes: dict[str, dict] | None = None) -> dict | None:
    """The row's recipe entry when its stated layout is the row's (tp, pp, vp, ep, micro-batch, global
    batch), else None: a recipe with another layout did not produce the row's figure."""
    rec = (load_recipes() if recipes is None else recipes).get(row["id"])
    if rec is None:
        return None
    par, lay = row["parallel"], rec["layout"]
    vp = lambda x: max(1, int(_num(x) or 1))     # noqa: E731 (null, n/a and 1: no interleaving)
    same = all(int(par.get(k) or 1) == int(lay.get(k) or 1) for k in ("tp", "pp", "ep", "microbatch")) and \
        vp(par.get("vpp")) == vp(lay.get("vp")) and int(par.get("global_batch") or 0) == int(lay["global_batch"])
    return rec if same else None


def torchtitan_compiles_loss(row) -> bool:
    """TorchTitan compiles its loss with the model from bbb1b616e (2025-04-02, ``build_cross_entropy_loss``:
    "Compiling the loss function with torch.compile"); before, the loss ran eager (d1f62be7, 2025-02-20:
    "compiling loss function causes CUDA errors, turning off for now").  Its benchmark files carry their
    month in the name (``llama3_h100_202412_torchtitan.md``, ``asyncTP_llama3_h100_2025-06_torchtitan.md``)."""
    m = re.search(r"_(20\d\d)-?(\d\d)_", str(row["source"].get("path", "")))
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (2025, 4)


def build_case(row) -> Case:
    """Map one published row onto the cost model's inputs; ValueError(reason) if it cannot be expressed."""
    rid, par, hwr, meas = row["id"], row["parallel"], row["hardware"], row["measured"]
    if row.get("not_scorable"):
        raise ValueError(str(row["not_scorable"]))
    model = _model(row)
    recipe = recipe_for(row) or {}          # bench/reference_recipes.yaml: what the row's recipe states
    # multi-token-prediction modules the source states (the row's model, else its recipe: Megatron's mtp_num_layers)
    mtp = row["model"].get("mtp_layers", recipe.get("mtp_layers"))
    if mtp:
        model = dataclasses.replace(model, mtp_layers=int(mtp))
    if str(row.get("framework")) == "megatron-deepspeed-2022":
        # BLOOM's tr11 setup normalizes the embedding (tr11-176B-ml.slurm: --embed-layernorm; the candidates'
        # "other architecture as tr11"; chronicles-prequel.md 'main-no-emb-norm' turns it off for one test only)
        model = dataclasses.replace(model, embed_norm=True)
    hw = load_hardware(_hardware(hwr["gpu"]))
    nic = {k: hwr[k] for k in ("nic_gbps", "gpus_per_nic") if hwr.get(k) is not None}
    if nic:           # the cluster's stated NICs, where they differ from the preset's node
        hw = dataclasses.replace(hw, inter_node_bw_gbs=None, **nic)
    source = str(row.get("framework") or rid.split("_")[0])
    if source not in MEGATRON + FSDP_STACKS:
        raise ValueError(f"framework '{source}' has no mapping rules (known: {', '.join(MEGATRON + FSDP_STACKS)})")
    megatron = source in MEGATRON
    seq = _seq(row) or (8192 if source == "torchtitan" else None)
    if seq is None:
        raise ValueError("sequence length not stated")
    count = int(hwr["count"])
    tp, pp, cp = int(par.get("tp") or 1), int(par.get("pp") or 1), int(par.get("cp") or 1)
    ep = int(par.get("ep") or 1)
    fsdp = int(par.get("fsdp") or 0)
    dp = count // (tp * pp * cp)
    if dp * tp * pp * cp != count:
        raise ValueError(f"degrees do not multiply to {count} GPUs")
    if isinstance(par.get("dp"), int) and par["dp"] != dp:
        raise ValueError(f"stated dp {par['dp']} != GPUs / (tp*pp*cp) = {dp}")
    mb = int(par.get("microbatch") or par.get("local_batch") or 1)
    gb = int(par.get("global_batch") or dp * mb)
    text = " ".join(str(par.get(k, "")) for k in ("recompute", "techniques", "precision")).lower()
    rec = str(par.get("recompute", "not stated")).lower()
    ac = ("full" if rec.startswith("full") else "selective" if rec.startswith("selective")
          else "none" if rec.startswith("none") else None)         # None: not stated, chosen below
    if ac is None and recipe.get("recompute"):
        ac = str(recipe["recompute"])
    # Megatron-core's recompute_modules as the row states them (a recipe's otherwise)
    modules = tuple(par.get("recompute_modules") or recipe.get("modules") or ()) if ac == "selective" else ()
    f8 = ("fp8" in text or "float8" in text)
    if "rowwise" in text:
        raise ValueError("float8 rowwise scaling is a different recipe from the tensorwise float8 the plan models")
    async_tp = bool(par.get("async_tp")) or "asynctp" in text.replace(" ", "").replace("-", "")
    vpp = par.get("vpp")
    fw = get_framework(FRAMEWORK_OF[source])
    # the plan keys the row leaves out and its framework's runs set (Framework.plan_defaults, as `titan-plan
    # estimate --framework` fills them in): Megatron's fused kernels as compiled, the Llama 3 paper's interleaved
    # one-unit chunks and no resharding, TorchTitan's resharding except under a pipeline
    stated_plan = {"pp": pp, **({"schedule": "stated"} if pp > 1 and (vpp and int(vpp) > 1 or str(
        par.get("schedule", "")).startswith("DualPipe")) else {}),
        **({"reshard_after_forward": None} if par.get("sharding_strategy") else {}),
        **({"compile": None} if str(par.get("compile", "")).strip() or "compile" in text
           or "asynctp" in rid.lower() else {})}
    regime_plan = fw.plan_defaults(stated_plan, model.n_layers)
    schedule, v = regime_plan.get("schedule", "1F1B"), regime_plan.get("stages_per_rank", 1)
    if pp > 1 and vpp and int(vpp) > 1:
        schedule, v = "Interleaved1F1B", int(vpp)
    elif pp > 1 and str(par.get("schedule", "")).startswith("DualPipe"):
        # DualPipe (pp ranks, rank r holding stages r and pp-1-r for the two directions) as DualPipeV, its cut-in-
        # half form over the same ranks: about the same activations per device (DualPipe PP + 1 micro-batches of
        # an L/PP-layer stage, DualPipeV 2PP + 1 of an L/2PP-layer one: the DualPipe README's table) and half
        # DualPipe's parameters (its two copies; docs/memory_audit.md adds the second one by hand)
        schedule, v = "DualPipeV", 2
    korthikanti = source == "korthikanti"
    materialized = source in MATERIALIZED
    state = "fsdp2" if (not megatron or fsdp > 0) else "megatron"
    # a ZeRO stage is the megatron layout's; FSDP shards everything (ZeRO-3), which `titan-plan estimate` says
    zero = (int(par["zero"]) if isinstance(par.get("zero"), int) else 1) if state == "megatron" else 3
    compile_ = regime_plan.get("compile", False) or "compile" in text or "asynctp" in rid.lower()
    stated = str(par.get("compile", "")).lower()        # a row's own compile field, where it says on or off
    if stated.startswith(("torch.compile on", "on", "true")):
        compile_ = True
    elif stated.startswith(("off", "false")):
        compile_ = False
    # a stated norm kernel (TorchTitan's norm_type); unstated: the framework regime's, else PyTorch's composite,
    # fused exactly when compiled (norm_impl auto would be titan-run's own eager norm)
    norm_text = str(par.get("norm_type", "")).lower()
    norm = ("fused" if norm_text.startswith("fused") else "eager" if norm_text else
            str(get_framework(FRAMEWORK_OF[source]).workload.get("norm_impl", "composite")))
    # BLOOM runs before DeepSpeed's BF16 optimizer: fp16, gradients accumulated in 16 bits by autograd
    prec = str(par.get("precision", "")).lower()
    # (or dated before it: the table row's MM-DD of 2022, section 'Rebalancing layers': from 02-28 "the testing is
    # happening with BF16 optimizer"; the bf16 runs of 02-17 ran ZeRO-1's own bf16 path, DeepSpeed 8eef742 of 02-16)
    dated = re.findall(r"\b(\d\d)-(\d\d)\b", str(row["source"].get("row", "")))
    before_bf16_opt = bool(dated) and tuple(map(int, dated[-1])) < (2, 28)
    fp16_ds = (source == "megatron-deepspeed-2021"     # DeepSpeed's BF16 optimizer came in 2022-03 (BLOOM)
               or source == "megatron-deepspeed-2022" and ("predate the bf16 optimizer" in prec or prec.startswith("fp16")
                                                           or "before the bf16 optimizer" in prec or before_bf16_opt))
    # the framework's regime (cost_models/frameworks.py, what `titan-plan estimate --framework` gives), then
    # what the row states
    kw = dict(fw.workload)
    if state == "fsdp2":        # a Megatron row run with FSDP keeps FSDP's state
        for k in ("state_layout", "zero", "grad_dtype"):
            kw.pop(k, None)
    kw.update(state_layout=state, zero=zero, norm_impl=norm,
              ep_a2a_overlap=str(recipe.get("ep_a2a_overlap", "none")),
              moe_weighting=str(recipe.get("moe_weighting", "auto")),
              ep_dispatch=str(recipe.get("ep_dispatch", "auto")),
              expert_tp=str(recipe.get("expert_tp", "auto")))
    if state == "fsdp2" and kw.get("pp_grad_sync", "auto") == "auto":
        # a published run synced its gradients one way: the FSDP stacks' pipelines are torch's (or none), whose
        # backward turns the sync off for all but the last micro-batch (`titan-plan estimate` may choose the
        # other for an unstated key, which is a question about titan-run)
        kw["pp_grad_sync"] = "last_microbatch"
    if materialized and "sequence_parallel" in par:
        kw["sequence_parallel"] = bool(par["sequence_parallel"])
    if modules:
        kw.update(selective_ac="modules", recompute_modules=modules)
    # how the source cut the layers into stages: the embedding and the head counted as layers (DeepSpeed's
    # type:transformer|embedding; a paper's "one layer fewer on the first and the last stage")
    split = str(par.get("pp_partition") or recipe.get("pp_partition", "")).lower()
    if split.startswith(("type:transformer|embed", "weighted")):
        kw["pp_split"] = "weighted"
    elif split.startswith("layers"):
        kw["pp_split"] = "layers"
    if fp16_ds:                 # 16-bit gradients accumulated by autograd
        kw.update(grad_dtype="bf16", grad_accum="autograd")
    for key in ("moment_dtype", "master_dtype", "float8_cache"):   # stated precisions of what is stored
        if par.get(key):
            kw[key] = str(par[key])
    if source == "megatron":
        kw["tp_comm_overlap"] = "full"   # the Megatron-LM README's weak-scaling table: "TP overlap flags on"
    if async_tp:
        kw["tp_comm_overlap"] = "async"   # TorchTitan's async TP: torch's micro_pipeline_tp fusions
    if recipe.get("overlap_grad_reduce") is False:
        kw["dp_comm_overlap"] = "none"   # the recipe turns Megatron's overlapped gradient reduction off
    if recipe.get("tp_comm_overlap"):
        kw["tp_comm_overlap"] = str(recipe["tp_comm_overlap"])   # the recipe's CommOverlapConfig(tp_comm_overlap=...)
    if source == "torchtitan" and compile_ and not torchtitan_compiles_loss(row):
        kw["loss_impl"] = "eager"
    workload = Workload(seq_len=seq, global_batch=gb, **kw)
    if dp * mb == 0 or gb % (dp * mb):
        raise ValueError(f"global batch {gb} not divisible by dp*microbatch = {dp}*{mb}")
    # FSDP1's strategy as the row states it (FULL_SHARD, HYBRID_SHARD: resharded; SHARD_GRAD_OP: kept), else the
    # regime's (llama3-meta: "we do not reshard after forward"; TorchTitan: not under a pipeline), else resharded
    if par.get("sharding_strategy"):
        reshard = str(par["sharding_strategy"]).upper() != "SHARD_GRAD_OP"
    else:
        reshard = regime_plan.get("reshard_after_forward", True)
    # FSDP1's HYBRID_SHARD without its own process groups shards within a node and replicates across nodes
    # (torch.distributed.fsdp _init_utils: the intra-node group has the device count of the node)
    hybrid = str(par.get("sharding_strategy", "")).upper() == "HYBRID_SHARD"
    shard = min(dp, int(hw.gpus_per_node)) if hybrid else dp
    if dp % shard:
        raise ValueError(f"HYBRID_SHARD: data-parallel degree {dp} is not a multiple of {shard} GPUs per node")
    plan = Plan(dp_replicate=dp // shard, dp_shard=shard, pp=pp, tp=tp, cp=cp, ep=ep, microbatch=mb,
                n_microbatches=gb // (dp * mb),
                schedule=schedule, stages_per_rank=v, ac=ac or "none", compile=compile_, float8=f8,
                reshard_after_forward=reshard, runnable=False)    # a what-if, as `titan-plan estimate`
    # ep over the TP ranks too (Megatron-core's folded expert layout): whole experts, as the estimate CLI takes them
    workload, _ = workload.for_expert_layout(plan.ep, plan.fsdp_size, plan.tp)
    if ac is None:      # recompute not stated: the estimate CLI's choice without --ac (among the regime's own)
        plans = [dataclasses.replace(plan, ac=a, runnable=False) for a in AC_ORDER if a in (fw.ac_choices or AC_ORDER)]
        est = estimate(CandidateTable.from_plans(plans), model, hw, workload, Coefficients())
        plan = plans[choose_ac(plans, est)]
    measured = {}
    if "step_time_s" in meas:
        measured["tokens_per_s_per_gpu"] = gb * seq / (float(meas["step_time_s"]) * count)
    elif "tokens_per_sec_per_gpu" in meas:
        measured["tokens_per_s_per_gpu"] = float(meas["tokens_per_sec_per_gpu"])
    elif "tokens_per_sec_total" in meas:
        measured["tokens_per_s_per_gpu"] = float(meas["tokens_per_sec_total"]) / count
    elif "gpu_hours_per_trillion_tokens" in meas:   # a training average (DeepSeek-V3 Table 1)
        measured["tokens_per_s_per_gpu"] = 1e12 / (float(meas["gpu_hours_per_trillion_tokens"]) * 3600.0)
    elif "tokens_per_sec" in meas:   # the async-TP table: header says tokens/sec, magnitude is per GPU
        measured["tokens_per_s_per_gpu"] = float(meas["tokens_per_sec"])
    elif "tflops_per_gpu" in meas:
        measured["tokens_per_s_per_gpu"] = float(meas["tflops_per_gpu"]) * 1e12 / megatron_flops_per_token(model, seq)
    elif "samples_per_sec_per_gpu" in meas:   # sequences per GPU per second (Zero Bubble, Table 4)
        measured["tokens_per_s_per_gpu"] = float(meas["samples_per_sec_per_gpu"]) * seq
    elif "tflops_per_gpu_with_recompute" in meas:   # Narayanan et al. 2021 eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh)
        l, h = model.n_layers, model.dim
        per_token = 96 * l * h * h * (1 + seq / (6 * h) + model.vocab_size / (16 * l * h))
        measured["tokens_per_s_per_gpu"] = float(meas["tflops_per_gpu_with_recompute"]) * 1e12 / per_token
    if "peak_mem_gib" in meas:
        measured["peak_mem_gib"] = float(meas["peak_mem_gib"])
    smi_ranks = ("first",)          # the pipeline ranks an nvidia-smi reading saw (only rows that carry one)
    if isinstance(meas.get("mem_gb_column"), (int, float)) and source == "megatron-deepspeed-2022":
        measured["nvidia_smi_gib"] = float(meas["mem_gb_column"])   # an nvidia-smi reading (module docstring)
        smi_ranks = ("first", "last") if "section 'Best TFLOPs'" in str(row["source"].get("path", "")) else ("first",)
    if "params_plus_optimizer_gib" in meas:
        measured["params_opt_gib"] = float(meas["params_plus_optimizer_gib"])
        measured["activations_gib"] = float(meas["activations_gib"])
    not_counted = {}
    # a metric the row shows but the source does not let us score (the row's reason), its fit verdict still counted
    not_counted.update({str(k): str(why) for k, why in (row.get("not_counted") or {}).items()})
    regression = documented_regression(row)
    if regression and "tokens_per_s_per_gpu" in measured:
        not_counted.setdefault("tokens_per_s_per_gpu", regression)
    trained = bool(row.get("trained", True))
    if korthikanti and ac == "none" and "exceed 80 GB" in str(row["source"].get("caveat", "")):
        trained = False   # the source: the no-recompute bars exceed 80 GB, so they are analytic, not a run
    oom = bool(row.get("ran_out_of_memory"))
    if oom and measured:
        raise ValueError("a row that ran out of memory has no measured figures")
    return Case(rid, model, hw, workload, plan, measured, not_counted, trained and not oom, oom,
                smi_ranks, publication_of(row))


# Throughput the framework's own maintainers document as a regression of one release for one model: the figure
# measures a defect that the next release fixed, not the layout, so it is shown and not scored (its memory and
# fit verdict still count).  Keyed by (the release in the row's source section, the model name as the table
# writes it); each entry cites the maintainers' statement.
DOCUMENTED_REGRESSIONS = {
    ("25.11", "Qwen3 30B-A3B"): (
        "NVIDIA-NeMo/Megatron-Bridge issue #1998 (2026-01-20), '[Regression] Low QWEN3 30B B200 and H100 performance "
        "with dropless': 'the perf in 25.11 is 2X slower than 25.09. We need to fix this in 26.02' (the 26.02.01 "
        "release measures 9,058 tokens/s/GPU on the same 16 H100s with PP 2 x EP 8, this row 5,275)"),
}


def documented_regression(row) -> str | None:
    """The cited reason when `row` is a Megatron-Bridge figure of a release and model in `DOCUMENTED_REGRESSIONS`."""
    section = str((row.get("source") or {}).get("section") or "")
    release = re.match(r"\s*([0-9]{2}\.[0-9]{2}(?:\.[0-9]+)?)\b", section)
    name = str((row.get("model") or {}).get("name") or "")
    return DOCUMENTED_REGRESSIONS.get((release.group(1), name)) if release else None


def publication_of(row) -> str:
    """A short name of the publication a row comes from: the repository's name (each MLPerf round is its own
    repository) or the paper's authors."""
    src = row.get("source") or {}
    repo = str(src.get("repo") or "").rstrip("/")
    if repo:
        return repo.rsplit("/", 1)[-1]
    return str(src.get("paper") or "").split(",")[0].split("'")[0].strip()


def load_rows(ref_dir: Path | None = None) -> list[dict]:
    path = (ref_dir or reference_dir()) / "published_runs.yaml"
    return list(yaml.safe_load(path.read_text())["cases"])


def load_extra_rows(path: Path | None = None) -> list[dict]:
    return list(yaml.safe_load((path or EXTRA_PATH).read_text())["cases"])


def build_cases(rows) -> tuple[list[Case], list[tuple[str, str]]]:
    cases, skipped = [], []
    for row in rows:
        try:
            cases.append(build_case(row))
        except ValueError as e:
            skipped.append((row["id"], str(e)))
    return cases, skipped


def predict(case: Case, coeffs: Coefficients | None = None) -> dict:
    coeffs = coeffs or Coefficients()
    est_table = CandidateTable.from_plans([case.plan])
    est = estimate(est_table, case.model, case.hw, case.workload, coeffs)
    m = {k: float(v[0]) for k, v in est.memory.items()}
    return {"tokens_per_s_per_gpu": float(est.tokens_per_s_per_gpu[0]),
            # published peaks are torch.cuda.max_memory_reserved, which NCCL's buffers are not part of
            "peak_mem_gib": float(est.peak_memory_bytes[0] - nccl_buffer_bytes(est_table, case.hw)[0]) / GIB,
            "fits": bool(est.fits[0]), "device_peak_gib": float(est.peak_memory_bytes[0]) / GIB,
            "capacity_gib": float(est.capacity_bytes) / GIB,
            "params_opt_gib": (m["params"] + m["grads"] + m["optimizer"]) / GIB,
            "activations_gib": m["activations"] / GIB, "mfu": float(est.mfu[0]),
            # the per-rank breakdown again, only for the rows that carry an nvidia-smi reading
            **({"nvidia_smi_gib": nvidia_smi_gib(case, est_table, coeffs)} if "nvidia_smi_gib" in case.measured
               else {})}


def nvidia_smi_gib(case: Case, table, coeffs: Coefficients) -> float:
    """What nvidia-smi shows on the GPUs of `case.smi_ranks` (the heaviest of them): their device bytes (the
    caching allocator's reserved peak and NCCL's buffers, `memory_by_rank`) plus the CUDA context."""
    by_rank = memory_by_rank(table, case.model, case.workload, coeffs, hw=case.hw)
    return max(float(sum(v[0] for v in by_rank[w].values())) for w in case.smi_ranks) / GIB + case.hw.cuda_context_gib


# the Plan fields, as `titan-plan estimate` flags (booleans: --[no-]flag)
PLAN_FLAGS = {"dp_replicate": "--dp-replicate", "dp_shard": "--dp-shard", "pp": "--pp", "tp": "--tp", "cp": "--cp",
              "ep": "--ep", "microbatch": "--microbatch", "n_microbatches": "--n-microbatches",
              "stages_per_rank": "--stages-per-rank", "schedule": "--schedule", "ac": "--ac",
              "reshard_after_forward": "reshard", "compile": "compile", "float8": "float8"}


def _spec_ref(spec, kind: str, folder: Path, stem: str) -> str:
    """A preset's name when `spec` is that preset unchanged, else a YAML file of it written under `folder`."""
    if (PRESET_DIR / kind / f"{spec.name}.yaml").is_file():
        if (load_model if kind == "models" else load_hardware)(spec.name) == spec:
            return spec.name
    path = folder / f"{stem}.{kind[:-1] if kind.endswith('s') else kind}.yaml"
    path.write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
    return str(path)


def _hardware_args(hw, folder: Path, stem: str) -> list[str]:
    """--hardware as a preset, with --nic-gbps / --gpus-per-nic where the row states its cluster's NICs (BLOOM's
    Jean Zay: a100-80g with four 100 Gb/s Omni-Path links per node), else as a YAML file written to `folder`."""
    if (PRESET_DIR / "hardware" / f"{hw.name}.yaml").is_file() and hw.nic_gbps is not None:
        base = dataclasses.replace(load_hardware(hw.name), gpus_per_node=hw.gpus_per_node)
        if base != hw and dataclasses.replace(base, inter_node_bw_gbs=None, nic_gbps=hw.nic_gbps,
                                              gpus_per_nic=hw.gpus_per_nic) == hw:
            return ["--hardware", hw.name, "--nic-gbps", f"{hw.nic_gbps:g}", "--gpus-per-nic", f"{hw.gpus_per_nic:g}"]
    return ["--hardware", _spec_ref(hw, "hardware", folder, stem)]


def cli_args(case: Case, folder: Path) -> list[str]:
    """The row as a ``titan-plan estimate`` command line (the arguments after ``titan-plan``): every plan
    and workload key as a flag, the model and hardware as presets (a cluster's stated NICs by flag) or as YAML files
    written to `folder`.
    It predicts what :func:`predict` does (tests/test_reference_accuracy.py runs every scored row)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", case.id)
    wl, plan = case.workload, case.plan
    argv = ["estimate", "--model", _spec_ref(case.model, "models", folder, stem),
            *_hardware_args(case.hw, folder, stem), "--gpus", str(plan.world_size),
            "--gpus-per-node", str(case.hw.gpus_per_node), "--seq-len", str(wl.seq_len),
            "--global-batch", str(wl.global_batch)]
    for key, flag in PLAN_FLAGS.items():
        v = getattr(plan, key)
        argv += [f"--{flag}" if v else f"--no-{flag}"] if isinstance(v, bool) else [flag, str(v)]
    default = Workload(seq_len=wl.seq_len, global_batch=wl.global_batch)
    for key in Workload.__dataclass_fields__:
        if key not in ("seq_len", "global_batch") and getattr(wl, key) != getattr(default, key):
            argv += workload_flag(key, getattr(wl, key))
    return argv


def workload_flag(key: str, value) -> list[str]:
    """A workload key's value as `titan-plan estimate` flags: --[no-]key for a boolean, lists comma-joined."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, ",".join(value) if isinstance(value, tuple) else str(value)]


def evaluate(cases, coeffs: Coefficients | None = None) -> list[dict]:
    out = []
    for c in cases:
        p = predict(c, coeffs)
        for metric, meas in c.measured.items():
            out.append({"id": c.id, "metric": metric, "measured": meas, "predicted": p[metric],
                        "ape": abs(p[metric] - meas) / meas * 100.0, "plan": c.plan.describe(),
                        "counted": metric not in c.not_counted, "why": c.not_counted.get(metric, "")})
    return out


def summarize(results) -> dict[str, dict]:
    groups = {"throughput": ["tokens_per_s_per_gpu"],
              "memory": ["peak_mem_gib", "params_opt_gib", "activations_gib", "nvidia_smi_gib"]}
    out = {}
    for g, metrics in groups.items():
        rows = [r for r in results if r["metric"] in metrics and r.get("counted", True)]
        if rows:
            worst = max(rows, key=lambda r: r["ape"])
            out[g] = {"n": len(rows), "median_ape": statistics.median(r["ape"] for r in rows),
                      "worst_ape": worst["ape"], "worst_id": f"{worst['id']}:{worst['metric']}"}
    return out


def _verdict_check(cases, which, should_fit: bool, coeffs: Coefficients | None) -> dict:
    """{'n': cases `which` selects, 'misses': [(id, predicted GiB, capacity GiB)] whose fit verdict is wrong}."""
    misses, n = [], 0
    for c in filter(which, cases):
        n += 1
        p = predict(c, coeffs)
        if p["fits"] != should_fit:
            misses.append((c.id, p["device_peak_gib"], p["capacity_gib"]))
    return {"n": n, "misses": misses}


def fit_check(cases, coeffs: Coefficients | None = None) -> dict:
    """Every run that trained must be predicted to fit."""
    return _verdict_check(cases, lambda c: c.trained, True, coeffs)


def oom_check(cases, coeffs: Coefficients | None = None) -> dict:
    """Every layout that ran out of memory must be predicted not to fit (the planner would have called
    it feasible)."""
    return _verdict_check(cases, lambda c: c.oom, False, coeffs)


def load_set(name: str) -> list[dict]:
    if name == "shared":
        return load_rows()
    if name == "extra":
        return load_extra_rows()
    raise ValueError(f"--set: unknown set '{name}' (allowed: shared, extra, both)")


def headline_part(name: str, cases, skipped, results, fit) -> str:
    s = summarize(results)
    parts = []
    for g in ("throughput", "memory"):
        if g in s:
            x = s[g]
            parts.append(f"{g} n={x['n']} median {x['median_ape']:.1f}% worst {x['worst_ape']:.1f}% ({x['worst_id']})")
        else:
            parts.append(f"{g} n=0")
    parts.append(f"fit {fit['n'] - len(fit['misses'])}/{fit['n']} trained runs predicted to fit")
    oom = fit.get("oom") or {"n": 0, "misses": []}
    if oom["n"]:
        parts.append(f"oom {oom['n'] - len(oom['misses'])}/{oom['n']} out-of-memory layouts predicted not to fit")
    return f"{name}: {len(cases)} rows expressed, {len(skipped)} not; " + ", ".join(parts)


def ranking_groups(cases, results) -> dict[str, tuple[float, int]]:
    """Spearman rho of predicted vs measured tokens/s/GPU among the layouts of one job -- the same
    model, hardware, GPU count and sequence length (the planner's question: which layout is faster) --
    in one publication (another software release measuring the same layout again is not a ranking), for every
    job with at least 3 scored layouts."""
    by_id = {c.id: c for c in cases}
    jobs: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        if r["metric"] != "tokens_per_s_per_gpu" or not r["counted"]:
            continue
        c = by_id[r["id"]]
        key = f"{c.model.name} x{c.plan.world_size} {c.hw.name} seq {c.workload.seq_len}"
        key += f" [{c.publication}]" if c.publication else ""
        jobs.setdefault(key, []).append((r["measured"], r["predicted"]))
    out = {}
    for key, pairs in jobs.items():
        if len(pairs) >= 3:
            m, p = zip(*pairs)
            out[key] = (float(spearmanr(m, p).statistic), len(pairs))
    return out


def report_set(name: str, rows) -> str:
    cases, skipped = build_cases(rows)
    results = evaluate(cases)
    fit = fit_check(cases)
    fit["oom"] = oom_check(cases)
    print(f"== set '{name}' ({len(rows)} rows)")
    print(f"{'row':48s} {'metric':22s} {'measured':>10s} {'predicted':>10s} {'APE%':>6s}  plan")
    for r in results:
        mark = " " if r["counted"] else "x"
        print(f"{r['id']:48s} {r['metric']:22s} {r['measured']:10.1f} {r['predicted']:10.1f} {r['ape']:6.1f}{mark} "
              f"{r['plan']}")
    print(f"\nnot expressible ({len(skipped)} rows):")
    for rid, why in skipped:
        print(f"  {rid}: {why}")
    shown = [r for r in results if not r["counted"]]
    if shown:
        print(f"\nshown above with 'x' but not scored ({len(shown)} metrics):")
        for r in shown:
            print(f"  {r['id']} {r['metric']}: {r['why']}")
    if fit["misses"]:
        print(f"\ntrained runs predicted NOT to fit ({len(fit['misses'])} of {fit['n']}):")
        for rid, gib, cap in fit["misses"]:
            print(f"  {rid}: predicted {gib:.1f} GiB > {cap:.1f} GiB usable")
    oom = fit["oom"]
    if oom["misses"]:
        print(f"\nlayouts that ran out of memory predicted to FIT ({len(oom['misses'])} of {oom['n']}):")
        for rid, gib, cap in oom["misses"]:
            print(f"  {rid}: predicted {gib:.1f} GiB <= {cap:.1f} GiB usable")
    by_fw = {}
    fw = {r["id"]: str(r.get("framework") or r["id"].split("_")[0]) for r in rows}
    for r in results:
        if r["counted"]:
            by_fw.setdefault((fw[r["id"]], "throughput" if r["metric"] == "tokens_per_s_per_gpu" else "memory"), []).append(r["ape"])
    if by_fw:
        print("\nby framework (median / worst APE, n):")
        for (f, g), apes in sorted(by_fw.items()):
            print(f"  {f:26s} {g:10s} {statistics.median(apes):6.1f}% / {max(apes):6.1f}%  n={len(apes)}")
    groups = ranking_groups(cases, results)
    if groups:
        print("\nranking within a job (same model, hardware, GPUs, sequence length; >= 3 layouts): Spearman rho")
        for key, (rho, n) in groups.items():
            print(f"  {key:60s} rho {rho:+.2f}  n={n}")
    s = summarize(results)
    print(f"\nset '{name}':")
    for g in ("throughput", "memory"):
        if g in s:
            x = s[g]
            print(f"  {g}: n={x['n']} median APE {x['median_ape']:.1f}%, worst {x['worst_ape']:.1f}% ({x['worst_id']})")
    print(f"  fit: {fit['n'] - len(fit['misses'])} of {fit['n']} trained runs predicted to fit")
    if oom["n"]:
        print(f"  oom: {oom['n'] - len(oom['misses'])} of {oom['n']} layouts that ran out of memory predicted not to fit")
    print()
    return headline_part(name, cases, skipped, results, fit)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=("shared", "extra", "both"), default="both",
                    help="which reference set to score (default: both, each separately)")
    ap.add_argument("--cli", metavar="DIR", help="also print each scored row as a titan-plan estimate command line "
                    "(models and hardware that are not presets are written as YAML files under DIR)")
    args = ap.parse_args(argv)
    names = SETS if args.set == "both" else (args.set,)
    ref = reference_dir()
    if "shared" in names and not (ref / "published_runs.yaml").is_file():
        print(f"reference data not found under {ref} (set TITAN_REFERENCE_DIR)")
        if args.set == "shared":
            return 2
        names = tuple(n for n in names if n != "shared")
    heads = [report_set(n, load_set(n)) for n in names]
    if args.cli:
        for n in names:
            print(f"== set '{n}' as titan-plan command lines")
            for c in build_cases(load_set(n))[0]:
                print(f"{c.id}: titan-plan " + " ".join(cli_args(c, Path(args.cli))))
    print("HEADLINE " + " | ".join(heads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
