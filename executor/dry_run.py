"""Dry run: apply a plan for a world of N ranks inside ONE process, on the meta device.

``titan-run --dry-run --plan P --world N`` (or ``python -m executor.dry_run``)
starts a fake process group of the target world size (no communication, no
accelerator), builds the model on the meta device and applies the plan's
parallelisms exactly as a real run does (pipeline split, TP/SP, CP, AC,
FSDP). For the ranks it inspects (by default the first rank of every
pipeline stage, where memory differs) it reports the exact bytes of the
parameters, gradients and AdamW states each rank holds, and -- with
``--memory`` -- a FakeTensor estimate of one training step's peak from
torch's FSDP-aware memory tracker (activations, temporaries, FSDP buffers).
A layout the executor cannot apply fails here, before any cluster time is
spent. The JSON it prints (``--json``) is what the planner reads.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from search_spaces.planfile import read_plan_file

from .config import ConfigError, load_run_config


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def inspect_rank(cfg, rank: int, world: int, *, memory: bool) -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .mesh import build_meshes
    from .parallel import Precision, parallelize
    from .models.llama import Transformer

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        plan = cfg.plan
        meshes = build_meshes(plan, "cpu")
        # the target is an accelerator: bf16 compute with fp32 master weights, as titan-run uses there
        dtype = cfg.resolved.get("workload", {}).get("dtype", "bf16")
        precision = (Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16"
                     else Precision(param_dtype=torch.float32, reduce_dtype=torch.float32))
        with torch.device("meta"):
            model = Transformer(cfg.spec)
        if plan.pp > 1:
            from .parallel.pipeline import pipeline_split
            stages = pipeline_split(model, plan, meshes.pp)
        else:
            stages = [(0, model)]
        for _, module in stages:
            parallelize(module, plan, meshes, precision=precision, backend="dtensor")
        params = [p for _, m in stages for p in m.parameters()]
        n_local = sum(_local_numel(p) for p in params)
        trainable = sum(_local_numel(p) for p in params if p.requires_grad)
        # Under a pipeline schedule FSDP skips gradient sync until the last micro-batch
        # (torch.distributed.pipelining's backward_maybe_with_nosync), so each rank holds its
        # stage's gradients unsharded (fp32) between micro-batches.
        unsharded_grads = plan.pp > 1 and plan.n_microbatches > 1
        fsdp_ways = plan.dp_shard * plan.cp
        out: dict[str, Any] = {
            "rank": rank, "stages": [i for i, _ in stages],
            "param_numel": n_local,
            "params_bytes": 4 * n_local,              # fp32 master parameters
            "grads_bytes": 4 * trainable * (fsdp_ways if unsharded_grads else 1),   # fp32 gradients
            "optimizer_bytes": 8 * trainable,         # AdamW exp_avg + exp_avg_sq, fp32
        }
        out["state_bytes"] = out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"]
        if memory:
            if plan.pp > 1 or plan.cp > 1:
                out["memory_estimate"] = None
                out["memory_note"] = "FakeTensor step estimate covers pp == 1 and cp == 1 plans"
            else:
                out["memory_estimate"] = _fake_step_peak(stages[0][1], cfg, plan)
        return out
    finally:
        dist.destroy_process_group()


def _fake_step_peak(module, cfg, plan) -> dict[str, float]:
    """One forward/backward/AdamW step under FakeTensorMode with torch's FSDPMemTracker."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from .parallel.tensor_parallel import cross_entropy, loss_parallel

    import contextlib
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to_empty(device="cpu")
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=False)
        local_seq = cfg.seq_len
        x = torch.randint(0, cfg.spec.vocab_size, (plan.microbatch, local_seq))
        y = torch.randint(0, cfg.spec.vocab_size, (plan.microbatch, local_seq))
        tracker = FSDPMemTracker(module, opt)
        tracker.track_inputs((x,))
        ctx = loss_parallel if plan.tp > 1 else contextlib.nullcontext
        with tracker:
            for it in range(2):   # the second step has optimizer states: that is the steady peak
                with ctx():
                    loss = cross_entropy(module(x), y)
                    loss.backward()
                opt.step()
                opt.zero_grad()
                if it == 0:
                    tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    return {(k.name if hasattr(k, "name") else str(k)).lower(): float(v) for k, v in snap[dev].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="titan-run --dry-run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True, help="plan file")
    ap.add_argument("--world", type=int, help="target world size (default: the plan's degrees' product)")
    ap.add_argument("--ranks", help="comma-separated ranks to inspect (default: first rank of each pp stage)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override plan/workload keys")
    ap.add_argument("--memory", action="store_true", help="also a FakeTensor peak-memory estimate of one step")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        given = read_plan_file(args.plan)["plan"]
        world = args.world or given.world_size
        note = None
        if given.float8 and importlib.util.find_spec("torchao") is None:
            # Float8Linear keeps the high-precision weights: the state bytes do not depend on float8
            args.set.append("plan.float8=false")
            note = "float8 not applied (torchao is not installed); state bytes are the same"
        cfg = load_run_config(args.plan, args.set, world_size=world)
    except (ConfigError, ValueError) as e:
        print(f"titan-run: error: {e}", file=sys.stderr)
        return 2
    plan = cfg.plan
    per_stage = world // plan.pp
    ranks = ([int(r) for r in args.ranks.split(",")] if args.ranks else [s * per_stage for s in range(plan.pp)])
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        print(f"titan-run: error: --ranks {bad[0]} is outside the world of {world}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    rows = []
    for r in ranks:
        try:
            rows.append(inspect_rank(cfg, r, world, memory=args.memory))
        except Exception as e:  # noqa: BLE001 - a layout the executor cannot apply: report it as such
            doc = {"status": "error", "rank": r, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(json.dumps(doc) if args.json else f"titan-run: dry run failed on rank {r}: {doc['error']}",
                  file=sys.stdout if args.json else sys.stderr)
            return 1
    worst = max(rows, key=lambda x: x["state_bytes"])
    doc = {"status": "ok", "world": world, "plan": plan.to_dict(), "model": cfg.spec.name, "ranks": rows,
           "worst_rank": worst["rank"], "worst_state_bytes": worst["state_bytes"],
           "elapsed_s": round(time.perf_counter() - t0, 3), "note": note}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"dry run of {cfg.spec.name} on a fake world of {world} ({plan.describe()}), "
              f"{len(rows)} rank(s) in {doc['elapsed_s']} s")
        for x in rows:
            line = (f"  rank {x['rank']:>6} stages {x['stages']}: params {x['params_bytes'] / 2**30:8.3f} GiB  "
                    f"grads {x['grads_bytes'] / 2**30:8.3f}  optimizer {x['optimizer_bytes'] / 2**30:8.3f}")
            est = x.get("memory_estimate")
            if est:
                line += "  step peak (FakeTensor) " + ", ".join(f"{k} {v / 2**30:.3f}" for k, v in est.items())
            print(line)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
