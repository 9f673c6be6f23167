"""Dry run: apply a plan for a world of N ranks inside ONE process, on the meta device.

``titan-run --dry-run --plan P --world N`` (or ``python -m executor.dry_run``)
starts a fake process group of the target world size (no communication, no
accelerator), builds the model on the meta device and applies the plan's
parallelisms exactly as a real run does (pipeline split, TP/SP, CP, AC,
FSDP), on the backend a real run resolves (``resolve_backend``: ``spmd_types``
unless the plan says ``dtensor`` or needs what only DTensor has; it prints
which). For the ranks it inspects (by default the first rank of every
pipeline stage, where memory differs) it reports the exact bytes of the
parameters, gradients and AdamW states each rank holds, and -- with
``--memory`` -- a FakeTensor estimate of one training step's peak from
torch's FSDP-aware memory tracker (activations, temporaries, FSDP buffers)
for every layout, pipelined (the rank's torch schedule order replayed
locally), context-parallel and MoE ones (routed balanced) included: see ``dry_run_step.py``.
The compute dtype is ``train.dtype`` if set, else the workload's (default bf16).
A layout the executor cannot apply fails here, before any cluster time is
spent. The JSON it prints (``--json``) is what the planner reads.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from .dry_run_args import DryRun, prepare
from .dry_run_step import fake_step_peak
from .mesh import build_meshes
from .parallel import build_model_parts, resolve_backend, resolve_precision
from .parallel.fsdp import forget_mesh_caches


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def _fsdp_unsharded_numel(stages) -> dict[int, int]:
    """id(FSDP-sharded parameter) -> elements of its unsharded (TP/EP-local) tensor, from FSDP's own record."""
    out = {}
    for _, mod in stages:
        for m in mod.modules():
            group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
            for fp in (group.fsdp_params if group else ()):
                out[id(fp.sharded_param)] = math.prod(fp._orig_size)
    return out


def inspect_rank(cfg, rank: int, world: int, *, memory: bool, announce: bool = False) -> dict[str, Any]:
    """One rank's exact state bytes (and with `memory` its FakeTensor step peak), the model built and
    parallelized on the backend a real run resolves (``resolve_backend``; its one-line note with
    `announce`)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        plan = cfg.plan
        meshes = build_meshes(plan, "cpu")
        # bf16 compute with fp32 master weights (the accelerator target) unless the run or workload says fp32
        precision = resolve_precision(cfg, accelerator=True)
        backend = resolve_backend(plan, meshes, announce=announce, spec=cfg.spec)
        stages = build_model_parts(cfg.spec, plan, meshes, precision=precision, backend=backend, workload=cfg.workload)
        params = [p for _, m in stages for p in m.parameters()]
        n_local = sum(_local_numel(p) for p in params)
        trainable = sum(_local_numel(p) for p in params if p.requires_grad)
        # Under a pipeline schedule FSDP skips gradient sync until the last micro-batch
        # (torch.distributed.pipelining's backward_maybe_with_nosync), so each rank holds its
        # stage's gradients unsharded (fp32) between micro-batches: each parameter at its FSDP-unsharded
        # (TP/EP-local) size -- expert weights are sharded over dp_shard*cp/ep ranks, not dp_shard*cp.
        unsharded = _fsdp_unsharded_numel(stages)
        # (workload pp_grad_sync: every_microbatch reduce-scatters each micro-batch's into the shard instead)
        defers = cfg.workload.pp_defers_grad_sync
        grad_numel = (sum(unsharded.get(id(p), _local_numel(p)) for p in params if p.requires_grad)
                      if plan.pp > 1 and plan.n_microbatches > 1 and defers else trainable)
        out: dict[str, Any] = {
            "rank": rank, "stages": [i for i, _ in stages], "backend": backend,
            "param_numel": n_local,
            "params_bytes": 4 * n_local,              # fp32 master parameters
            "grads_bytes": 4 * grad_numel,            # fp32 gradients
            "optimizer_bytes": 8 * trainable,         # AdamW exp_avg + exp_avg_sq, fp32
        }
        out["state_bytes"] = out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"]
        if memory:
            est, modelled = fake_step_peak(stages, cfg, meshes, precision, backend=backend)
            out["memory_estimate"] = est
            out["memory_model"] = modelled
        return out
    finally:
        dist.destroy_process_group()
        # the next rank's fake world has equal meshes on new groups: cached results would name this
        # world's destroyed groups ("Could not resolve the process group registered under the name 15")
        forget_mesh_caches()


def _mib(v: float) -> str:
    return f"{v / 2**20:,.1f}"


def main(argv: list[str] | None = None) -> int:
    prepared = prepare(argv)        # torch-free: flags, plan file, configuration, ranks (executor/dry_run_args.py)
    return prepared if isinstance(prepared, int) else execute(prepared)


def execute(run: DryRun) -> int:
    """Inspect the ranks of a prepared dry run and print the report (or its JSON document)."""
    t0 = time.perf_counter()
    cfg, world, ranks, note = run.cfg, run.world, run.ranks, run.note
    plan = cfg.plan
    torch.set_num_threads(1)
    rows = []
    for r in ranks:
        try:
            rows.append(inspect_rank(cfg, r, world, memory=run.memory, announce=not rows))
        except Exception as e:  # noqa: BLE001 - a layout the executor cannot apply: report it as such
            doc = {"status": "error", "rank": r, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(json.dumps(doc) if run.json else f"titan-run: dry run failed on rank {r}: {doc['error']}",
                  file=sys.stdout if run.json else sys.stderr)
            return 1
    worst = max(rows, key=lambda x: x["state_bytes"])
    doc = {"status": "ok", "world": world, "plan": plan.to_dict(), "model": cfg.spec.name,
           "backend": rows[0]["backend"], "ranks": rows,
           "worst_rank": worst["rank"], "worst_state_bytes": worst["state_bytes"],
           "elapsed_s": round(time.perf_counter() - t0, 3), "note": note}
    if run.json:
        print(json.dumps(doc))
    else:
        print(f"dry run of {cfg.spec.name} on a fake world of {world} ({plan.describe()}), backend {doc['backend']}, "
              f"{len(rows)} rank(s) in {doc['elapsed_s']} s")
        for x in rows:
            line = (f"  rank {x['rank']:>6} stages {x['stages']}: params {x['params_bytes'] / 2**30:8.3f} GiB  "
                    f"grads {x['grads_bytes'] / 2**30:8.3f}  optimizer {x['optimizer_bytes'] / 2**30:8.3f}")
            print(line)
            est, how = x.get("memory_estimate"), x.get("memory_model")
            if est:
                parts = ", ".join(f"{k} {_mib(v)}" for k, v in est.items() if k != "total" and v > 0)
                print(f"    step peak (FakeTensor) {_mib(est['total'])} MiB: {parts}")
                cm = how.get("in_flight_cost_model")
                print(f"    modelled: {how['how']}; micro-batches {how['micro_batches']} x {how['microbatch']} "
                      f"seq {how['local_seq']}, at most {how['in_flight_max']:g} in flight"
                      + (f" (cost model {cm:g})" if cm is not None else ""))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
