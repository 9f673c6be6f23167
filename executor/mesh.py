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
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from search_spaces.plan import Plan

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
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
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return device


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
        for name, mesh in named:       # one-rank groups: collectives there move no data
            out.setdefault(mesh.get_group().group_name, "self")
        if dist.get_world_size() > 1:
            out.setdefault(dist.group.WORLD.group_name, "world")
        return out

    def describe(self) -> str:
        return " x ".join(f"{a}{self.axis(a).size()}" for a in AXES)


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
    return Meshes(plan=plan, world=world, pp=world["pp"], dp_replicate=world["dp_replicate"],
                  dp_shard=world["dp_shard"], cp=world["cp"], tp=world["tp"], dp=dp,
                  dp_shard_cp=dp_shard_cp, dp_cp=dp_cp, fsdp=fsdp, spmd_dp=spmd_dp)


def _hsdp_mesh(world: DeviceMesh, dp_cp: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The 2-D (dp_replicate, dp_shard_cp) mesh FSDP2 uses for HSDP."""
    if hasattr(dp_cp, "_unflatten"):
        try:
            return dp_cp._unflatten(0, (plan.dp_replicate, plan.dp_shard * plan.cp),
                                    ("dp_replicate", "dp_shard_cp"))
        except Exception:   # older/newer private API: fall back to slicing by the flattened name
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return world["dp_replicate", "dp_shard_cp"]
