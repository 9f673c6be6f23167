"""FSDP without a pipeline keeps the last block's parameters after forward (executor/parallel/fsdp.py
``keep_last``; TorchTitan's default policy does the same): backward starts with that block, so resharding it would
only make FSDP gather it again right after the loss.  The other blocks follow the plan's ``reshard_after_forward``.

Two real gloo processes build llama3-debug with FSDP over dp_shard 2 on each backend and run one forward: after
it, every block but the last holds its parameters sharded (half the elements on each rank), the last block holds
them whole -- and with ``reshard_after_forward`` off every block does.  Then a backward: all gradients exist.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch

from executor.parallel.fsdp import spmd_fsdp_supported
from tests.distributed.harness import run_gloo_workers

pytestmark = pytest.mark.distributed


def _worker(rank: int, port: int, backend: str, reshard: bool, out_q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        from cost_models.specs import load_model
        from executor.mesh import build_meshes
        from executor.parallel.parallelize import Precision, build_model_parts
        from search_spaces.plan import Plan
        dist.init_process_group("gloo", rank=rank, world_size=2)
        spec = load_model("llama3-debug")
        plan = Plan(dp_shard=2, reshard_after_forward=reshard, backend=backend)
        meshes = build_meshes(plan, "cpu")
        [(_, model)] = build_model_parts(spec, plan, meshes, precision=Precision(torch.float32, torch.float32),
                                         backend=backend, device=torch.device("cpu"))
        tokens = torch.randint(0, spec.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))
        out = model(tokens)

        def local_numel(block):
            w = block.attention.wq.weight
            return (w.to_local() if isinstance(w, DTensor) else w).numel()
        full = spec.dim * spec.n_heads * spec.head_dim
        held = [local_numel(b) for b in model.layers.values()]
        want = [full if (not reshard or i == len(held) - 1) else full // 2 for i in range(len(held))]
        assert held == want, f"{backend}, reshard {reshard}: wq elements per block after forward {held}, want {want}"
        out.float().pow(2).mean().backward()
        assert all(p.grad is not None for p in model.parameters()), "a parameter without a gradient"
        dist.destroy_process_group()
        out_q.put((rank, None))
    except Exception:
        out_q.put((rank, traceback.format_exc()))


BACKENDS = [pytest.param("dtensor", marks=pytest.mark.slow), pytest.param("spmd_types", marks=pytest.mark.skipif(
    spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported())))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reshard", [True, False])
def test_the_last_block_keeps_its_parameters_after_forward(backend, reshard):
    run_gloo_workers(_worker, 2, backend, reshard, timeout=180)
