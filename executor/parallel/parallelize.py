"""Where every parallelism is applied: the one path from a model spec to this rank's model parts.

:func:`build_model_parts` is what training, the dry run and the self-test call:

    meta model -> PP split (``pipeline.pipeline_split``) -> :func:`parallelize` each stage
    -> (real runs) ``to_empty`` on the device -> layout-independent init (``executor/init.py``)

:func:`parallelize` applies, to one model or one pipeline-stage module, in this order:

    float8 conversion -> TP/SP -> CP -> EP -> AC -> compile -> FSDP

* TP before FSDP: FSDP then shards the TP-local shards (FSDP+TP gives
  ``_StridedShard`` placements).
* CP swaps the attention core, so it comes before AC/compile wrap the block.
* EP (plan.ep > 1) swaps each MoE block's ``feed_forward.experts`` for the
  all-to-all version holding E/ep experts (``expert_parallel.py``); FSDP then
  shards those over ``efsdp`` (their own ``fully_shard``, gradient divide
  factor = all data-parallel ranks, see ``fsdp.py``).  Under TP the MoE layers
  are not TP-sharded: they run on the sequence-parallel local tokens and their
  gradients are summed over tp after backward (``moe_step.py``).
* AC wraps each block; compile compiles the (wrapped) block; FSDP goes last
  so its hooks stay outside the compiled region.

``backend``: ``dtensor`` uses DTensor TP and mesh-based FSDP2; ``spmd_types``
(the default) uses local SPMD on every axis (``spmd_tensor_parallel.py``,
``spmd_context_parallel.py``, ``spmd_expert_parallel.py``, ``spmd_pipeline.py``:
plain local parameters typed per axis, typed collectives at module boundaries)
and FSDP2 over the typed parameters, and falls back to ``dtensor`` with one line
naming the missing piece where it cannot run a plan (:func:`resolve_backend`).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
from torch import nn

from cost_models.specs import ModelSpec
from search_spaces.constraints import float8_tp_backend_error, tied_tp_backend_error
from search_spaces.plan import Plan

from ..init import init_weights
from ..models.llama import Transformer
from .activation_checkpoint import apply_ac
from .compile import apply_compile
from .context_parallel import apply_cp
from .expert_parallel import apply_ep
from .fsdp import apply_fsdp, apply_fsdp_spmd, defer_tp_grad_reduction, spmd_fsdp_supported
from .pipeline import pipeline_split
from .spmd_context_parallel import apply_spmd_cp
from .spmd_expert_parallel import apply_spmd_ep
from .spmd_float8 import apply_spmd_float8_tp
from .spmd_step import spmd_mesh
from .spmd_tensor_parallel import apply_spmd_tp, spmd_tp_unsupported
from .tensor_parallel import apply_tp


@dataclass(frozen=True)
class Precision:
    param_dtype: torch.dtype      # dtype of gathered parameters / compute
    reduce_dtype: torch.dtype     # dtype of gradient reductions


def resolve_precision(cfg, *, accelerator: bool) -> Precision:
    """The run's precision: ``train.dtype``, or when it is ``auto`` the workload's dtype (default bf16) on an
    accelerator and fp32 on CPU.  Master weights, gradients reductions and optimizer state stay fp32."""
    dtype = cfg.train.dtype
    if dtype == "auto":
        dtype = cfg.resolved.get("workload", {}).get("dtype", "bf16") if accelerator else "fp32"
    if dtype == "bf16":
        return Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return Precision(param_dtype=torch.float32, reduce_dtype=torch.float32)


def uses_fsdp(plan: Plan, precision: Precision) -> bool:
    """FSDP whenever there are data-parallel ranks, and on one rank for bf16 mixed precision."""
    return plan.dp_cp > 1 or precision.param_dtype != torch.float32


def tp_shards_embedding(plan: Plan) -> bool:
    """Vocab-shard the embedding under dtensor TP, except with compile (docs/torch_on_cpu.md §8c; the
    spmd_types TP always vocab-shards it: exact under compile, §8e)."""
    return not plan.compile


def apply_float8(module: nn.Module) -> None:
    # torchao (0.18) registers an Enum as a pytree constant on import, which torch 2.14 logs as deprecated
    # on every rank: a warning about torchao's code, not the run's; silenced for the import only
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        # optional package (the float8 extra): only float8 plans need it
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise ValueError("plan key 'float8' is true but torchao is not installed (pip install torchao)") from None
    finally:
        pytree_log.setLevel(level)
    # the LM head stays in high precision, as in TorchTitan
    convert_to_float8_training(module, module_filter_fn=lambda mod, fqn: fqn != "output")


def spmd_plan_unsupported(plan: Plan, spec: ModelSpec | None = None) -> str | None:
    """None if the spmd_types path can run `plan` (and `spec`), else the missing piece, in a few words."""
    if plan.tp > 1 and spec is not None and (reason := spmd_tp_unsupported(spec)) is not None:
        return reason
    return None


def resolve_backend(plan: Plan, meshes, *, announce: bool, spec: ModelSpec | None = None) -> str:
    """The backend a run uses for the plan's ``backend`` knob.

    ``spmd_types`` (the default) runs every axis -- FSDP/HSDP, TP/SP (dense, MoE and MLA blocks), CP,
    EP and PP -- eager or with per-block compile (erasure mode: a compiled block's TP boundaries are
    untyped functional collectives traced into its graph, the other typed collectives eager islands
    between the compiled regions): typed local parameters, explicit typed
    collectives (``fsdp.py``, ``spmd_*.py``).  Elsewhere (:func:`spmd_plan_unsupported`) the run
    uses ``dtensor``, announced in ONE line (with `announce`) naming the missing piece: the torch
    version when this torch has no spmd_types FSDP2 (torch < 2.14), else what the plan needs that
    the spmd path lacks.
    """
    if plan.backend == "dtensor":
        return "dtensor"
    if plan.world_size == 1 or (plan.tp == 1 and plan.cp == 1 and meshes.spmd_dp is None):
        # nothing is distributed: no collective, no typed axis (the same step on either backend)
        return "dtensor"
    reason = spmd_fsdp_supported() or spmd_plan_unsupported(plan, spec)
    if reason is None:
        return "spmd_types"
    if announce:
        print(f"titan-run: note: backend dtensor instead of spmd_types: {reason}", file=sys.stderr, flush=True)
    return "dtensor"


def set_rebuild_product(module: nn.Module, on: bool) -> None:
    """Turn on (or off) the FFNs' rebuilt down-projection input (``models/layers.rebuilt_input``: each dense
    FFN and expert group keeps gate and up, not their product too) on every module of `module` that has it:
    :func:`parallelize` turns it on where the workload's ``Workload.ffn_rebuilds_product`` says (``swiglu_impl:
    auto``: blocks neither checkpointed (ac none) nor compiled; ``fused`` keeps the product, a step's elementwise
    pass cheaper for one FFN-width tensor more per block), which the memory model counts
    (cost_models/activations.py)."""
    for m in module.modules():
        if hasattr(m, "rebuild_product"):
            m.rebuild_product = on


def parallelize(module: nn.Module, plan: Plan, meshes, *, precision: Precision, backend: str = "dtensor",
                tp_activations: str = "gathered", typecheck: bool = False,
                rebuild_ffn_product: bool | None = None, selective_ac: str = "matmul") -> nn.Module:
    """Apply the plan's parallelisms to `module` (a whole model or a pipeline stage) in place.

    `tp_activations` (the workload key, resolved: ``gathered`` | ``sharded``) is what TP blocks keep of
    their all-gathered inputs (``spmd_tensor_parallel``); ``sharded`` runs on spmd_types in eager mode,
    with ac none (with ac full the checkpointed blocks save nothing inside: it changes nothing).  Compiled
    blocks get TP boundaries with their types erased, traced into the graph
    (``spmd_tensor_parallel.ERASED_OPS``), unless `typecheck` (``train.spmd_typecheck``) keeps them typed.
    `rebuild_ffn_product` (:func:`set_rebuild_product`; None: on for eager blocks without recompute, the
    ``swiglu_impl: auto`` rule) is what :func:`build_model_parts` reads from the workload, as `selective_ac`
    (``matmul`` | ``op``: what ``ac: selective`` keeps, ``activation_checkpoint``)."""
    err = float8_tp_backend_error(plan, backend)   # the spmd path gives the sharded operands global scales
    if err:
        raise ValueError(err)
    if plan.float8:
        apply_float8(module)
    if tp_activations == "sharded" and plan.tp > 1 and (backend != "spmd_types" or plan.compile
                                                        or plan.ac == "selective"):
        raise ValueError(f"tp_activations 'sharded' runs on backend spmd_types without compile and without "
                         f"selective ac, not with backend {backend!r}, compile {plan.compile}, ac {plan.ac!r}")
    if plan.tp > 1 and backend == "spmd_types":     # under ac full a checkpointed block saves nothing inside
        apply_spmd_tp(module, meshes.tp, tp_activations=tp_activations if plan.ac == "none" else "gathered",
                      erased_blocks=plan.compile and not typecheck)
        if plan.float8:                             # the tp-sharded operands' scales from global amaxes
            apply_spmd_float8_tp(module, meshes.tp)
    elif plan.tp > 1:
        tied = getattr(getattr(module, "spec", None), "tie_embeddings", False)
        if tied and not tp_shards_embedding(plan):      # refused before the launch (constraints.tied_tp_backend_error)
            raise ValueError(tied_tp_backend_error(plan, backend, tied))
        apply_tp(module, meshes.tp, loss_parallel=True, shard_embedding=tp_shards_embedding(plan))
        if tied:        # the head's weight is the embedding's again (both Shard(0): the same vocabulary rows)
            module.tie_weights()
    if plan.cp > 1 and backend == "spmd_types":
        apply_spmd_cp(module, meshes.cp)
    elif plan.cp > 1:
        apply_cp(module, meshes.cp)
    expert_mesh = meshes.expert_spmd if plan.ep > 1 and backend == "spmd_types" else None
    if expert_mesh is not None:
        apply_spmd_ep(module, expert_mesh, meshes.world[tuple(n for n in spmd_mesh(meshes, plan).mesh_dim_names
                                                              if n != "tp")], ep_mesh=meshes.ep)
    elif plan.ep > 1:
        apply_ep(module, meshes.ep)
    if rebuild_ffn_product is None:
        rebuild_ffn_product = plan.ac == "none" and not plan.compile
    set_rebuild_product(module, rebuild_ffn_product)
    apply_ac(module, plan.ac, selective_ac)
    if plan.compile:
        apply_compile(module)
    if backend == "spmd_types":
        apply_fsdp_spmd(module, spmd_mesh(meshes, plan), param_dtype=precision.param_dtype,
                        reduce_dtype=precision.reduce_dtype, reshard_after_forward=plan.reshard_after_forward,
                        expert_mesh=expert_mesh, expert_divide_factor=plan.dp_cp, keep_last=plan.pp == 1)
        if plan.tp > 1 and plan.pp == 1 and plan.n_microbatches == 1 and not typecheck:
            # one all-reduce a step for the tp-pending grads (spmd_step.forward_backward runs it; exact on a
            # one-rank dp axis with one micro-batch, fsdp.defer_tp_grad_reduction)
            deferred = defer_tp_grad_reduction(module, spmd_mesh(meshes, plan))
            if deferred:
                module._deferred_tp_grads = (deferred, meshes.tp.get_group())
    elif uses_fsdp(plan, precision):
        apply_fsdp(module, meshes.fsdp, param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
                   reshard_after_forward=plan.reshard_after_forward,
                   expert_mesh=meshes.expert_fsdp if plan.ep > 1 else None,
                   expert_divide_factor=plan.dp_cp, keep_last=plan.pp == 1)
    return module


def build_model_parts(spec: ModelSpec, plan: Plan, meshes, *, precision: Precision, backend: str = "dtensor",
                      device: torch.device | None = None, seed: int = 0,
                      workload=None, typecheck: bool = False) -> list[tuple[int, nn.Module]]:
    """This rank's model parts, ``[(stage index, module)]`` (``[(0, model)]`` without PP), parallelized.

    Built on the meta device, split into this rank's pipeline stages, each stage parallelized
    (:func:`parallelize`; from `workload`, a ``cost_models.workload.Workload``, its ``tp_activations``:
    ``gathered`` without one, its ``selective_ac`` policy: ``matmul`` without one, and its ``pp_split``: the
    layers-only split without one).  With `device` the parameters are then materialized there and
    initialized from `seed`, the same full values for every layout; without it they stay on
    the meta device (dry run, self-test: shapes and placements only).
    """
    with torch.device("meta"):
        model = Transformer(spec)
    init_rule = model.init_rule
    weighted = workload is not None and workload.pp_weighted
    stages = pipeline_split(model, plan, meshes.pp, weighted) if plan.pp > 1 else [(0, model)]
    tp_activations = "gathered" if workload is None or workload.tp_keeps_gathered else "sharded"
    selective_ac = "matmul" if workload is None else workload.selective_policy
    rebuild = (None if workload is None else
               workload.ffn_rebuilds_product(ac=plan.ac, compiled=plan.compile, float8=plan.float8))
    for _, module in stages:
        parallelize(module, plan, meshes, precision=precision, backend=backend, tp_activations=tp_activations,
                    typecheck=typecheck, rebuild_ffn_product=rebuild, selective_ac=selective_ac)
    if device is not None:
        for _, module in stages:
            module.to_empty(device=device)
            init_weights(module, init_rule, seed=seed, device=device)
    return stages


__all__ = ["Precision", "build_model_parts", "parallelize", "resolve_backend", "resolve_precision",
           "spmd_plan_unsupported", "tp_shards_embedding", "uses_fsdp"]
