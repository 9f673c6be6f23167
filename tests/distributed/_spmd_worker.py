"""Worker for test_spmd_backend.py (torchrun, 2 gloo processes, FSDP over dp_shard=2).

Builds llama3-debug with the executor's spmd_types FSDP path, then runs one
forward/backward under spmd_types type checking twice: with the loss declared
a pending dp reduction (must pass) and with a plain ``loss.backward()`` (the
checker must reject it).  Rank 0 writes a JSON verdict to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cost_models.specs import load_model  # noqa: E402
from executor.init import init_weights  # noqa: E402
from executor.mesh import build_meshes  # noqa: E402
from executor.models.llama import Transformer  # noqa: E402
from executor.parallel.fsdp import apply_fsdp_spmd, spmd_batch, spmd_loss, spmd_typecheck  # noqa: E402
from executor.parallel.tensor_parallel import cross_entropy  # noqa: E402
from search_spaces.plan import Plan  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    meshes = build_meshes(Plan(dp_shard=2), "cpu")
    with torch.device("meta"):
        model = Transformer(load_model("llama3-debug"))
    apply_fsdp_spmd(model, meshes.spmd_dp, param_dtype=torch.float32, reduce_dtype=torch.float32,
                    reshard_after_forward=True)
    model.to_empty(device="cpu")
    init_weights(model, model.init_rule, seed=0, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(dist.get_rank())
    tok = torch.randint(0, 512, (2, 32), generator=g)
    out = {"placements": str(next(model.parameters()).placements)}

    with spmd_typecheck():
        x = spmd_batch(tok.clone(), meshes.spmd_dp)
        loss = cross_entropy(model(x), spmd_batch(tok.clone(), meshes.spmd_dp))
        spmd_loss(loss, meshes.spmd_dp).backward()
    out["typed_backward_ok"] = all(p.grad is not None for p in model.parameters())
    model.zero_grad()

    try:
        with spmd_typecheck():
            x = spmd_batch(tok.clone(), meshes.spmd_dp)
            loss = cross_entropy(model(x), spmd_batch(tok.clone(), meshes.spmd_dp))
            loss.backward()                       # a Varying loss: the checker must refuse
        out["untyped_backward"] = "accepted"
    except Exception as e:                        # noqa: BLE001
        out["untyped_backward"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
