"""The device mesh: one `DeviceMesh` with named axes plus the flattened views.

Axes, outermost first: ``(pp, dp_replicate, dp_shard, cp, tp)`` -- tp is
innermost so tensor-parallel peers are neighbouring ranks (same node).
Degree-1 axes are kept (they cost nothing) so every axis always exists.

Flattened views (kept as returned by ``_flatten``, never re-sliced by name):

* ``dp``          = dp_replicate x dp_shard: which sequences a rank loads
* ``dp_shard_cp`` = dp_shard x cp: the FSDP sharding group
* ``dp_cp``       = dp_replicate x dp_shard x cp: loss / grad-norm reductions
* ``fsdp``        = ``dp_shard_cp`` (1-D), or the 2-D (dp_replicate, dp_shard_cp)
                    mesh for HSDP when dp_replicate > 1

Expert parallelism (no axis of its own: carved out of dp_shard x cp, see
`search_spaces.plan`): ``dp_shard_cp`` is unflattened into
``(efsdp, ep)`` with efsdp = dp_shard*cp/ep outer, ep inner (``_unflatten``):

* ``ep``          = the expert-parallel group (all-to-all dispatch/combine)
* ``efsdp``       = the ranks that FSDP-shard the same experts
* ``expert_fsdp`` = ``efsdp`` (1-D), or the 2-D (dp_replicate, efsdp) mesh
                    (HSDP) when dp_replicate > 1
* ``expert_spmd`` = the mesh the spmd_types backend types the experts on:
                    ``(dp_replicate,) efsdp, ep``, with ``tp`` innermost under
                    tensor parallel (with or without cp; ep never takes tp ranks)
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from search_spaces.plan import MESH_AXES, Plan

AXES = MESH_AXES
FLAT_AXES = ("dp", "dp_shard_cp", "dp_cp")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: int = 300) -> torch.device:
    """Start the default process group from the torchrun environment (NCCL on CUDA, gloo on CPU)."""
    dev_type = device_type()
    if dev_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if dev_type == "cuda" else {}
        kwargs.update(_restart_store(timeout_s))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return device


def _restart_store(timeout_s: int) -> dict:
    """After a torchrun restart: the agent's store with a per-attempt key prefix.

    The elastic agent can hand restarted workers the same TCPStore as the failed
    attempt; gloo then may read a dead peer's address left under the same key and
    wait forever in ``connectFullMesh`` (seen: 1 of 2 restarts hung on CPU).
    A prefix per attempt makes every key fresh (executor/checkpoint.py, elastic restarts).
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timedelta(seconds=timeout_s))
    return {"store": dist.PrefixStore(f"titan/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


@dataclass
class Meshes:
    plan: Plan
    world: DeviceMesh
    pp: DeviceMesh
    dp_replicate: DeviceMesh
    dp_shard: DeviceMesh
    cp: DeviceMesh
    tp: DeviceMesh
    dp: DeviceMesh
    dp_shard_cp: DeviceMesh
    dp_cp: DeviceMesh
    fsdp: DeviceMesh
    spmd_dp: DeviceMesh | None      # the data-parallel axes of size > 1 (spmd_types FSDP storage mesh)
    ep: DeviceMesh | None = None           # expert parallel (None when plan.ep == 1)
    efsdp: DeviceMesh | None = None        # FSDP ranks of one expert shard (1-D)
    expert_fsdp: DeviceMesh | None = None  # the mesh experts are fully_shard-ed on (2-D with HSDP)
    expert_spmd: DeviceMesh | None = None  # (dp_replicate,) efsdp, ep (, tp): the spmd_types experts' mesh

    def axis(self, name: str) -> DeviceMesh:
        return getattr(self, name)

    def group_names(self) -> dict[str, str]:
        """process-group name -> axis name, for attributing communication time."""
        named = [(name, self.axis(name)) for name in AXES + FLAT_AXES]
        if self.fsdp.ndim == 2:
            named += [("dp_replicate", self.fsdp["dp_replicate"]), ("dp_shard_cp", self.fsdp["dp_shard_cp"])]
        out: dict[str, str] = {}
        for name, mesh in named:       # a group shared by several axes takes the first (innermost-named) one
            if mesh.size() > 1:
                out.setdefault(mesh.get_group().group_name, name)
        experts = []                  # (axis, group, size) of the experts' own (unflattened) meshes' dims
        if self.ep is not None:       # ep/efsdp groups may equal dp_shard_cp's (then named that)
            for name in ("ep", "efsdp"):
                mesh = getattr(self, name)
                if mesh.size() > 1:
                    out.setdefault(mesh.get_group().group_name, name)
                named.append((name, mesh))
            # FSDP2 of the experts reduce-scatters on these meshes' groups, which can be other groups than
            # the ones above (expert_spmd under tp, expert_fsdp with HSDP: built by unflattening)
            for mesh in (self.expert_fsdp, self.expert_spmd):
                experts += [(n, mesh.get_group(n), mesh.size(i)) for i, n in enumerate(mesh.mesh_dim_names)]
            for name, group, size in experts:
                if size > 1:
                    out.setdefault(group.group_name, name)
        for name, mesh in named:       # one-rank groups: collectives there move no data
            out.setdefault(mesh.get_group().group_name, "self")
        for _, group, _ in experts:
            out.setdefault(group.group_name, "self")
        if dist.get_world_size() > 1:
            out.setdefault(dist.group.WORLD.group_name, "world")
        return out

    def describe(self) -> str:
        out = " x ".join(f"{a}{self.axis(a).size()}" for a in AXES)
        if self.ep is not None:
            out += f" (ep{self.ep.size()} x efsdp{self.efsdp.size()} within dp_shard*cp)"
        return out


def build_meshes(plan: Plan, dev_type: str) -> Meshes:
    shape = tuple(getattr(plan, a) for a in AXES)
    world = init_device_mesh(dev_type, shape, mesh_dim_names=AXES)
    dp = world["dp_replicate", "dp_shard"]._flatten("dp")
    dp_shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    if plan.dp_replicate > 1:
        fsdp = _hsdp_mesh(world, dp_cp, plan)
    else:
        fsdp = dp_shard_cp
    dp_axes = tuple(a for a in ("dp_replicate", "dp_shard") if getattr(plan, a) > 1)
    spmd_dp = world[dp_axes] if dp_axes else None
    ep = efsdp = expert_fsdp = expert_spmd = None
    if plan.ep > 1:
        ep, efsdp, expert_fsdp, expert_spmd = _expert_meshes(world, dp_shard_cp, dp_cp, plan)
    return Meshes(plan=plan, world=world, pp=world["pp"], dp_replicate=world["dp_replicate"],
                  dp_shard=world["dp_shard"], cp=world["cp"], tp=world["tp"], dp=dp,
                  dp_shard_cp=dp_shard_cp, dp_cp=dp_cp, fsdp=fsdp, spmd_dp=spmd_dp,
                  ep=ep, efsdp=efsdp, expert_fsdp=expert_fsdp, expert_spmd=expert_spmd)


def _expert_meshes(world: DeviceMesh, dp_shard_cp: DeviceMesh, dp_cp: DeviceMesh, plan: Plan
                   ) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh, DeviceMesh]:
    """(ep, efsdp, expert_fsdp, expert_spmd): dp_shard_cp unflattened into (efsdp, ep); with HSDP the
    experts' FSDP mesh is (dp_replicate, efsdp), from dp_cp unflattened into (dp_replicate, efsdp, ep).
    expert_spmd is the whole unflattened mesh (the spmd_types backend types the experts on it), with
    ``tp`` innermost under tensor parallel (:func:`_expert_tp_mesh`, also with cp)."""
    if not hasattr(dp_shard_cp, "_unflatten"):
        raise ValueError(f"plan key 'ep' > 1 needs DeviceMesh._unflatten, which torch {torch.__version__} "
                         "does not have (use torch >= 2.9)")
    assert plan.fsdp_size % plan.ep == 0, (plan.fsdp_size, plan.ep)
    inner = dp_shard_cp._unflatten(0, (plan.expert_fsdp_size, plan.ep), ("efsdp", "ep"))
    ep, efsdp = inner["ep"], inner["efsdp"]
    expert_fsdp, expert_spmd = efsdp, inner
    if plan.dp_replicate > 1:
        full = dp_cp._unflatten(0, (plan.dp_replicate, plan.expert_fsdp_size, plan.ep),
                                ("dp_replicate", "efsdp", "ep"))
        expert_fsdp, expert_spmd = full["dp_replicate", "efsdp"], full
    if plan.tp > 1:
        expert_spmd = _expert_tp_mesh(world, plan)
    return ep, efsdp, expert_fsdp, expert_spmd


def _expert_tp_mesh(world: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The spmd_types experts' mesh under tensor parallel: ``(dp_replicate,) efsdp, ep, tp``.

    ep is carved out of dp_shard x cp (never out of tp: the MoE layers run on the sequence-parallel
    local tokens, their experts R on tp), so the data-parallel axes ``(dp_replicate,) dp_shard, cp``
    are regrouped into ``(dp_replicate,) efsdp, ep`` with tp kept innermost.  DeviceMesh unflattens one
    dim at a time and slicing a flattened dim off the root mesh is deprecated, so the whole
    ``(dp_replicate,) dp_shard, cp, tp`` block is flattened (row-major: tp fastest, then cp, dp_shard)
    and unflattened into the experts' axes, in the same order: efsdp x ep spans exactly the ranks of
    one dp_shard x cp group (as ``dp_shard_cp._unflatten`` does for ``Meshes.ep``), at every tp rank."""
    hsdp = plan.dp_replicate > 1
    dense = ("dp_replicate",) * hsdp + ("dp_shard", "cp", "tp")
    sizes = (plan.dp_replicate,) * hsdp + (plan.expert_fsdp_size, plan.ep, plan.tp)
    names = ("dp_replicate",) * hsdp + ("efsdp", "ep", "tp")
    return world[dense]._flatten("_".join(dense))._unflatten(0, sizes, names)


def _hsdp_mesh(world: DeviceMesh, dp_cp: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The 2-D (dp_replicate, dp_shard_cp) mesh FSDP2 uses for HSDP."""
    if hasattr(dp_cp, "_unflatten"):
        try:
            return dp_cp._unflatten(0, (plan.dp_replicate, plan.fsdp_size),
                                    ("dp_replicate", "dp_shard_cp"))
        except Exception:   # older/newer private API: fall back to slicing by the flattened name
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return world["dp_replicate", "dp_shard_cp"]
