"""Pipeline parallel: split the model into stages, run a torch.distributed.pipelining schedule.

Applied first (DESIGN.md order: **PP split**, TP/SP, CP, EP, AC, compile,
FSDP).  :func:`pipeline_split` cuts the (meta) model into stage modules;
the caller parallelizes and materializes each one; :func:`build_schedule`
wraps them in ``PipelineStage`` objects and a schedule and returns a
:class:`PipelineRunner`.

Stages and placement (``n_stages = pp * stages_per_rank``):

* layers are split as evenly as possible (sizes differ by at most one; the
  earlier stages take the extra layers, so the last stage, which also holds
  the norm and the LM head, is never the biggest);
* stage ``s`` keeps ``layers[k]`` for its layer ids (original keys, so
  parameter FQNs are unchanged), ``tok_embeddings`` only if ``s == 0``,
  ``norm``/``output`` only if ``s == n_stages-1`` (others set to ``None``);
* placement on pipeline rank ``r``: ``[r]`` for GPipe/1F1B, loop
  ``[r, r+pp, ...]`` for Interleaved1F1B, V ``[r, 2pp-1-r]`` for
  ZBVZeroBubble/DualPipeV (what the torch schedules expect).

Positions: every stage's forward needs this rank's sequence positions (RoPE;
non-contiguous under CP, and not recoverable from a sequence-sharded hidden
state under TP+SP).  The schedule only passes activations between stages,
so :func:`build_schedule` registers a forward pre-hook on each stage module
that adds ``positions=`` from the runner.  The stage module itself (possibly
an FSDP module) is what ``PipelineStage`` wraps, so parameter FQNs stay
unchanged and the schedule's FSDP handling (``isinstance(submod,
FSDPModule)``: no gradient sync / resharding between micro-batches, one
reduce-scatter after the last one) applies; this handling lives in the
schedule and stage in torch 2.11 and 2.14 alike.

Loss and gradients: ``loss_fn(logits, labels)`` is a mean over one
micro-batch; the schedule (``scale_grads=True``) divides the accumulated
gradients by ``n_microbatches``, so they equal the gradient of the mean loss
over the local batch, like a single-process step over it.  The caller must
zero gradients between steps (scaling applies to everything accumulated).
Under tensor parallel with ``loss_parallel`` the backward of the loss runs
inside ``runner.step``: pass ``step_context=loss_parallel`` (or wrap the call).

Hidden states crossing stages are whatever the stage returns: plain tensors,
including the sequence-sharded local tensors that TP+SP leaves after
``RowwiseParallel(output_layouts=Shard(1))``; shapes are inferred by
``PipelineStage`` from the first micro-batch (torch 2.14 runs one real
forward/backward for it; 2.11 runs a forward on zeros), so the batch shape
must stay fixed across steps.

Fixes applied by :func:`build_schedule` (each found by a parity test; see the
helpers' docstrings):

* ZBVZeroBubble / DualPipeV with FSDP: ``reshard_after_forward`` is switched
  off on the stage's FSDP modules (else missing or silently wrong gradients);
* ... and with compiled blocks as well: the weight gradients are computed in
  the input-backward step (``dw_builder``), since the deferred weight pass was
  silently wrong; torch's functorch ``donated_buffer`` is turned off for these
  schedules (retain_graph in the split backward);
* gloo: warm-up sends from a rank to itself are dropped (torch 2.11 V
  schedules hung on CPU).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from typing import Callable

import torch
import torch._functorch.config as functorch_config
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from cost_models.layout import stage_layer_counts
from executor.init import local_tensor
from executor.parallel.pipeline_sends import grad_send_releases
from executor.config import grad_sync_error
from search_spaces.constraints import RUNTIME_RULES
from search_spaces.plan import Plan

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- split
def split_layers(n_layers: int, n_stages: int, weighted: bool = False) -> list[range]:
    """Contiguous layer ranges per stage, sized by `cost_models.layout.stage_layer_counts` (the one
    split the cost model counts too): sizes differ by at most 1, the earlier stages larger; `weighted`
    (workload ``pp_split: weighted``) counts the embedding and the LM head as a layer each, so the first and
    the last stage hold one fewer (and may hold only the embedding or only the norm and head)."""
    out, start = [], 0
    for n in stage_layer_counts(n_layers, n_stages, weighted):
        out.append(range(start, start + n))
        start += n
    return out


def stage_ids_for_rank(plan: Plan, pp_rank: int) -> list[int]:
    """Stage indices held by pipeline rank ``pp_rank`` (ascending)."""
    pp = plan.pp
    if plan.is_v_schedule:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if plan.is_multi_stage:
        return [pp_rank + k * pp for k in range(plan.stages_per_rank)]
    return [pp_rank]


def _build_stage(model: nn.Module, layer_keys: list[str], keep: set[str], first: bool,
                 last: bool) -> nn.Module:
    # deepcopy with a memo that maps unneeded submodules to None: they are never copied
    memo: dict[int, object] = {}
    for key in layer_keys:
        if key not in keep:
            memo[id(model.layers[key])] = None
    if not first and model.tok_embeddings is not None:
        memo[id(model.tok_embeddings)] = None
    if not last:
        for name in ("norm", "output"):
            if getattr(model, name, None) is not None:
                memo[id(getattr(model, name))] = None
    stage = copy.deepcopy(model, memo)
    for key in layer_keys:
        if key not in keep:
            del stage.layers[key]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


# --------------------------------------------------------------------------- tied embeddings over stages
class TiedEmbedding:
    """A tied embedding split over pipeline stages: the first stage holds the embedding, the last a copy of it as
    the LM head (initialized alike, ``Transformer.init_fqn``).  After each step's backward the two gradients are
    summed, so both copies take the tied weight's gradient and the same optimizer update (Megatron-LM's embedding
    group, ``_allreduce_word_embedding_grads``; the cost model's ``step_time.tied_embedding_sync``): over a
    two-rank group of each pipeline's first and last rank, or on one rank when it holds both stages (the V
    schedules).  ``head`` is the copy the gradient norm leaves out (counted once, as the tied weight)."""

    def __init__(self, stages: list[tuple[int, nn.Module]], plan: Plan, meshes):
        self.embedding = self.head = None
        for s, m in stages:
            if s == 0:
                self.embedding = m.tok_embeddings.weight
            if s == plan.n_stages - 1:
                self.head = m.output.weight
        self.group = None
        if not plan.is_v_schedule:   # every rank joins the creation of every pipeline's pair, in the same order
            world = meshes.world
            pp_dim = world.mesh_dim_names.index("pp")
            rows = world.mesh.movedim(pp_dim, -1).reshape(-1, plan.pp).tolist()
            self.group, _ = dist.new_subgroups_by_enumeration([[r[0], r[-1]] for r in rows])

    def sync_grads(self) -> None:
        """Sum the embedding's and the head copy's gradients (this rank's shards) into both."""
        ends = [p for p in (self.embedding, self.head) if p is not None]
        grads = [local_tensor(p.grad) for p in ends if p.grad is not None]
        if not grads:
            return
        if self.group is None:          # both on this rank
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        else:
            dist.all_reduce(grads[0], group=self.group)


def microbatch_error(plan: Plan) -> str | None:
    """Why the pipeline runtime would reject the plan, or None: the runtime rules of
    ``search_spaces/constraints.py`` -- the micro-batch counts torch's schedules accept and, since the split
    backward recomputes a checkpointed block per pass, no selective checkpointing under the V schedules
    (written there once; a default ``Plan`` already satisfies them, a ``Plan(..., runnable=False)`` may not)."""
    for rule in RUNTIME_RULES:
        if not rule.ok(plan, None):
            return rule.plan_message(plan)
    return None


def _check_plan(plan: Plan) -> None:
    err = microbatch_error(plan)
    if err:
        raise ValueError(err)


def pipeline_split(model: nn.Module, plan: Plan, pp_mesh: DeviceMesh,
                   weighted: bool = False) -> list[tuple[int, nn.Module]]:
    """[(stage_idx, stage_module)] for this pipeline rank; the model is not modified.  `weighted`: workload
    ``pp_split: weighted`` (:func:`split_layers`)."""
    _check_plan(plan)
    if pp_mesh.size() != plan.pp:
        raise ValueError(f"pipeline_split: pp mesh has {pp_mesh.size()} ranks but plan key 'pp' is {plan.pp}")
    return split_for_rank(model, plan, pp_mesh.get_local_rank(), weighted)


def split_for_rank(model: nn.Module, plan: Plan, pp_rank: int, weighted: bool = False) -> list[tuple[int, nn.Module]]:
    """:func:`pipeline_split` for an explicit pipeline rank (no mesh needed)."""
    layer_keys = list(model.layers.keys())
    ranges = split_layers(len(layer_keys), plan.n_stages, weighted)
    out = []
    for s in stage_ids_for_rank(plan, pp_rank):
        keep = {layer_keys[i] for i in ranges[s]}
        out.append((s, _build_stage(model, layer_keys, keep, s == 0, s == plan.n_stages - 1)))
    return out


# --------------------------------------------------------------------------- schedule
def schedule_class(name: str):
    """The torch schedule class for a plan's schedule name, or a ValueError naming the torch version."""
    try:
        return get_schedule_class(name)
    except ValueError:
        raise ValueError(f"plan key 'schedule': {name} is not available in torch {torch.__version__} "
                         "(torch.distributed.pipelining.schedules.get_schedule_class does not know it)") from None


class _Positions:
    """Holds the positions of the current step; a forward pre-hook adds them to each stage call."""

    def __init__(self):
        self.value: torch.Tensor | None = None

    def __call__(self, module, args, kwargs):
        if self.value is None:      # called outside PipelineRunner.step: leave the call as it is
            return None
        kwargs = dict(kwargs)
        kwargs["positions"] = self.value
        return args, kwargs


class PipelineRunner:
    """Runs one optimizer step's worth of micro-batches through the schedule on this rank."""

    def __init__(self, schedule, stages, stage_modules, plan: Plan, positions: _Positions,
                 step_context: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.schedule = schedule
        self.stages = stages                    # PipelineStage objects
        self.stage_modules = stage_modules      # [(stage_idx, module)]
        self.plan = plan
        self._positions = positions
        self._step_context = step_context
        ids = [s for s, _ in stage_modules]
        self.has_first = 0 in ids
        self.has_last = plan.n_stages - 1 in ids
        params = inspect.signature(schedule.step).parameters
        self._step_kwargs = {"return_outputs": False} if "return_outputs" in params else {}

    def step(self, tokens: torch.Tensor | None, labels: torch.Tensor | None,
             positions: torch.Tensor) -> torch.Tensor | None:
        """Forward+backward of the local batch (microbatch*n_microbatches sequences).

        ``tokens`` are used if this rank holds stage 0 and ``labels`` if it holds
        the last stage (others may pass them or None).  Returns the mean loss over
        the micro-batches (detached) on the rank holding the last stage, else None.
        """
        n_mb = self.plan.n_microbatches
        if self.has_first:
            if tokens is None:
                raise ValueError("PipelineRunner.step: this rank holds stage 0 and needs tokens")
            if tokens.shape[0] % n_mb:
                raise ValueError(f"PipelineRunner.step: local batch {tokens.shape[0]} is not divisible by "
                                 f"plan key 'n_microbatches' ({n_mb})")
        if self.has_last and labels is None:
            raise ValueError("PipelineRunner.step: this rank holds the last stage and needs labels")
        if positions is None:
            raise ValueError("PipelineRunner.step: positions are required")
        self._positions.value = positions
        args = (tokens,) if self.has_first else ()
        ctx = self._step_context() if self._step_context is not None else contextlib.nullcontext()
        sent = getattr(self.stages[0], "_titan_sent", None) if self.stages else None
        released = _releasing_sent_outputs(sent) if sent is not None else contextlib.nullcontext()
        try:
            with ctx, released:
                if self.has_last:
                    losses: list[torch.Tensor] = []
                    self.schedule.step(*args, target=labels, losses=losses, **self._step_kwargs)
                else:
                    self.schedule.step(*args, **self._step_kwargs)
        finally:
            self._positions.value = None
        if not self.has_last:
            return None
        vals = []
        for loss in losses:
            loss = loss.detach()
            if hasattr(loss, "full_tensor"):   # DTensor loss (loss_parallel)
                loss = loss.full_tensor()
            vals.append(loss.float())
        return torch.stack(vals).mean()


# Schedules whose backward is split into an input pass (I) and a deferred weight pass (W).
SPLIT_BACKWARD_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def _keep_fsdp_params_unsharded(stages: list[tuple[int, nn.Module]], schedule: str) -> None:
    """Split-backward schedules need FSDP's reshard_after_forward=False.

    ``stage_backward_input`` looks up the weights' autograd nodes through
    ``submod.parameters()`` *before* running the input backward; with
    reshard_after_forward=True those are the sharded parameters, not the
    unsharded ones the graph used, so the W pass finds no weights: on torch
    2.14 ZBVZeroBubble left blocks without gradients and DualPipeV produced
    silently wrong gradients (PP2 x FSDP2, tests/distributed/_pp_cp_worker.py
    --case mix).  With the parameters kept unsharded from the first forward
    to the last backward, both are exact.
    """
    changed = False
    for _, module in stages:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_reshard_after_forward(False, recurse=False)
                changed = True
    if changed:
        log.info("schedule %s: FSDP reshard_after_forward set to False on the pipeline stages "
                 "(required by the split input/weight backward)", schedule)


def _uses_fsdp(stages) -> bool:
    return any(isinstance(m, FSDPModule) for _, mod in stages for m in mod.modules())


def _uses_compile(stages) -> bool:
    """Any submodule compiled with ``Module.compile()`` or wrapped by ``torch.compile``."""
    for _, mod in stages:
        for m in mod.modules():
            if getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule":
                return True
    return False


def _no_deferred_weight_grad():
    return lambda: None


def _allow_retained_compiled_backward() -> None:
    """Split-backward schedules run the input backward with retain_graph=True.

    A compiled region's backward with donated buffers refuses that
    (``RuntimeError: This backward function was compiled with non-empty donated
    buffers which requires create_graph=False and retain_graph=False``, seen
    with ZBVZeroBubble x FSDP x per-block compile), so donated buffers are
    turned off, process-wide, before anything is compiled (TorchTitan does the
    same).  Compilation is lazy (first forward), so this is early enough.
    """
    if getattr(functorch_config, "donated_buffer", False):
        functorch_config.donated_buffer = False


def fsdp_microbatch_backward_settings(module: FSDPModule, sync_every_microbatch: bool) -> None:
    """The FSDP settings a pipeline stage's micro-batch backward runs with (one home for the stage,
    :func:`_stage_class`, and the dry run's replay, ``dry_run_step.py``): not the last backward; with
    `sync_every_microbatch` (workload ``pp_grad_sync``) the gradient sync and the resharding on, else
    both off, as torch's ``backward_maybe_with_nosync`` sets them."""
    module.set_is_last_backward(False)
    module.set_requires_gradient_sync(sync_every_microbatch)
    module.set_reshard_after_backward(sync_every_microbatch)


def _keep_on(*args, **kwargs) -> None:
    """Stands in for an FSDP module's sync / reshard setters while a stage's backward runs (see
    :func:`_stage_class`): the settings made just before stay as they are."""


def _release_recv(infos) -> None:
    """Drop the stage's reference to each received tensor of `infos` (one micro-batch's receive
    infos), remembering its shape, stride, dtype, device and requires_grad to allocate the next
    one (:func:`_refill_recv`)."""
    for info in infos:
        buf = getattr(info, "buffer", None)
        if getattr(info, "is_root_arg", False) or not isinstance(buf, torch.Tensor):
            continue
        info._titan_like = (tuple(buf.shape), tuple(buf.stride()), buf.dtype, buf.device, buf.requires_grad)
        info.buffer = None


def _refill_recv(infos, zero: bool) -> None:
    """A fresh receive buffer for each info of `infos` that :func:`_release_recv` emptied and nothing
    has filled since (a same-rank V-schedule hand-over sets the buffer itself)."""
    for info in infos:
        like = getattr(info, "_titan_like", None)
        if like is None or getattr(info, "buffer", None) is not None:
            continue
        shape, stride, dtype, device, requires_grad = like
        buf = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if zero:
            buf.zero_()
        info.buffer = buf.requires_grad_(True) if requires_grad else buf


class _HeldSend:
    """Stands for one isend's Work in the schedule's list of sends to wait at the end of the step
    (:func:`_releasing_sent_outputs`): waits it when the schedule does, or earlier when
    :meth:`release` drops it, and with it the Work's reference to the sent tensor."""
    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        work, self.work = self.work, None
        return work.wait(*args, **kwargs) if work is not None else True

    release = wait


def _storage_key(t) -> int | None:
    """The storage a tensor (a DTensor: its local tensor) views, as a key (``_cdata``: one per storage, shared by
    every alias, real or fake tensors alike).  torch sends a detached alias of each stage output
    (``to_local_if_dtensor(out, detach=True)``), so the send and the cached output share storage, not the tensor
    object; a storage the registry holds a send of stays alive, so its key is not reused meanwhile."""
    t = getattr(t, "_local_tensor", t)
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


class _SentOutputs:
    """The isends of the current step, by the memory they send.  A stage releases those of its output for a
    micro-batch once its backward has taken the micro-batch's output gradient, and an input gradient it
    sent at the consuming compute action `release_at` names for it (`pipeline_sends.grad_send_releases`,
    read off the schedule's program; `_PerMicrobatchRecv`)."""

    def __init__(self):
        self.held: dict[int, list[_HeldSend]] = {}
        self.release_at: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        self.grads: dict[tuple[int, int], list[int]] = {}     # (stage, micro-batch) -> storage keys sent

    def mark_grads(self, stage: int, mb: int, tensors) -> None:
        keys = [k for k in map(_storage_key, tensors) if k is not None]
        if keys and self.release_at:
            self.grads[(stage, mb)] = keys

    def consumed(self, kind: str, stage: int, mb: int) -> None:
        """The compute action (kind F or B) of (stage, mb) has taken its received tensor: the gradient sends
        the schedule's program says have completed by now are waited and dropped."""
        for sent in self.release_at.get((kind, stage, mb), ()):
            for key in self.grads.pop(sent, ()):
                for send in self.held.pop(key, ()):
                    send.release()

    def add(self, tensor: torch.Tensor, sends: list[_HeldSend]) -> None:
        key = _storage_key(tensor)
        if key is not None:
            self.held.setdefault(key, []).extend(sends)

    def release(self, tensors) -> None:
        for t in tensors:
            key = _storage_key(t)
            for send in self.held.pop(key, ()) if key is not None else ():
                send.release()


@contextlib.contextmanager
def _releasing_sent_outputs(sent: _SentOutputs):
    """One step of a multi-stage schedule during which the stage outputs it sends are let go as soon as
    their gradient has come back, instead of at the end of the step.

    torch's multi-stage runtime (``_PipelineScheduleRuntime._step_microbatches``) appends every SEND_F /
    SEND_B batch's Works to a list it waits only when the step ends, and a Work keeps its tensor: each
    micro-batch's sent output then outlives its backward, n_microbatches residual tensors per forward
    direction.  Here a pure-send batch's Works are handed to the schedule as `_HeldSend` stand-ins, recorded
    by the storage they send, and a stage releases those of its outputs (waits and drops the Work) once
    its backward of that micro-batch has received the output gradient: the peer computed that gradient
    from the output, so the send has completed and its wait cannot block (on gloo, where a send's wait
    returns only when the peer has the data, nor on NCCL, where it is a stream dependency).  Input
    gradients the rank sends are kept to the step's end as torch keeps them (a peer's use of one gives
    the sender no signal).  Measured (bench/bench_pp_recv_memory.py): Interleaved1F1B grows 1 / 2
    residual tensors a micro-batch on ranks 0 / 1 instead of 3 / 3."""
    from torch.distributed.pipelining import schedules
    orig = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        works = orig(p2p_ops) if desc is None else orig(p2p_ops, desc=desc)
        if (not p2p_ops or not isinstance(works, list) or len(works) != len(p2p_ops)   # (torch < 2.14: one Work)
                or any(op.op is not dist.isend for op in p2p_ops)):
            return works
        held = [_HeldSend(w) for w in works]
        for op, h in zip(p2p_ops, held):
            sent.add(op.tensor, [h])
        return held
    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = orig
        sent.held.clear()
        sent.grads.clear()


class _PerMicrobatchRecv:
    """PipelineStage methods, as a mixin ahead of PipelineStage.

    Receive buffers per micro-batch: torch allocates one per micro-batch and direction at the
    first step and keeps all of them for the life of the stage (n_microbatches x the stage
    input, per direction).  Here a micro-batch's buffer is allocated when its receive is posted
    and let go as soon as the stage has taken the tensor: an activation then lives as long as
    the micro-batch's autograd graph holds it (its backward), an output gradient until its
    backward has run, as Megatron receives into fresh tensors per micro-batch.  And after a
    micro-batch's full backward its loss is detached, so the spent graph (and the stage input its
    AccumulateGrad node holds) does not wait for the step's end.  Measured with titan-run's profiled
    peak, pp 2 (bench/bench_pp_recv_memory.py): Interleaved1F1B at 16 micro-batches 61.5 / 52.4 MiB
    -> 50.2 / 41.4 MiB on ranks 0 / 1 (profiled step 1); the peak grows 3 residual tensors a micro-batch, was 6.
    """

    def _prepare_forward_infra(self, *args, **kwargs):
        out = super()._prepare_forward_infra(*args, **kwargs)
        for infos in self.args_recv_info.values():      # the first step too: none held ahead of use
            _release_recv(infos)
        return out

    def _prepare_backward_infra(self, *args, **kwargs):
        out = super()._prepare_backward_infra(*args, **kwargs)
        for infos in self.grad_recv_info.values():
            _release_recv(infos)
        return out

    def _get_recv_ops(self, recv_infos, *args, **kwargs):
        _refill_recv(recv_infos, zero=False)
        return super()._get_recv_ops(recv_infos, *args, **kwargs)

    def _retrieve_recv_activations(self, fwd_chunk_id, *args, **kwargs):
        infos = self.args_recv_info[fwd_chunk_id]
        _refill_recv(infos, zero=False)
        out = super()._retrieve_recv_activations(fwd_chunk_id, *args, **kwargs)
        _release_recv(infos)
        self._consumed("F", fwd_chunk_id)
        return out

    def _retrieve_recv_grads(self, bwd_chunk_id, *args, **kwargs):
        infos = self.grad_recv_info[bwd_chunk_id]
        _refill_recv(infos, zero=True)      # a same-rank hand-over of a None gradient: zeros, as torch's
        out = super()._retrieve_recv_grads(bwd_chunk_id, *args, **kwargs)
        _release_recv(infos)
        self._consumed("B", bwd_chunk_id)
        return out

    def _consumed(self, kind: str, chunk_id: int) -> None:
        sent = getattr(self, "_titan_sent", None)
        if sent is not None:
            sent.consumed(kind, self.stage_index, chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id, *args, **kwargs):
        ops = super().get_bwd_send_ops(bwd_chunk_id, *args, **kwargs)
        sent = getattr(self, "_titan_sent", None)
        if sent is not None:
            sent.mark_grads(self.stage_index, bwd_chunk_id, [op.tensor for op in ops])
        return ops

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, **kwargs):
        cached = self.fwd_cache.get(bwd_chunk_id)
        outputs = cached[0] if cached is not None else ()
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, **kwargs)
        sent = getattr(self, "_titan_sent", None)
        if sent is not None and not self.is_last:     # its output gradient has arrived: the sends are done
            sent.release(outputs if isinstance(outputs, (tuple, list)) else (outputs,))
        # The schedule keeps each micro-batch's loss to the end of the step; with its grad_fn it keeps
        # the (spent) autograd graph's nodes, whose AccumulateGrad node holds the stage input: one
        # received activation per micro-batch.  Detached in place, as torch detaches stage outputs.
        if full_backward and isinstance(loss, torch.Tensor) and loss.grad_fn is not None \
                and not loss._is_view():
            loss.detach_()
        return out


def _stage_class(backward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                 sync_every_microbatch: bool = False):
    """PipelineStage, minus warm-up sends to the rank itself on gloo.

    torch 2.11's V schedules post a warm-up isend/irecv between every pair of
    neighbouring stages, including stages 1 -> 2 that sit on the same rank;
    gloo has no self pair, so the first step hung (then ``Pair is not
    connected``) on CPU.  The warm-up only opens connections, and same-rank
    activations are handed over locally, so those ops are dropped (gloo only;
    NCCL keeps torch's behaviour).

    With `backward_context`, the stage's backward calls (full, input and weight
    backward; torch 2.14's backward shape inference) run inside it: the
    spmd_types backend runs them outside the type checker (``spmd_pipeline.py``).

    With `sync_every_microbatch` (workload ``pp_grad_sync: every_microbatch``), an FSDP stage
    reduce-scatters each micro-batch's gradients into the sharded gradients during that
    micro-batch's backward and reshards its parameters after it, as FSDP does without a pipeline:
    torch's ``backward_maybe_with_nosync`` switches the gradient sync and the resharding off for
    FSDP stages before every backward (one reduce-scatter of unsharded fp32 gradients at the end
    of the step), so those two setters are held while it runs.  The schedule's final
    ``perform_reduce_grad`` then has nothing left to reduce; it waits for the reduce-scatters and
    scales the sharded gradients by the micro-batch count.
    """
    class _Stage(_PerMicrobatchRecv, PipelineStage):
        def _get_init_p2p_neighbors_ops(self):
            ops = super()._get_init_p2p_neighbors_ops()
            me = dist.get_rank()
            return [op for op in ops
                    if not (op.peer == me and dist.get_backend(op.group) == "gloo")]

        def backward_maybe_with_nosync(self, *args, **kwargs):
            ctx = backward_context() if backward_context is not None else contextlib.nullcontext()
            mod = self.submod
            if not (sync_every_microbatch and isinstance(mod, FSDPModule)):
                with ctx:
                    return super().backward_maybe_with_nosync(*args, **kwargs)
            fsdp_microbatch_backward_settings(mod, True)
            mod.set_requires_gradient_sync = mod.set_reshard_after_backward = _keep_on
            try:
                with ctx:
                    return super().backward_maybe_with_nosync(*args, **kwargs)
            finally:
                del mod.set_requires_gradient_sync, mod.set_reshard_after_backward

        if backward_context is not None:
            def _compute_input_grads(self, *args, **kwargs):     # torch 2.14 shape inference
                with backward_context():
                    return super()._compute_input_grads(*args, **kwargs)

    return _Stage


def build_schedule(stages: list[tuple[int, nn.Module]], plan: Plan, pp_mesh: DeviceMesh, loss_fn,
                   device, step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                   runner_cls: Callable[..., PipelineRunner] = PipelineRunner,
                   backward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                   grad_sync: str = "last_microbatch") -> PipelineRunner:
    """PipelineStage per (already parallelized, materialized) stage module + the plan's schedule.

    `runner_cls` builds the runner from the same arguments as :class:`PipelineRunner`, and the stages'
    backward calls run in `backward_context` (the spmd_types backend passes its typed runner and
    ``no_typecheck``, ``spmd_pipeline.py``).  `grad_sync` is the workload's ``pp_grad_sync``:
    ``every_microbatch`` reduce-scatters FSDP gradients in every micro-batch's backward
    (:func:`_stage_class`), which the split-backward schedules cannot (``config.grad_sync_error``)."""
    _check_plan(plan)
    err = grad_sync_error(plan, grad_sync)
    if err:
        raise ValueError(err)
    stage_cls = _stage_class(backward_context, sync_every_microbatch=grad_sync == "every_microbatch")
    cls = schedule_class(plan.schedule)
    if plan.schedule in SPLIT_BACKWARD_SCHEDULES:
        # the input backward retains the graph for the weight pass, with or without FSDP (pp alone included)
        _allow_retained_compiled_backward()
    if plan.schedule in SPLIT_BACKWARD_SCHEDULES and plan.fsdp_size > 1:
        # (with dp_shard * cp = 1 FSDP only replicates, dp_replicate: the parameters are never sharded, and
        # torch refuses reshard_after_forward on a replicate-only mesh with a bare AssertionError)
        _keep_fsdp_params_unsharded(stages, plan.schedule)
    device = torch.device(device)
    group = pp_mesh.get_group()
    positions = _Positions()
    stage_kwargs = {}
    if plan.schedule in SPLIT_BACKWARD_SCHEDULES and (plan.compile or _uses_compile(stages)):
        # Split input/weight backward through compiled blocks gives wrong weight gradients, with FSDP
        # (feed_forward.w1 ~0, ffn_norm off by ~25%; torch 2.14, ZBVZeroBubble, PP2 x FSDP2, per-block
        # compile) and without (pp 2 alone: the loss 0.8% off the eager run's by the third step).  With a
        # dw_builder, the stage runs the full backward in the I step and the W step runs the (empty)
        # builder: exact, same schedule order, weight-gradient work no longer fills the bubble (the cost
        # model's bubble for titan-run's compiled V schedules: step_time.bubble_microbatches).
        log.info("schedule %s with compile: running the full backward in the I step (zero-bubble weight "
                 "deferral disabled for correctness)", plan.schedule)
        stage_kwargs["dw_builder"] = _no_deferred_weight_grad
    pstages = []
    sent = _SentOutputs() if plan.is_multi_stage else None   # (single-stage schedules wait each send promptly)
    for idx, module in stages:
        module.register_forward_pre_hook(positions, with_kwargs=True)
        pstages.append(stage_cls(module, idx, plan.n_stages, device, group=group, **stage_kwargs))
        pstages[-1]._titan_sent = sent
    if plan.is_multi_stage:
        schedule = cls(pstages, n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=True)
        order = getattr(schedule, "pipeline_order_with_comms", None)
        if order:   # (torch's runtime programs; where absent, the sent gradients are held to the step's end)
            ranks = schedule.stage_index_to_group_rank
            sent.release_at = grad_send_releases(order, ranks.__getitem__, schedule.rank)
    else:
        if len(pstages) != 1:
            raise ValueError(f"schedule {plan.schedule} runs one stage per rank, got {len(pstages)}")
        schedule = cls(pstages[0], n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return runner_cls(schedule, pstages, stages, plan, positions, step_context)
