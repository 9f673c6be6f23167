"""What titan-plan is asked: model, hardware, workload and devices, from flags, a plan file and this machine.

Every `Workload` key has a flag (``--seq-len``, ``--global-batch`` or ``--global-batch-tokens``,
``--dtype``, ``--state-layout``, ``--zero``, ``--attention-impl``, ``--dropout``,
``--sequence-parallel``, ``--selective-ac``) and can come from a plan file's ``workload:``
block, where an unknown key is refused by name.  A flag wins over the plan file, which wins
over the defaults.  The result is one frozen `PlanInputs`; `PlanInputs.echo` is what
``--json`` and the plan file's ``inputs:`` block report.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Any, Mapping

from cost_models.coefficients import Coefficients
from cost_models.frameworks import framework_help, get_framework
from cost_models.specs import HardwareSpec, ModelSpec, SpecError, load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.planfile import read_plan_file
from search_spaces.typed import INT_LIMIT, MAX_WORLD_SIZE, InputError, check_keys, show

from .local import LocalDevices, detect_local_devices, on_this_host

DEFAULT_MODEL = "llama3-debug"
WORKLOAD_KEYS = tuple(f.name for f in dataclasses.fields(Workload))
# the workload keys whose flag is a plain --key-name VALUE (or --[no-]key-name for booleans)
WORKLOAD_FLAGS = ("dtype", "state_layout", "zero", "attention_impl", "dropout", "sequence_parallel",
                  "selective_ac", "recompute_modules", "tp_activations", "norm_impl", "swiglu_impl", "gqa_kv", "grad_dtype", "loss_impl",
                  "grad_accum", "ep_a2a_overlap", "moe_weighting", "ep_dispatch", "pp_sent_tensors", "pp_recv_buffers", "pp_grad_sync", "pp_split",
                  "tp_comm_overlap", "dp_comm_overlap", "moment_dtype", "master_dtype", "expert_tp", "float8_cache")
WORKLOAD_HELP = {
    "dtype": "compute dtype (default bf16; fp32 on CPU)",
    "state_layout": "how parameters, gradients and optimizer states are held: fsdp2 (this executor, "
                    "default) or megatron (bf16 params + fp32 main grads/params, 18 B/param)",
    "zero": "megatron layout: ZeRO stage, 0 = nothing sharded, >= 1 = optimizer states sharded (default 3)",
    "attention_impl": "fused (flash / SDPA, default) or materialized (keeps the s x s scores, Megatron "
                      "without flash attention)",
    "dropout": "dropout masks kept for backward (default no)",
    "sequence_parallel": "sequence parallel with tp > 1 (default yes; no = norm/dropout activations "
                         "replicated over tp ranks)",
    "selective_ac": "what 'ac: selective' keeps: matmul (every matmul output) or op (TorchTitan's per-op "
                    "policy: every other one), both run by this executor; auto (default: matmul, or op where "
                    "only it lets the faster setting fit; titan-plan says which); attention (Megatron: recompute "
                    "the attention core only) or modules (Megatron's recompute_modules, see --recompute-modules)",
    "recompute_modules": "comma-separated Megatron-core submodules to recompute under 'ac: selective' "
                         "(implies --selective-ac modules), of core_attn (default), layernorm, mla_up_proj, mlp, "
                         "moe_act, moe, shared_experts",
    "tp_activations": "what a TP block keeps of its gathered tensors: auto (default: gathered for fsdp2, sharded "
                      "for megatron), gathered (DTensor-style TP, titan-run's default) or sharded (Megatron SP: the "
                      "sequence shard, all-gathered again in backward; titan-run runs it on spmd_types, eager, "
                      "ac none or full)",
    "norm_impl": "norm kernel: auto (default: fused when compiled, else titan-run's eager norm, keeping its input "
                 "and the fp32 rstd), eager (PyTorch's composite: keeps the fp32 upcast and the normalized output), "
                 "fused (one kernel keeping its input: Apex/TE/Triton) or composite (PyTorch's nn.RMSNorm as "
                 "TorchTitan runs it: fused when compiled, else eager)",
    "swiglu_impl": "SwiGLU kernel: auto (default: fused: titan-run's Function, Megatron's kernel), eager "
                   "(autograd of the plain code keeps gate, up, silu(gate) and the product; 2 of them when compiled: "
                   "TorchTitan) or fused (one kernel keeping gate and up, the down projection its input: titan-run, "
                   "Megatron, TE, Liger) or "
                   "fused_ffn (the whole FFN as one function keeping gate and up, rebuilding the product in "
                   "backward: xformers' SwiGLU op)",
    "gqa_kv": "how attention takes grouped-query K/V: auto (default: native), expanded (repeated to n_heads "
              "before SDPA and saved so: TorchTitan's repeat_kv) or native (kept at n_kv_heads: titan-run's SDPA "
              "with enable_gqa, flash-attn, cuDNN, Transformer Engine)",
    "grad_dtype": "megatron layout: main-gradient dtype, auto (default: fp32, or bf16 where an estimate's "
                  "fp32 main gradients do not fit and bf16 ones do, said in a note), fp32 (Megatron-LM) or bf16 "
                  "(NeMo / Megatron-Bridge performance recipes, grad_reduce_in_fp32=False)",
    "loss_impl": "cross-entropy: auto (default: for fsdp2 this executor's, fused at tp 1 -- compiled with "
                 "compile on, else its fused autograd Function -- and eager on vocab-sharded logits; fused for "
                 "megatron, whose loss works in place), eager (F.cross_entropy on fp32-upcast logits), compiled "
                 "(that code compiled with the model at tp 1 when the plan compiles, else eager: TorchTitan) or "
                 "fused (another framework's kernel: keeps only the logits, writes their gradient in place)",
    "grad_accum": "how micro-batch gradients accumulate: auto (default: autograd for fsdp2, fused for megatron), "
                  "autograd (grad += g), fused (in the weight-gradient GEMM, Megatron) or hp_copy (DeepSpeed's "
                  "BF16 optimizer copies into fp32 after every micro-batch)",
    "ep_a2a_overlap": "MoE all-to-alls: none (default: on the critical path, titan-run) or combined_1f1b "
                      "(Megatron's overlap_moe_expert_parallel_comm: one micro-batch's dispatch/combine under "
                      "another's compute; needs ep > 1, Interleaved1F1B when pp > 1, no full or 'moe' recompute)",
    "moe_weighting": "where MoE router weights multiply: auto (default: activation for megatron, combine for "
                     "fsdp2), combine (weighted sum of the expert outputs, which are kept: titan-run, TorchTitan) or "
                     "activation (Megatron-core >= 0.13 multiplies them into the experts' activation)",
    "ep_dispatch": "how MoE tokens reach experts on other nodes: auto (default: every_copy for fsdp2; for "
                   "megatron per_node with node-limited routing), every_copy (an all-to-all of every routed copy: "
                   "titan-run, TorchTitan, Megatron's alltoall dispatcher) or per_node (DeepEP / HybridEP, Megatron's "
                   "flex dispatcher: once per remote node, then over NVLink)",
    "pp_sent_tensors": "what the pipeline runtime does with the tensors a stage has sent: auto (default: "
                       "released for fsdp2, freed for megatron), kept (torch.distributed.pipelining as "
                       "TorchTitan runs it: stage outputs cached, multi-stage schedules hold sends to the step's "
                       "end), released (titan-run: a sent output let go once its gradient is back, a sent input "
                       "gradient once the peer's next message shows it used it) or freed (Megatron's deallocate_pipeline_outputs, "
                       "the Llama 3 paper)",
    "pp_recv_buffers": "how long a pipeline stage keeps the tensors it receives into: auto (default: "
                       "per_microbatch), per_microbatch (titan-run, Megatron: a micro-batch's buffer from its "
                       "receive to its use) or persistent (torch's PipelineStage as TorchTitan runs it: one "
                       "buffer per micro-batch and direction, kept for the stage's life)",
    "pp_grad_sync": "when FSDP reduce-scatters gradients under a pipeline: auto (default: last_microbatch, or "
                    "every_microbatch where only that makes a faster layout fit), last_microbatch (torch's "
                    "pipelining, unsharded fp32 gradients accumulated) or every_microbatch (each micro-batch into "
                    "the shard, as the Llama 3 paper's FSDP; fsdp2 layout only; titan-run runs both, every_microbatch "
                    "not on the V schedules)",
    "pp_split": "how the layers are cut into pipeline stages: layers (default: as even as possible, the earlier "
                "stages larger) or weighted (the embedding and the LM head count as one layer each, so the end "
                "stages hold one fewer: DeepSpeed's type:transformer|embedding, Megatron's account-for-embedding/"
                "loss, the Llama 3 paper; titan-run runs both)",
    "tp_comm_overlap": "TP collectives: auto (default: the framework's or calibration's tp_overlap; titan-run: "
                       "none; the megatron layout on H100/H200/B200: full, as NVIDIA's recipes), none (on the "
                       "critical path: plain TP), full (each collective under the matmul that reads or writes its "
                       "tensor: Megatron's tp_comm_overlap userbuffers) or async (TorchTitan's async TP: torch's "
                       "micro_pipeline_tp fuses an all-gather with the matmuls it feeds and a reduce-scatter with the "
                       "one matmul that feeds it, so backward the reduce-scatter of summed Q/K/V or gate/up input "
                       "gradients stays exposed)",
    "moment_dtype": "AdamW's two moments: fp32 (default; titan-run) or bf16 (DeepSeek-V3, arXiv:2412.19437 Sec. "
                    "3.3.3; Megatron-core's --exp-avg-dtype bf16): 4 instead of 8 optimizer bytes per parameter, the "
                    "fp32 master copy unchanged",
    "master_dtype": "megatron layout: the optimizer's copy of the parameters, fp32 (default) or bf16 (no fp32 "
                    "copy: Apex's DistributedFusedAdam with dtype bf16, NeMo's distributed_fused_adam; Megatron-core's "
                    "--main-params-dtype): 2 instead of 4 optimizer bytes per parameter",
    "expert_tp": "MoE: the routed experts split over TP (tp: Megatron-core's default expert_tensor_parallel_size) "
                 "or whole on every TP rank (1: Megatron's expert_tensor_parallel_size 1; titan-run, which also keeps "
                 "the router and shared experts whole); auto (default): tp for the megatron layout, 1 for fsdp2",
    "float8_cache": "what float8 linears keep for backward (with --float8): auto (default: for fsdp2 the "
                    "coefficients' float8_saved_input_fraction, torchao's high-precision input, titan-run; fp8 for "
                    "megatron), fp8 (1-byte inputs, "
                    "attention keeps its own output: Transformer Engine) or fine_grained (DeepSeek-V3 Sec. 3.3.3: "
                    "fp8 inputs with a scale per 1x128 tile, the attention output once in E5M6, MoE SwiGLU inputs "
                    "in fp8; memory only, the step time stays tensorwise float8's)",
    "dp_comm_overlap": "DP / FSDP collectives: auto (default: the framework's or calibration's dp_overlap; "
                       "titan-run: full), full (prefetched / bucketed under compute: FSDP2, Megatron's "
                       "overlap_grad_reduce) or none (after the backward: overlap_grad_reduce off, DeepSpeed's "
                       "pipeline engine)",
}
assert set(WORKLOAD_FLAGS) | {"seq_len", "global_batch"} == set(WORKLOAD_KEYS), "a Workload key has no flag"


class UsageError(InputError):
    """A flag that cannot be used as given."""


@dataclass(frozen=True)
class PlanInputs:
    """Everything a planning question is made of (what `resolve_inputs` returns)."""

    model: ModelSpec
    hardware: HardwareSpec       # with gpus_per_node set to the topology planned for
    workload: Workload
    gpus: int
    gpus_per_node: int
    coeffs: Coefficients | None
    local: LocalDevices | None   # this machine, when it supplied the hardware or the device count
    model_ref: str               # as given: preset name or path (what a plan file names)
    hardware_ref: str
    calibration: str | None = None
    framework: str = "titan-run"  # the regime the workload and overlap defaults came from (--framework)
    framework_implied: bool = False   # not given: taken from the state layout (`IMPLIED_FRAMEWORK`)
    layout_from_zero: bool = False    # the state layout not given either: megatron, the one whose ZeRO --zero set
    nics_given: bool = False      # --nic-gbps / --gpus-per-nic (or the plan file's) replaced the spec's NICs

    def echo(self) -> dict[str, Any]:
        """Every input, as plain values (``--json`` and the plan file's ``inputs:``)."""
        w = self.workload
        return {"model": self.model_ref, "hardware": self.hardware_ref, "gpus": self.gpus,
                "gpus_per_node": self.gpus_per_node, "nic_gbps": self.hardware.nic_gbps,
                "gpus_per_nic": self.hardware.gpus_per_nic, "seq_len": w.seq_len, "global_batch": w.global_batch,
                "global_batch_tokens": w.global_batch_tokens, "dtype": w.dtype, "workload": w.to_dict(),
                "calibration": self.calibration, "framework": self.framework,
                "local_devices": self.local.description if self.local else None}

    def workload_line(self) -> str:
        """``seq_len 8192, global batch 2048 sequences = 16,777,216 tokens, bf16`` and any non-default key."""
        w = self.workload
        extra = "".join(f", {k} {v}" for k, v in w.to_dict().items()
                        if k not in ("seq_len", "global_batch", "dtype") and v != _WORKLOAD_DEFAULTS[k])
        return (f"seq_len {w.seq_len}, global batch {w.global_batch} sequences = {w.global_batch_tokens:,} tokens, "
                f"{w.dtype}{extra}")

    def headline(self) -> str:
        h = self.hardware
        nics = f", a {h.nic_gbps:g} Gb/s NIC per {h.gpus_per_nic:g}" if self.nics_given else ""
        t = int(h.threads_per_process(self.gpus))
        threads = f", {t} threads each" if t > 1 else ""      # a CPU host with more cores than processes
        return (f"{self.model.name} on {self.gpus} x {h.name} ({self.gpus_per_node} per node{nics}{threads}), "
                f"{self.workload_line()}" + (f", framework {self.framework}" if self.framework != "titan-run" else "")
                + (f"  [local: {self.local.description}]" if self.local else ""))


_WORKLOAD_DEFAULTS = Workload(seq_len=1, global_batch=1).to_dict()    # as plain values, like workload_line's


# --------------------------------------------------------------------------- flags
def add_input_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the planning question, shared by `titan-plan plan` and `titan-plan estimate`."""
    p.add_argument("--model", help=f"model preset name or YAML path (default {DEFAULT_MODEL}; "
                                   "'titan-plan list models')")
    p.add_argument("--gpus", type=int, help="number of devices (default: this machine's)")
    p.add_argument("--hardware", help="hardware preset or YAML path (default: this machine's); a preset's name in "
                                      "any case, or a GPU's device name such as 'H100' or 'A100-SXM4-80GB'")
    p.add_argument("--gpus-per-node", type=int, help="devices per node (default: from the hardware spec)")
    p.add_argument("--nic-gbps", type=float, metavar="GBPS",
                   help="line rate of one inter-node NIC in Gb/s, e.g. 100 for Omni-Path or EFA v1, 400 for NDR "
                        "InfiniBand (default: from the hardware spec)")
    p.add_argument("--gpus-per-nic", type=float, metavar="N",
                   help="devices sharing one inter-node NIC, e.g. 2 for four NICs on an 8-GPU node (default: from "
                        "the hardware spec; 1 where --nic-gbps is given and the spec has no NICs)")
    p.add_argument("--calibration", help="calibration file from 'titan-plan calibrate'")
    p.add_argument("--framework", metavar="NAME",
                   help="start from the workload keys and overlaps another framework's runs use, to check a "
                        "published configuration (workload flags and a plan file's workload: still win): "
                        + framework_help() + " (default titan-run). A regime also fills in the plan keys its "
                        "runs set that the question leaves out, with a note: the Megatron stacks' fused kernels "
                        "(as --compile), llama3-meta's interleaved schedule and no reshard")
    w = p.add_argument_group("workload (each also a key of a plan file's 'workload:')")
    w.add_argument("--seq-len", "--seq-length", type=int,
                   help="sequence length (default: 8192, or 256 for debug models)")
    g = w.add_mutually_exclusive_group()
    g.add_argument("--global-batch-tokens", help="tokens per optimizer step; K/M/G suffixes are binary "
                                                 "(4M = 4*2^20) (default: about 1M tokens)")
    g.add_argument("--global-batch", "--global-batch-size", type=int, help="sequences per optimizer step")
    hints = typing.get_type_hints(Workload)
    for key in WORKLOAD_FLAGS:
        flag = "--" + key.replace("_", "-")
        typ = hints[key]
        if typ is bool:
            w.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None,
                           help=WORKLOAD_HELP[key])
        elif typing.get_origin(typ) is typing.Literal:
            w.add_argument(flag, dest=key, choices=typing.get_args(typ), help=WORKLOAD_HELP[key])
        elif typing.get_origin(typ) is tuple:     # a comma-separated list; the Workload checks its items
            w.add_argument(flag, dest=key, metavar="A,B,...", type=_comma_list, help=WORKLOAD_HELP[key])
        else:
            w.add_argument(flag, dest=key, type=typ, help=WORKLOAD_HELP[key])
    w.add_argument("--use-distributed-optimizer", dest="zero", action="store_const", const=1,
                   help="Megatron-LM's flag: --zero 1 (the megatron layout's distributed optimizer)")


def _comma_list(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def parse_tokens(s: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", s)
    if not m:
        raise UsageError(f"--global-batch-tokens: cannot read {s!r} (examples: 4M, 1048576, 512K)")
    mult = {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}[m.group(2).lower()]
    v = float(m.group(1)) * mult
    if v < 1 or v != int(v):
        raise UsageError(f"--global-batch-tokens: {s!r} is not a whole number of tokens")
    return int(v)


# --------------------------------------------------------------------------- resolving
def read_question(path: str | None, args) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the plan file's partial plan, its defaults for `resolve_inputs`); two empty mappings without a file.

    The device count is the file's ``inputs.gpus``, else its plan's world size (unless --gpus is given).
    """
    if not path:
        return {}, {}
    pf = read_plan_file(path, parse_plan=False)
    given = dict(pf["plan"] or {})
    inputs = pf.get("inputs") or {}
    d = {"model": pf.get("model"), "hardware": pf.get("hardware"), "workload": pf.get("workload"),
         "gpus": inputs.get("gpus"), "gpus_per_node": inputs.get("gpus_per_node"),
         "nic_gbps": inputs.get("nic_gbps"), "gpus_per_nic": inputs.get("gpus_per_nic"),
         "framework": inputs.get("framework")}
    if d["gpus"] is None and args.gpus is None:   # the plan's own world
        d["gpus"] = Plan.from_dict(given, where=f"{path}: plan", runnable=False).world_size
    return given, d


# the regime a question without --framework (or a plan file's framework) is read under, by its state layout: titan-run
# holds fsdp2 state only (executor/config.py refuses the others), so a megatron layout describes a Megatron stack, and
# the generic one (fused kernels, selective recompute of the attention core, ZeRO-1) fills in what the question
# leaves out, as --framework megatron-lm does, but for the main gradients' dtype (`resolve_inputs`); the estimate
# says so in a note
IMPLIED_FRAMEWORK = {"megatron": "megatron-lm"}


def implied_framework_note(q: "PlanInputs") -> str | None:
    """One line when the regime was taken from the state layout, else None."""
    if not q.framework_implied:
        return None
    zero = (f"state-layout not given: 'megatron', the layout whose ZeRO stage --zero {q.workload.zero} is (fsdp2 "
            f"shards everything, ZeRO-3); " if q.layout_from_zero else "")
    return (f"{zero}framework not given: '{q.framework}', the stack a {q.workload.state_layout} state layout describes "
            f"(titan-run holds fsdp2 state); --framework NAME for another, e.g. megatron-bridge, megatron-deepspeed")


def resolve_inputs(args, defaults: Mapping[str, Any] | None = None, *, where: str = "plan file") -> PlanInputs:
    """The planning question from flags, then `defaults` (what a plan file says: model, hardware,
    gpus, gpus_per_node, workload), then this machine and the built-in defaults."""
    d = defaults or {}
    model_ref = _given(args.model, d.get("model"), DEFAULT_MODEL)   # None-aware: '' and 0 are refused, not defaults
    model = load_model(model_ref)
    local = None
    hw_ref = args.hardware or d.get("hardware")
    gpus = args.gpus if args.gpus is not None else d.get("gpus")
    if hw_ref is None or gpus is None:
        local = detect_local_devices()
        hw_ref = hw_ref or local.hardware
        gpus = gpus or local.count
    hw = on_this_host(load_hardware(hw_ref), hw_ref)
    _check_count("--gpus (or the plan file's inputs.gpus)", gpus)
    gpn = _given(args.gpus_per_node, d.get("gpus_per_node"),
                 gpus if hw.device == "cpu" else min(hw.gpus_per_node, gpus))
    _check_count("--gpus-per-node (or the plan file's inputs.gpus_per_node)", gpn)
    if gpn != hw.gpus_per_node:      # the topology given (or this host's process count) decides the links
        hw = dataclasses.replace(hw, gpus_per_node=int(gpn))
    nic_args = (getattr(args, "nic_gbps", None), d.get("nic_gbps"), getattr(args, "gpus_per_nic", None),
                d.get("gpus_per_nic"))
    hw = _with_nics(hw, *nic_args)
    fw_name = _given(getattr(args, "framework", None), d.get("framework"), False)
    zero = _given(getattr(args, "zero", None), (d.get("workload") or {}).get("zero"), None)
    partial_zero = isinstance(zero, int) and not isinstance(zero, bool) and zero < 3
    layout = _given(getattr(args, "state_layout", None), (d.get("workload") or {}).get("state_layout"), None)
    by_zero = layout is None and fw_name is False and partial_zero      # ZeRO-0/1/2 exist in the megatron layout
    layout = "megatron" if by_zero else (layout or "fsdp2")
    implied = fw_name is False and layout in IMPLIED_FRAMEWORK
    fw = get_framework(IMPLIED_FRAMEWORK[layout] if implied else ("titan-run" if fw_name is False else fw_name))
    # implied, the regime leaves the gradient dtype to the estimate's comparison (`whatif.workload_variants`):
    # Megatron-LM's fp32 main gradients, or NeMo's and Megatron-Bridge's bf16 where fp32 does not fit
    base = {k: v for k, v in fw.workload.items() if not (implied and k == "grad_dtype")}
    workload = resolve_workload(args, d.get("workload") or {}, model=model, hw=hw, gpus=gpus,
                                where=f"{where}: workload", base=base)
    if partial_zero and workload.state_layout == "fsdp2":
        raise SpecError(f"--zero {zero} (workload key 'zero') is a megatron state layout's ZeRO stage; the fsdp2 "
                        f"layout of framework {fw.name} shards parameters, gradients and optimizer states (ZeRO-3): "
                        f"add --state-layout megatron, or drop --zero")
    coeffs = Coefficients.load(args.calibration) if args.calibration else None
    return PlanInputs(model=model, hardware=hw, workload=workload, gpus=gpus, gpus_per_node=gpn, coeffs=coeffs,
                      local=local, model_ref=str(model_ref), hardware_ref=str(args.hardware or hw.name),
                      calibration=args.calibration, framework=fw.name, framework_implied=implied,
                      layout_from_zero=by_zero,
                      nics_given=any(v is not None for v in nic_args))


def resolve_workload(args, given: Mapping[str, Any], *, model: ModelSpec, hw: HardwareSpec, gpus: int,
                     where: str = "workload", base: Mapping[str, Any] | None = None) -> Workload:
    """Flags over the plan file's `given` workload over `base` (a framework's regime) over the defaults;
    unknown plan-file keys refused."""
    check_keys(given, WORKLOAD_KEYS, where=where, error=SpecError)
    small = _n_params_estimate(model) < 1e8
    seq_len = _given(args.seq_len, given.get("seq_len"), 256 if small else min(8192, model.max_seq_len))
    _check_count(f"--seq-len (or {where}.seq_len)", seq_len, most=INT_LIMIT)
    if args.global_batch:
        gb = args.global_batch
    elif args.global_batch_tokens:
        tokens = parse_tokens(args.global_batch_tokens)
        if tokens % seq_len:
            raise UsageError(f"--global-batch-tokens {tokens} is not a multiple of --seq-len {seq_len}")
        gb = tokens // seq_len
    elif given.get("global_batch") is not None:
        gb = given["global_batch"]
    else:  # default: about 1M tokens for real models, 8 sequences per device for debug models
        gb = 8 * gpus if small else max(1, 2 ** 20 // seq_len)
    kw: dict[str, Any] = dict(base or {})
    kw.update({k: given[k] for k in WORKLOAD_FLAGS if k in given})
    asked = {k for k in WORKLOAD_FLAGS if k in given or getattr(args, k, None) is not None}
    kw.update({k: getattr(args, k) for k in WORKLOAD_FLAGS if getattr(args, k, None) is not None})
    if "recompute_modules" in asked and "selective_ac" not in asked:     # Megatron's --recompute-modules says it
        kw["selective_ac"] = "modules"
    kw.setdefault("dtype", "fp32" if hw.device == "cpu" else "bf16")
    return Workload(seq_len=seq_len, global_batch=gb, **kw)


def _given(*values: Any) -> Any:
    """The first value that is not None (a flag, then the plan file, then the default); None if all are."""
    return next((v for v in values if v is not None), None)


def _with_nics(hw: HardwareSpec, nic_flag, nic_file, per_flag, per_file) -> HardwareSpec:
    """`hw` with the inter-node NICs given by --nic-gbps / --gpus-per-nic (or the plan file's
    ``inputs.nic_gbps`` / ``inputs.gpus_per_nic``) in place of its own; the per-GPU inter-node bandwidth follows
    from them (`HardwareSpec`: nic_gbps / 8 / gpus_per_nic)."""
    if nic_flag is None and nic_file is None and per_flag is None and per_file is None:
        return hw
    nic, per = _given(nic_flag, nic_file, hw.nic_gbps, False), _given(per_flag, per_file, hw.gpus_per_nic, 1.0)
    if nic is False:
        raise UsageError(f"--gpus-per-nic needs --nic-gbps: hardware '{hw.name}' gives no NIC line rate")
    for what, v in (("--nic-gbps (or the plan file's inputs.nic_gbps)", nic),
                    ("--gpus-per-nic (or the plan file's inputs.gpus_per_nic)", per)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise UsageError(f"{what} must be a positive number, got {show(v)}")
    return dataclasses.replace(hw, inter_node_bw_gbs=None, nic_gbps=float(nic), gpus_per_nic=float(per))


def _check_count(what: str, v: Any, *, most: int = MAX_WORLD_SIZE) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
        raise UsageError(f"{what} must be an integer in 1..{most:,}, got {show(v)}")


def _n_params_estimate(model: ModelSpec) -> float:
    return model.n_layers * 12 * model.dim ** 2 + 2 * model.vocab_size * model.dim
