"""FSDP2 (``fully_shard``) per block and at the root; HSDP on a 2-D mesh.

The FSDP ranks are ``dp_shard x cp`` (context-parallel ranks hold different
tokens of the same sequences, so their gradients are averaged too); with
``dp_replicate > 1`` the mesh is 2-D (dp_replicate, dp_shard_cp): parameters
are sharded within a replica group and all-reduced across groups (HSDP).

Expert parallel (``expert_mesh`` given): each MoE block's routed experts
(already ``Shard(0)`` over ep) get their own ``fully_shard`` on the experts'
mesh (``efsdp``, or (dp_replicate, efsdp) with HSDP) before the block's, as in
TorchTitan.  FSDP would average their gradients over that mesh only, but the
all-to-all backward has already *summed* each expert's gradient over the ep
ranks, so the divide factor is set to every data-parallel rank
(dp_replicate*dp_shard*cp): the result is the gradient of the global mean loss.
On gloo (no PREMUL_SUM) the reduction is forced to SUM followed by that
division (not when efsdp has one rank: FSDP then divides locally itself).

Blocks use the plan's ``reshard_after_forward``, except the last block when
no pipeline runs (``keep_last``): backward starts with it, so FSDP would gather
it again right after the loss (TorchTitan's default policy keeps it too); the
root (embedding, final norm, LM head) keeps its parameters after forward, as
the FSDP2 docs recommend, since backward needs them first.  Mixed precision: parameters are
gathered in ``param_dtype`` (bf16 on GPU) and gradients reduced in fp32.

spmd_types backend (:func:`apply_fsdp_spmd`, torch >= 2.14): every parameter
is annotated with its local SPMD type -- Replicate (R) on each data-parallel
mesh axis -- and ``fully_shard`` gets the SPMD mesh plus
``dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)``; FSDP then
derives its storage placements from the annotations and restores them on the
gathered parameters, so the step can run under ``spmd_types`` type checking
(:func:`spmd_typecheck`): inputs are Varying (V) over the dp axes, and the
loss is declared a pending sum (V -> P, :func:`spmd_loss`) before backward --
the checker rejects ``backward()`` on a Varying loss, which is exactly the
missing-gradient-reduction bug it exists to catch.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter   # custom comms (torch >= 2.8)
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo            # (private in torch 2.14)
from torch.distributed.tensor import Replicate, _redistribute
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from .seq_collectives import PendingReduceScatter, all_gather_exchange


def _mp_policy(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                                reduce_dtype=None if reduce_dtype == param_dtype == torch.float32 else reduce_dtype)


def _reshard_per_block(model: nn.Module, reshard_after_forward: bool, keep_last: bool) -> dict[str, bool]:
    """Each block's ``reshard_after_forward``: the plan's, but False for the last block under `keep_last`."""
    keys = list(model.layers.keys())
    return {k: reshard_after_forward and not (keep_last and k == keys[-1]) for k in keys}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool, expert_mesh: DeviceMesh | None = None,
               expert_divide_factor: int = 1, keep_last: bool = False) -> None:
    mp = _mp_policy(param_dtype, reduce_dtype)
    per_block = _reshard_per_block(model, reshard_after_forward, keep_last)
    for key, block in model.layers.items():
        reshard_after_forward = per_block[key]
        if expert_mesh is not None and getattr(block, "moe_enabled", False):
            experts = block.feed_forward.experts
            # the all-to-all output is a view; the MoE layer only uses it out of place
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPExpertParallelExperts\) "
                                    r"returned a view tensor")
            fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
            experts.set_gradient_divide_factor(float(expert_divide_factor))
            # gloo has no PREMUL_SUM: SUM, then divide.  Not when the reduce-scatter group (efsdp,
            # the mesh's last dim) has one rank: FSDP then divides locally, and would divide twice
            if expert_mesh.size(expert_mesh.ndim - 1) > 1 and expert_mesh.device_type != "cuda":
                experts.set_force_sum_reduction_for_comms(True)
            use_gloo_reduce_scatter(experts, expert_mesh)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        use_gloo_reduce_scatter(block, mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    use_gloo_reduce_scatter(model, mesh)
    overlap_all_gathers(model, mesh.device_type)


class GlooReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter on gloo as a direct exchange (``seq_collectives.PendingReduceScatter``).

    gloo's ``reduce_scatter_tensor`` clones the whole flat gradient buffer, all-reduces ALL of it
    and copies this rank's chunk out; here each peer is sent only its chunk and this rank's chunk
    is summed locally in rank order (on 2 ranks bitwise gloo's result, SUM and AVG alike: the AVG
    division is by the group size after the sum, as gloo's).  Other ops (PREMUL_SUM) and async
    calls go to the library collective.

    Given its module's FSDP parameter group, the exchange is left in flight where nothing reads the
    result before backward ends (:meth:`_can_defer`): FSDP2 calls the reduce-scatter synchronously
    on CPU (no streams), so each block's backward otherwise waits for the slower peer's gradients.
    The sum into the same output (the views FSDP2 has made the sharded gradients) is done when the
    next reduce-scatter is posted or, for the last one, in an autograd final callback at the end of
    backward: the same sum of the same values, in the same order (bitwise unchanged)."""

    def __init__(self, param_group=None):
        self._param_group = param_group
        self.deferred = 0        # how many of its reduce-scatters were left in flight

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        if async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        size = group.size()
        pending = PendingReduceScatter(input_tensor.chunk(size), group, group.rank(), size)
        done = (pending, output_tensor, size if op == dist.ReduceOp.AVG else 1)
        if self._can_defer(op, output_tensor):
            self.deferred += 1
            _IN_FLIGHT.append(done)
            _finish_in_flight(keep=1)        # the previous block's, whose peer chunks have long arrived
            return None
        _finish_in_flight()
        _finish(*done)
        return None

    def _can_defer(self, op, output: torch.Tensor) -> bool:
        """Whether FSDP2 leaves the reduce-scatter output untouched until backward ends: AVG (no pre- or
        post-division), no HSDP all-reduce or all-reduce hook after it, no cast, no accumulation into an
        existing sharded gradient, no CPU offload or post-accumulate-grad hook; and inside a backward pass
        (FSDP2's pipelining calls post-backward outside one), where the final callback is queued."""
        pg = self._param_group
        if pg is None or op != dist.ReduceOp.AVG or isinstance(pg.mesh_info, DDPMeshInfo) \
                or pg._all_reduce_hook is not None or pg._orig_dtype not in (None, output.dtype):
            return False
        for fp in pg.fsdp_params:
            p = fp.sharded_param
            if p.grad is not None or fp.offload_to_cpu or getattr(p, "_post_accumulate_grad_hooks", None):
                return False
        task = torch._C._current_graph_task_id()      # -1 outside a backward pass
        if task < 0:
            return False
        if _QUEUED_FOR[0] != task:       # one callback per backward pass (a failed one never ran its own)
            Variable._execution_engine.queue_callback(_end_of_backward)
            _QUEUED_FOR[0] = task
        return True


_IN_FLIGHT: list[tuple] = []     # GlooReduceScatter exchanges posted, not yet summed (oldest first)
_QUEUED_FOR = [None]             # the backward pass (graph task id) whose final callback is queued


def _finish(pending, out: torch.Tensor, divisor: int) -> None:
    pending.finish(out)
    if divisor != 1:
        out.div_(divisor)


def _finish_in_flight(keep: int = 0) -> None:
    """Sum the in-flight reduce-scatters into their outputs, oldest first, leaving the newest `keep`."""
    while len(_IN_FLIGHT) > keep:
        _finish(*_IN_FLIGHT.pop(0))


def _end_of_backward() -> None:
    _QUEUED_FOR[0] = None
    _finish_in_flight()


class GlooAllGather(AllGather):
    """FSDP2's parameter all-gather on gloo as a direct exchange (``seq_collectives.all_gather_exchange``).

    gloo's ``all_gather_into_tensor`` gathers into a staging tensor of the whole output and copies it
    into the output afterwards; FSDP2's input is already this rank's chunk of the output, so here each
    peer's chunk is received straight into its place (an all-gather only moves bytes: bitwise the same
    parameters).  Async calls (the prefetched unshards of :func:`overlap_all_gathers`) return one work
    FSDP2 waits on before its copy-out."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        return all_gather_exchange(output_tensor, input_tensor, group, group.rank(), group.size(), async_op=async_op)


def use_gloo_reduce_scatter(module: nn.Module, mesh: DeviceMesh) -> None:
    """On a gloo mesh, FSDP2 reduce-scatters `module`'s gradients with :class:`GlooReduceScatter` and
    all-gathers its parameters with :class:`GlooAllGather`."""
    if mesh.device_type == "cpu" and all(dist.get_backend(mesh.get_group(i)) == "gloo" for i in range(mesh.ndim)):
        module.set_custom_reduce_scatter(GlooReduceScatter(module._get_fsdp_state()._fsdp_param_group))
        module.set_custom_all_gather(GlooAllGather())


def overlap_all_gathers(model: nn.Module, device_type: str) -> None:
    """On CPU (gloo), issue each block's all-gather one block ahead and asynchronously.

    FSDP2 overlaps its all-gathers with compute through CUDA streams; on CPU there are none, so
    every pre-forward / pre-backward all-gather blocks the training thread (``unshard_async_op``
    False), prefetched or not.  Here the root's forward prefetches block 0 and block i prefetches
    block i+1 (as TorchTitan sets up for EP), and the unshards are async, so gloo moves block i+1
    while block i computes -- also in backward, where FSDP2 prefetches the previous block
    implicitly.  At most two blocks are gathered at a time, as in backward before (the memory
    model's current + prefetched unit); values are unchanged.  GPUs keep FSDP2's stream schedule
    (measured, FSDP 2 on 2 gloo ranks, llama3 debugmodel, in-process alternating rounds: 607 ->
    597 ms per step, paired ratio 1.026)."""
    blocks = [b for b in model.layers.values() if hasattr(b, "set_modules_to_forward_prefetch")]
    set_async = getattr(model, "_set_unshard_async_op", None)     # private in torch 2.14
    if device_type != "cpu" or not blocks or set_async is None:
        return
    model.set_modules_to_forward_prefetch(blocks[:1])
    for block, nxt in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([nxt])
    set_async(True)


# --------------------------------------------------------------------------- spmd_types
def _spmd():
    """The spmd_types package (a core dependency), imported where the spmd backend is used."""
    import spmd_types
    import spmd_types.checker  # noqa: F401 (typecheck)
    return spmd_types


def spmd_fsdp_supported() -> str | None:
    """None if FSDP2 + spmd_types can run here, else the reason it cannot (naming the torch version)."""
    try:
        _spmd()
    except ImportError:
        return "spmd_types is not installed (pip install 'spmd-types>=0.3,<0.4')"
    if "dp_mesh_dims" not in inspect.signature(fully_shard).parameters:
        return f"torch {torch.__version__} has no spmd_types FSDP2 (fully_shard dp_mesh_dims needs torch >= 2.14)"
    if not getattr(dist, "_is_spmd_types_available", lambda: False)():
        return f"torch {torch.__version__} reports spmd_types unavailable"
    return None


def _axes(mesh: DeviceMesh) -> dict:
    spmd = _spmd()
    return {name: spmd.MeshAxis.of(mesh.get_group(name)) for name in mesh.mesh_dim_names}


DP_AXES = ("dp_replicate", "dp_shard")


def forget_mesh_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches (call before building on new meshes).

    Their keys compare meshes by value (shape, ranks, axis names), not by object or process group, so
    once a second mesh equal to an earlier one exists in the process, an op on a DTensor of the new mesh
    can return a DTensor on the *earlier* mesh object.  Two places meet it: a second spmd_types model
    (``nn.Parameter(DTensor)`` detaches through the cache, and ``fully_shard(..., dp_mesh_dims=...)``
    then refuses the parameter: "Expected param's DTensor mesh to be the same mesh passed to
    fully_shard, but got different mesh objects"), and the dry run's next fake world (collectives sent
    to the previous world's destroyed group: "Could not resolve the process group registered under
    the name ...")."""
    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()


def apply_fsdp_spmd(model: nn.Module, spmd_mesh: DeviceMesh, *, param_dtype: torch.dtype,
                    reduce_dtype: torch.dtype, reshard_after_forward: bool, expert_mesh: DeviceMesh | None = None,
                    expert_divide_factor: int = 1, keep_last: bool = False) -> None:
    """FSDP2 with typed params over `spmd_mesh`: its data-parallel axes (dp_replicate and/or dp_shard) and
    optionally ``tp``.  Every parameter is R on the dp axes; its tp type (set by
    ``spmd_tensor_parallel.apply_spmd_tp``) is kept, R where there is none.

    Expert parallel (`expert_mesh`, ``(dp_replicate,) efsdp, ep``): each MoE block's routed experts,
    typed on that mesh by ``spmd_expert_parallel.py``, get their own ``fully_shard`` there first
    (shard ``efsdp``, replicate ``dp_replicate``), with the gradient divide factor and the gloo
    SUM reduction of :func:`apply_fsdp`."""
    spmd = _spmd()
    from torch.distributed.fsdp import DataParallelMeshDims  # torch >= 2.14 only (spmd_fsdp_supported checks)
    forget_mesh_caches()     # a model built before on equal meshes would hand FSDP its mesh objects
    names = spmd_mesh.mesh_dim_names
    axes = _axes(spmd_mesh)
    experts = {key: block.feed_forward.experts for key, block in model.layers.items()
               if expert_mesh is not None and getattr(block, "moe_enabled", False)}
    on_expert_mesh = {id(p) for e in experts.values() for p in e.parameters()}
    for p in model.parameters():
        if id(p) in on_expert_mesh:      # typed on the experts' mesh already
            continue
        have = spmd.get_local_type(p) if spmd.has_local_type(p) else {}
        spmd.assert_type(p, {axes[n]: have.get(axes[n], spmd.R) for n in names})
    # context parallel: the cp ranks hold different tokens, their gradients are reduced too (over dp_shard x cp)
    shard = tuple(n for n in ("dp_shard", "cp") if n in names)
    dims = DataParallelMeshDims(shard=(shard[0] if len(shard) == 1 else shard) if shard else None,
                                replicate="dp_replicate" if "dp_replicate" in names else None)
    mp = _mp_policy(param_dtype, reduce_dtype)
    if shard and math.prod(spmd_mesh.size(names.index(n)) for n in shard) == 1:
        # TP without a shard axis (a one-rank dp_shard): resharding would free nothing and cost a second copy
        reshard_after_forward = False
    per_block = _reshard_per_block(model, reshard_after_forward, keep_last)
    for key, block in model.layers.items():
        reshard_after_forward = per_block[key]
        if key in experts:
            expert_dims = DataParallelMeshDims(
                shard="efsdp", replicate="dp_replicate" if "dp_replicate" in expert_mesh.mesh_dim_names else None)
            fully_shard(experts[key], mesh=expert_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                        dp_mesh_dims=expert_dims)
            experts[key].set_gradient_divide_factor(float(expert_divide_factor))
            if expert_mesh.size(expert_mesh.mesh_dim_names.index("efsdp")) > 1 and expert_mesh.device_type != "cuda":
                experts[key].set_force_sum_reduction_for_comms(True)    # gloo has no PREMUL_SUM (as apply_fsdp)
            use_gloo_reduce_scatter(experts[key], expert_mesh)
        fully_shard(block, mesh=spmd_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    dp_mesh_dims=dims)
        use_gloo_reduce_scatter(block, spmd_mesh)
    fully_shard(model, mesh=spmd_mesh, reshard_after_forward=False, mp_policy=mp, dp_mesh_dims=dims)
    use_gloo_reduce_scatter(model, spmd_mesh)
    overlap_all_gathers(model, spmd_mesh.device_type)


def defer_tp_grad_reduction(model: nn.Module, spmd_mesh: DeviceMesh) -> list[nn.Parameter]:
    """TP with a one-rank dp axis (eager, checker off): sum the pending tp gradients in ONE all-reduce a step.

    The parameters typed R on tp (the norms under SP) have gradients that are pending sums over
    tp; FSDP2 reduces each in its post-backward, one blocking DTensor redistribute per parameter
    (13 a step on the llama3 debugmodel: ~21 ms of a 404 ms TP 2 step on 2 gloo ranks, profiled).
    Here FSDP is told their gradient is already Replicate on tp (its ``_spmd_grad_placements``:
    with a one-rank dp axis its reduce-scatter is a copy), and :func:`reduce_deferred_tp_grads`
    sums them over tp after backward, all in one flat buffer: the same sum of the same two
    values per element (bitwise on 2 ranks).  Returns those parameters (FSDP's sharded ones)."""
    names = spmd_mesh.mesh_dim_names
    if "tp" not in names or any(spmd_mesh.size(names.index(n)) > 1 for n in names if n != "tp"):
        return []
    tp_dim = names.index("tp")
    deferred = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:      # private in torch 2.14
            for fsdp_param in group.fsdp_params:
                placements = getattr(fsdp_param, "_spmd_grad_placements", None)
                mesh = fsdp_param.sharded_param.device_mesh
                if placements is None or mesh.mesh_dim_names != names or not placements[tp_dim].is_partial():
                    continue
                fsdp_param._spmd_grad_placements = (*placements[:tp_dim], Replicate(), *placements[tp_dim + 1:])
                deferred.append(fsdp_param.sharded_param)
    return deferred


def reduce_deferred_tp_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of :func:`defer_tp_grad_reduction`'s parameters over tp, in place, in one all-reduce."""
    local = [p.grad.to_local() for p in params if p.grad is not None]
    if not local:
        return
    flat = torch.cat([t.reshape(-1) for t in local])
    dist.all_reduce(flat, group=group)
    for t, part in zip(local, flat.split([t.numel() for t in local])):
        t.copy_(part.view_as(t))


@contextlib.contextmanager
def spmd_typecheck():
    """spmd_types runtime type checking; permissive, so tensors made inside the model
    (RoPE tables from ``arange``) may stay unannotated."""
    with _spmd().checker.typecheck(strict_mode="permissive"):
        yield


def spmd_batch(t: torch.Tensor, spmd_mesh: DeviceMesh) -> torch.Tensor:
    """Declare a batch tensor Varying (each dp rank holds different sequences)."""
    spmd = _spmd()
    spmd.assert_type(t, {a: spmd.V for a in _axes(spmd_mesh).values()})
    return t


def spmd_loss(loss: torch.Tensor, spmd_mesh: DeviceMesh) -> torch.Tensor:
    """Varying per-rank loss -> Partial: the global loss is the (pending) reduction over the dp axes."""
    spmd = _spmd()
    for name in spmd_mesh.mesh_dim_names:
        loss = spmd.reinterpret(loss, spmd_mesh.get_group(name), src=spmd.V, dst=spmd.P)
    return loss
