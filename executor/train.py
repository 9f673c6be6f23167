"""The training loop of `titan-run`, top to bottom.

:func:`train` does, in order:

1. process group, device, mesh (``executor.mesh``)
2. model on the meta device -> pipeline split -> parallelize (TP/SP, CP, EP,
   AC, compile, FSDP) -> ``to_empty`` -> layout-independent init: one call,
   ``parallel.build_model_parts`` (the dry run and the self-test use the same)
3. AdamW + linear warmup / cosine LR
4. data: packed sequences, sharded by dp rank
5. the loop: batch -> forward/backward (gradient accumulation, or the
   pipeline schedule) -> global grad-norm clip -> optimizer step -> MoE routing figures /
   expert-bias update (``moe_step.py``) -> metrics

The loss of a step is the mean over every token of the global batch, so a
run of any layout matches a single-process run of the same model, data and
seed (to fp32 rounding).  :func:`setup` and :func:`train_step` are separate so
benchmarks can drive the very same step.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from cost_models.flops import flops_per_token
from cost_models.specs import this_host_cores
from search_spaces.constraints import replicate_split_backward_error

from . import faults
from .checkpoint import Checkpointer
from .comm_timer import CommTimer, all_gather_flat
from .config import ConfigError, RunConfig, dump_resolved
from .cpu_memory import CpuPeakMemory, training_state_bytes
from .data import PackedBatches, build_batches
from .init import local_tensor
from .mesh import AXES, FLAT_AXES, Meshes, build_meshes, init_distributed
from .metrics import hardware_for_device, mfu, world_peak_flops
from .metrics_writer import MetricsWriter
from .moe_step import (collect_step_stats, moe_layers, moe_params, set_aux_loss_scale, sum_moe_grads_over_tp,
                       update_expert_bias)
from .parallel import Precision, build_model_parts, resolve_backend, resolve_precision
from .parallel.context_parallel import cp_shard_batch
from .parallel import spmd_step
from .parallel.pipeline import TiedEmbedding, build_schedule
from .parallel.spmd_pipeline import build_typed_schedule, typed_cp_shard_batch
from .parallel.tensor_parallel import cross_entropy, loss_kind, loss_parallel, loss_value, set_loss
from .summary import prediction_line, summarize, summary_line, write_rank_file

COMM_AXES = AXES + FLAT_AXES + ("ep", "efsdp", "world", "self", "other")


@dataclass
class Trainer:
    cfg: RunConfig
    device: torch.device
    meshes: Meshes
    precision: Precision
    stages: list[tuple[int, nn.Module]]      # [(stage index, module)]; [(0, model)] without PP
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: PackedBatches
    runner: object | None                    # PipelineRunner when pp > 1
    backend: str
    comm: CommTimer
    losses: list[float] = field(default_factory=list)
    moe: list = field(default_factory=list)              # [(layer id, MoEFeedForward)] held here
    moe_tp_params: list = field(default_factory=list)    # MoE params whose grads are summed over tp
    moe_stats: dict | None = None                        # figures of the last step (moe_step.py)
    tied: TiedEmbedding | None = None                    # a tied embedding split over pipeline stages


# --------------------------------------------------------------------------- setup
def loss_context(cfg: RunConfig):
    """`loss_parallel()` when the logits are vocab-sharded (tp > 1), else nothing."""
    return loss_parallel() if cfg.plan.tp > 1 else contextlib.nullcontext()


def build_optimizer(stages, cfg: RunConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices/embeddings only; one param group per mesh (foreach needs one mesh)."""
    t = cfg.train
    groups: dict[tuple, list] = {}
    for _, module in stages:
        for p in module.parameters():
            mesh = p.device_mesh if isinstance(p, DTensor) else None
            groups.setdefault((mesh, p.ndim >= 2), []).append(p)
    param_groups = [{"params": ps, "weight_decay": t.weight_decay if decay else 0.0}
                    for (_, decay), ps in groups.items()]
    impl = t.optimizer_impl
    if impl == "auto":
        # fused on every device: one kernel per group (torch has it for CPU too, as TorchTitan uses it);
        # on CPU `foreach` runs one op per tensor per AdamW stage (2 gloo ranks, llama3 debugmodel
        # shard, 57 tensors: 12.9 ms of CPU per step vs 3.7 fused)
        impl = "fused"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(param_groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **kwargs)


def lr_lambda(cfg: RunConfig):
    """Linear warmup to lr over `warmup` steps, then cosine down to lr*min_lr_ratio at the last step."""
    t = cfg.train

    def factor(step: int) -> float:        # step = optimizer steps taken so far
        if step < t.warmup:
            return (step + 1) / t.warmup
        progress = min(1.0, (step - t.warmup) / max(1, t.steps - t.warmup))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def setup(cfg: RunConfig) -> Trainer:
    # 1. process group, device, mesh
    device = init_distributed(cfg.train.pg_timeout_s)
    if device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, this_host_cores() // max(1, local_world)))   # the planner's rule:
        #   HardwareSpec.threads_per_process
    meshes = build_meshes(cfg.plan, device.type)
    torch.manual_seed(cfg.train.seed)
    precision = resolve_precision(cfg, accelerator=device.type == "cuda")
    backend = resolve_backend(cfg.plan, meshes, announce=dist.get_rank() == 0, spec=cfg.spec)
    err = replicate_split_backward_error(cfg.plan, backend)     # (the dtensor fallback of an older torch)
    if err:
        raise ConfigError(err)

    # 2. model: meta -> split -> parallelize -> materialize -> init (executor/parallel/parallelize.py)
    stages = build_model_parts(cfg.spec, cfg.plan, meshes, precision=precision, backend=backend, device=device,
                               seed=cfg.train.seed, workload=cfg.workload, typecheck=cfg.train.spmd_typecheck)
    params = [p for _, m in stages for p in m.parameters()]
    set_loss(loss_kind(cfg.plan, cfg.workload))
    runner = None
    if cfg.plan.pp > 1 and backend == "spmd_types":     # typed stages and loss: parallel/spmd_pipeline.py
        runner = build_typed_schedule(stages, cfg.plan, meshes, device, typecheck=cfg.train.spmd_typecheck,
                                      grad_sync=cfg.workload.pp_grad_sync_mode)
    elif cfg.plan.pp > 1:
        runner = build_schedule(stages, cfg.plan, meshes.pp, cross_entropy, device,
                                step_context=lambda: loss_context(cfg), grad_sync=cfg.workload.pp_grad_sync_mode)

    # 3. optimizer and LR schedule
    optimizer = build_optimizer(stages, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))

    # 4. data: this rank's share of each global batch
    batches = build_batches(cfg, dp_rank=meshes.dp.get_local_rank(), dp_size=meshes.dp.size())
    comm = CommTimer(meshes.group_names())
    moe = moe_layers(stages)
    set_aux_loss_scale(moe, cfg.spec, cfg.plan)   # the aux loss trains through each MoE layer's backward
    return Trainer(cfg=cfg, device=device, meshes=meshes, precision=precision, stages=stages, params=params,
                   optimizer=optimizer, scheduler=scheduler, batches=batches, runner=runner, backend=backend,
                   comm=comm, moe=moe,
                   moe_tp_params=moe_params(stages) if cfg.plan.tp > 1 and backend == "dtensor" else [],
                   tied=TiedEmbedding(stages, cfg.plan, meshes) if cfg.spec.tie_embeddings and cfg.plan.pp > 1
                   else None)


# --------------------------------------------------------------------------- one step
def forward_backward(tr: Trainer, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Gradients of the mean loss of this rank's batch; returns that loss (a plain tensor, this rank's share)."""
    plan, meshes = tr.cfg.plan, tr.meshes
    tokens, labels = tokens.to(tr.device, non_blocking=True), labels.to(tr.device, non_blocking=True)
    if plan.pp > 1:
        positions = torch.arange(tokens.shape[1], device=tr.device)
        if plan.cp > 1 and tr.backend == "spmd_types":       # the same shares, positions typed V on cp
            tokens, labels, positions = typed_cp_shard_batch(tokens, labels, meshes, plan)
        elif plan.cp > 1:
            tokens, labels, positions = cp_shard_batch(tokens, labels, meshes.cp)
        loss = tr.runner.step(tokens, labels, positions)
        return loss.float() if loss is not None else torch.zeros((), device=tr.device)

    model = tr.stages[0][1]
    if tr.backend == "spmd_types":    # typed local-SPMD step (TP/SP, FSDP): parallel/spmd_step.py
        return spmd_step.forward_backward(model, tokens, labels, meshes, plan, typecheck=tr.cfg.train.spmd_typecheck)
    n = plan.n_microbatches
    total = torch.zeros((), device=tr.device)
    for tok, lab in zip(tokens.chunk(n), labels.chunk(n)):     # gradient accumulation
        positions = None
        if plan.cp > 1:
            tok, lab, positions = cp_shard_batch(tok, lab, meshes.cp)
        with loss_context(tr.cfg):
            loss = cross_entropy(model(tok, positions), lab) / n     # (+ MoE aux loss: moe.AuxLossGrad)
            loss.backward()
        total += loss_value(loss.detach()).float()
    return total


def clip_grad_norm_(tr: Trainer, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (every axis, PP included); scales grads down to `max_norm` if > 0.

    Gradients still Partial (TP without FSDP) are reduced first.  Each gradient's
    local sum of squares is summed over the process groups its DTensor is sharded
    over (replicated dims are not summed, so nothing is counted twice); then over
    the pp group, whose ranks hold different layers.
    """
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    copies = []         # a tied embedding's head copy on the last stage: scaled, not counted twice
    head = tr.tied.head if tr.tied is not None else None
    for p in tr.params:
        g = p.grad
        if g is None:
            continue
        if p is head:
            copies.append(local_tensor(g))
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                # TP without FSDP: grads of replicated weights (norms under SP) are still
                # Partial over tp; reduce them to the parameter's placement (FSDP does this itself)
                g = p.grad = g.redistribute(placements=p.placements)
            # sharded dims (Shard, and _StridedShard, which is not a Shard subclass in torch >= 2.13)
            key = tuple(g.device_mesh.get_group(i) for i, pl in enumerate(g.placements)
                        if not (pl.is_replicate() or pl.is_partial()))
            g = g.to_local()
        else:
            key = ()
        by_groups.setdefault(key, []).append(g)
    total = torch.zeros((), dtype=torch.float32, device=tr.device)
    for groups, grads in by_groups.items():
        sq = torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2).sum()
        for pg in groups:
            dist.all_reduce(sq, group=pg)
        total += sq
    if tr.cfg.plan.pp > 1:
        dist.all_reduce(total, group=tr.meshes.pp.get_group())
    norm = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grads in [*by_groups.values(), *([copies] if copies else [])]:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm


def train_step(tr: Trainer, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns (global mean loss, global grad norm)."""
    local_loss = forward_backward(tr, tokens, labels)
    if tr.tied is not None:   # the embedding and its head copy on the last stage take the sum of their gradients
        tr.tied.sync_grads()
    if tr.moe_tp_params:      # MoE layers ran on each tp rank's own tokens: sum their grads over tp
        sum_moe_grads_over_tp(tr.moe_tp_params, tr.meshes.tp)
    grad_norm = clip_grad_norm_(tr, tr.cfg.train.grad_clip)
    tr.optimizer.step()
    tr.scheduler.step()
    tr.optimizer.zero_grad(set_to_none=True)
    if tr.cfg.spec.is_moe:    # routed-token counts (all ranks), expert-bias update
        plan = tr.cfg.plan
        tr.moe_stats = collect_step_stats(tr.moe, tr.cfg.spec, tr.device, plan.ep, plan.dp_cp * plan.tp,
                                          forwards=plan.n_microbatches)
        if tr.cfg.spec.load_balance_bias:
            update_expert_bias(tr.moe, tr.moe_stats["_counts"], tr.cfg.train.expert_bias_gamma)
    return global_mean_loss(tr, local_loss), grad_norm


def global_mean_loss(tr: Trainer, local_loss: torch.Tensor) -> torch.Tensor:
    """Mean over the global batch: sum over all ranks, divided by the ranks that hold a copy of it.

    Every (dp, cp) position holds its share once per tp rank; among pp ranks only
    the one with the last stage holds a loss (the others contribute 0).
    """
    plan = tr.cfg.plan
    if dist.get_world_size() == 1:
        return local_loss
    t = local_loss.detach().clone().float()
    dist.all_reduce(t)
    return t / (plan.dp_cp * plan.tp)


# --------------------------------------------------------------------------- the loop
def train(cfg: RunConfig, run_dir: Path) -> dict:
    tr = setup(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (run_dir / "plan.yaml").write_text(dump_resolved(cfg))
        # one process has no collective on any axis: neither backend takes part (resolve_backend)
        backend = tr.backend if world > 1 else "none (one process)"
        threads = f" ({torch.get_num_threads()} threads a process)" if tr.device.type == "cpu" else ""
        print(f"titan-run: {cfg.spec.name} seq_len {cfg.seq_len} global batch {cfg.global_batch} | world {world} "
              f"on {tr.device.type}{threads} | mesh {tr.meshes.describe()} | {cfg.plan.describe()} | "
              f"{str(tr.precision.param_dtype).replace('torch.', '')} | backend {backend} | run dir {run_dir}",
              flush=True)
    hw = hardware_for_device(tr.device, cfg.hardware)
    # the current world's peak (an elastic restart with fewer ranks has a smaller one): executor/metrics.py
    peak_flops = world_peak_flops(hw, tr.precision.param_dtype == torch.bfloat16, tr.device)
    fpt = float(flops_per_token(cfg.spec, cfg.seq_len))    # MFU from the cost model's one formula
    records = []
    ckpt = Checkpointer(tr, run_dir)        # executor/checkpoint.py: saves, resume, elastic restarts
    start = ckpt.resume()                    # 0, or the step of the loaded checkpoint
    if start >= cfg.train.steps:
        raise ValueError(f"the checkpoint is at step {start}, train.steps is {cfg.train.steps}: nothing to train "
                         "(raise --steps)")
    writer = MetricsWriter(run_dir, enabled=rank == 0, total_steps=cfg.train.steps,   # keeps lines <= start
                           tensorboard=cfg.train.tensorboard, resume_step=start)
    tr.comm.install()
    try:
        for step in range(start + 1, cfg.train.steps + 1):
            faults.before_step(rank, step, run_dir)     # test hooks (TITAN_RUN_FAULT, TITAN_RUN_KILL)
            rec = run_one_step(tr, step, fpt, peak_flops)
            records.append(rec)
            if rank == 0 and (step % cfg.train.log_every == 0 or step == cfg.train.steps):
                writer.write(rec)
            ckpt.after_step(step)
        ckpt.finish(cfg.train.steps)
    finally:
        tr.comm.uninstall()
        writer.close()
        ckpt.close()
    summary = summarize(tr, records, hw)
    write_rank_file(run_dir, rank, tr, records)
    if rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(summary_line(summary, run_dir, ckpt.last_saved), flush=True)
        vs = prediction_line(summary)
        if vs:
            print(vs, flush=True)
    return summary


def run_one_step(tr: Trainer, step: int, fpt, peak_flops) -> dict:
    cfg, device = tr.cfg, tr.device
    t0 = time.perf_counter()
    tokens, labels = tr.batches.next_batch()
    data_time = time.perf_counter() - t0
    tr.comm.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    profiled = device.type == "cpu" and step == cfg.train.profile_step
    mem = CpuPeakMemory(training_state_bytes(tr.params, tr.optimizer)) if profiled else contextlib.nullcontext()
    lr = tr.scheduler.get_last_lr()[0]
    with mem:
        loss, grad_norm = train_step(tr, tokens, labels)
        loss_f, gnorm_f = float(loss), float(grad_norm)     # syncs the device
    step_time = time.perf_counter() - t0
    comm = tr.comm.snapshot()
    if device.type == "cuda":       # reserved: what the cost model's peak and OOMs are about
        peak, allocated = torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)
    else:
        peak = allocated = mem.peak_bytes if profiled else None
    tr.losses.append(loss_f)

    # per-rank figures -> everyone (one small all-gather, outside the timed step)
    local = torch.tensor([data_time, -1.0 if peak is None else float(peak), -1.0 if allocated is None
                          else float(allocated)] + [comm.get(a, 0.0) for a in COMM_AXES],
                         dtype=torch.float64, device=device)
    world = dist.get_world_size()
    allv = torch.empty(world * local.numel(), dtype=torch.float64, device=device)
    all_gather_flat(allv, local)
    allv = allv.view(world, -1).cpu()
    peaks = [None if v < 0 else int(v) for v in allv[:, 1].tolist()]
    allocs = [None if v < 0 else int(v) for v in allv[:, 2].tolist()]
    comm = allv[:, 3:]
    comm_mean = {a: float(comm[:, i].mean()) for i, a in enumerate(COMM_AXES) if comm[:, i].max() > 0}
    comm_max = {a: float(comm[:, i].max()) for i, a in enumerate(COMM_AXES) if comm[:, i].max() > 0}
    tps = cfg.tokens_per_step / step_time
    moe = {}
    if tr.moe_stats is not None:     # MoE routing and all-to-all figures of this step (moe_step.py)
        moe = {"moe": {k: v for k, v in tr.moe_stats.items() if not k.startswith("_")}}
    return {
        **moe,
        "step": step, "loss": loss_f, "grad_norm": gnorm_f, "lr": lr, "step_time_s": step_time,
        "data_time_s": float(allv[:, 0].max()), "tokens_per_s": tps, "tokens_per_s_per_device": tps / world,
        "mfu": mfu(tps, fpt, peak_flops),
        "peak_memory_bytes": peaks if any(p is not None for p in peaks) else None,
        "peak_memory_bytes_max": max((p for p in peaks if p is not None), default=None),
        "peak_allocated_bytes_max": max((p for p in allocs if p is not None), default=None),
        "comm_s": comm_mean, "comm_s_max": comm_max, "profiled": profiled,
    }


def print_error(rank: int, exc: BaseException) -> None:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in tb.rstrip().splitlines()))
    sys.stderr.flush()
