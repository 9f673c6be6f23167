"""`titan-run --self-test`: check the mesh and the sharding before a long run.

For every mesh axis (pp, dp_replicate, dp_shard, cp, tp), every flattened
view (dp, dp_shard_cp, dp_cp) and, when plan.ep > 1, the expert-parallel
groups carved out of dp_shard x cp (ep, efsdp): the axis's process group has the ranks the
mesh says, and an ``all_reduce`` and an ``all_gather`` of each rank's global
rank give the expected values.  Then the model parts are built on the meta device
as a run builds them (``parallel.build_model_parts``: pipeline split, TP, CP, EP,
AC, compile, FSDP): every parameter's local shard shape must equal the one
computed by hand from the plan.  A verdict per axis is printed by rank 0; the
exit code is non-zero on failure.

Without ``--plan``, the layout uses the local world: tp, dp_shard, pp, cp and
dp_replicate get a factor 2 in that order while the world allows (8 processes:
tp2 x dp_shard2 x pp2).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .comm_timer import all_gather_flat
from .config import ConfigError, load_run_config
from .init import clean_fqn
from .mesh import AXES, FLAT_AXES, build_meshes
from .models.llama import Transformer
from .parallel import Precision, build_model_parts, tp_shards_embedding

_ORDER = ("tp", "dp_shard", "pp", "cp", "dp_replicate")


def self_test_config(plan_path: str | None, overrides: list[str], world_size: int):
    if plan_path:
        return load_run_config(plan_path, overrides, world_size=world_size, steps=1)
    degrees, left = {k: 1 for k in _ORDER}, world_size
    i = 0
    while left % 2 == 0 and left > 1:
        degrees[_ORDER[i % len(_ORDER)]] *= 2
        left //= 2
        i += 1
    if left > 1:
        degrees["dp_shard"] *= left
    sets = [f"plan.{k}={v}" for k, v in degrees.items()]
    if degrees["pp"] > 1:
        sets.append(f"plan.n_microbatches={degrees['pp']}")
    dp = degrees["dp_shard"] * degrees["dp_replicate"]
    sets.append(f"workload.global_batch={dp * max(1, degrees['pp'])}")
    return load_run_config(None, sets + list(overrides or []), world_size=world_size, steps=1)


def _chunk_len(n: int, parts: int, idx: int) -> int:
    """Length of torch.chunk(range(n), parts)[idx] (0 when that chunk does not exist)."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - idx * size))


def check_axis(name: str, mesh) -> tuple[bool, str]:
    group = mesh.get_group()
    ranks = dist.get_process_group_ranks(group)
    expect_ranks = sorted(ranks) == sorted(int(r) for r in mesh.mesh.flatten().tolist())
    me = dist.get_rank()
    t = torch.tensor([float(me)], device=mesh.device_type)
    dist.all_reduce(t, group=group)
    ok_sum = int(t.item()) == sum(ranks)
    gathered = torch.empty(len(ranks), device=mesh.device_type)
    all_gather_flat(gathered, torch.tensor([float(me)], device=mesh.device_type), group=group)
    ok_gather = [int(x) for x in gathered.tolist()] == list(ranks)
    ok = expect_ranks and ok_sum and ok_gather and len(ranks) == mesh.size()
    return ok, (f"size {mesh.size()} ranks {ranks}: all_reduce {'ok' if ok_sum else 'WRONG'}, "
                f"all_gather {'ok' if ok_gather else 'WRONG'}")


def check_ep_all_to_all(mesh) -> tuple[bool, str]:
    """An uneven all_to_all_single on the ep group: rank i sends i+j+1 copies of its rank to peer j."""
    group = mesh.get_group()
    ranks = dist.get_process_group_ranks(group)
    me, i = dist.get_rank(), mesh.get_local_rank()
    n = len(ranks)
    in_splits = [i + j + 1 for j in range(n)]
    out_splits = [j + i + 1 for j in range(n)]
    send = torch.full((sum(in_splits),), float(me), device=mesh.device_type)
    recv = torch.empty(sum(out_splits), device=mesh.device_type)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    want = torch.cat([torch.full((out_splits[j],), float(r)) for j, r in enumerate(ranks)])
    ok = torch.equal(recv.cpu(), want)
    return ok, f"size {n} uneven splits {in_splits}: all_to_all {'ok' if ok else 'WRONG'}"


def expected_local_shape(fqn: str, shape: torch.Size, plan, meshes, shard_embedding: bool,
                         moe_prefixes: tuple[str, ...] = ()) -> tuple[int, ...]:
    """The local shard shape of parameter `fqn` of full `shape` under TP, EP then FSDP (torch.chunk semantics).

    MoE layers (`moe_prefixes`) are not TP-sharded; their routed experts (``experts.w1/w2/w3``,
    [E, ...]) are split E/ep over ep, then FSDP-sharded over efsdp (the rest of dp_shard x cp).
    """
    s = list(shape)
    tp_rank = meshes.tp.get_local_rank()
    if fqn.startswith(moe_prefixes):
        if plan.ep > 1 and fqn.endswith(("experts.w1", "experts.w2", "experts.w3")) and ".shared_" not in fqn:
            s[0] = s[0] // plan.ep
            if meshes.efsdp.size() > 1:
                s[0] = _chunk_len(s[0], meshes.efsdp.size(), meshes.efsdp.get_local_rank())
            return tuple(s)
    elif plan.tp > 1:
        col = fqn.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "output.weight"))
        row = fqn.endswith(("wo.weight", "w2.weight"))
        if fqn.startswith("tok_embeddings") and shard_embedding:
            s[0] = _chunk_len(s[0], plan.tp, tp_rank)
        elif col:
            s[0] = _chunk_len(s[0], plan.tp, tp_rank)
        elif row:
            s[1] = _chunk_len(s[1], plan.tp, tp_rank)
    if plan.fsdp_size > 1:
        s[0] = _chunk_len(s[0], plan.fsdp_size, meshes.dp_shard_cp.get_local_rank())
    return tuple(s)


def check_shards(cfg, meshes) -> tuple[bool, str]:
    """The model parts built as a run builds them (``parallel.build_model_parts``, on the meta device, fp32,
    the dtensor backend) against the shard shapes computed by hand from the full model's."""
    plan = cfg.plan
    with torch.device("meta"):
        model = Transformer(cfg.spec)        # the unsplit, unsharded reference
    full = {n: p.shape for n, p in model.named_parameters()}
    moe_prefixes = tuple(f"layers.{k}.feed_forward." for k, b in model.layers.items()
                         if getattr(b, "moe_enabled", False))
    notes = []
    stages = build_model_parts(cfg.spec, plan, meshes, precision=Precision(torch.float32, torch.float32),
                               backend="dtensor", workload=cfg.workload)
    bad, n = [], 0
    layers_here = []
    for _, module in stages:
        layers_here += list(module.layers.keys())
        for name, p in module.named_parameters():
            fqn = clean_fqn(name)
            local = tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
            want = expected_local_shape(fqn, full[fqn], plan, meshes, tp_shards_embedding(plan), moe_prefixes)
            n += 1
            if local != want:
                bad.append(f"{fqn}: {local} != {want}")
    if plan.pp > 1:
        # every layer is held by exactly one pp rank
        counts = torch.zeros(cfg.spec.n_layers, device=meshes.world.device_type)
        for k in layers_here:
            counts[int(k)] += 1
        dist.all_reduce(counts, group=meshes.pp.get_group())
        if not bool((counts == 1).all()):
            bad.append(f"pipeline layers held per layer: {counts.int().tolist()} (want all 1)")
        notes.append(f"layers here {layers_here}")
    ok = not bad
    return ok, (f"{n} parameters checked" + (f"; {'; '.join(notes)}" if notes else "")
                + ("" if ok else f"; first mismatch {bad[0]}"))


def run_self_test(cfg) -> bool:
    plan = cfg.plan
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    meshes = build_meshes(plan, dev_type)
    rank = dist.get_rank()
    results = []
    for name in AXES + FLAT_AXES + (("ep", "efsdp") if plan.ep > 1 else ()):
        ok, msg = check_axis(name, meshes.axis(name))
        results.append((name, ok, msg))
    if plan.ep > 1:
        ok, msg = check_ep_all_to_all(meshes.ep)
        results.append(("ep all2all", ok, msg))
    try:
        ok, msg = check_shards(cfg, meshes)
    except Exception as e:   # noqa: BLE001 - a sharding that cannot be built is a failed check
        ok, msg = False, f"{type(e).__name__}: {e}"
    results.append(("shards", ok, msg))
    # combine every rank's verdicts: an axis passes only if it passed everywhere
    flags = torch.tensor([1.0 if ok else 0.0 for _, ok, _ in results], device=dev_type)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    all_ok = bool((flags == 1).all())
    if rank == 0:
        print(f"self-test: world {dist.get_world_size()} on {dev_type} ({dist.get_backend()}), model "
              f"{cfg.spec.name}, mesh {meshes.describe()}")
        for (name, _, msg), f in zip(results, flags.tolist()):
            print(f"  {name:<13} {msg:<70} {'PASS' if f == 1 else 'FAIL'}")
        print(f"self-test verdict: {'PASS' if all_ok else 'FAIL'}", flush=True)
    return all_ok


__all__ = ["self_test_config", "run_self_test", "ConfigError"]
