"""Expert-parallel dispatch/combine on real gloo processes vs a single-process MoE layer."""
from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.harness import free_port

pytestmark = pytest.mark.distributed


def _reference(seed: int):
    from cost_models.specs import load_model
    from executor.models.moe import MoEFeedForward

    torch.manual_seed(seed)
    spec = load_model("moe-debug")
    ff = MoEFeedForward(spec)
    with torch.no_grad():
        for p in ff.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(4, 16, spec.dim)      # 4 sequences; rank r of W gets a slice
    return spec, ff, x


def _worker(rank: int, world: int, port: int, ep: int, out_q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from executor.parallel.expert_parallel import apply_ep

        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        spec, ff, x = _reference(0)

        class Holder(torch.nn.Module):  # apply_ep walks model.layers
            def __init__(self, ff):
                super().__init__()
                blk = torch.nn.Module()
                blk.moe_enabled, blk.feed_forward = True, ff
                self.layers = torch.nn.ModuleDict({"0": blk})

        apply_ep(Holder(ff), mesh["ep"])
        per = x.shape[0] // world
        xl = x[rank * per:(rank + 1) * per].clone().requires_grad_(True)
        y = ff(xl)
        (y.square().sum()).backward()
        grads = {}
        for n, p in ff.named_parameters():
            if p.grad is None:
                continue
            if hasattr(p.grad, "full_tensor"):
                # expert grads already hold every ep rank's tokens; sum over the other data ranks
                g = p.grad.full_tensor().clone()
                dist.all_reduce(g, group=mesh["efsdp"].get_group())
            else:  # router / shared experts: per-rank partial sums over this rank's tokens
                g = p.grad.clone()
                dist.all_reduce(g)
            grads[n] = g
        if rank == 0:
            # numpy: pickled by value (tensors would be shared through the exiting process)
            out_q.put(("ok", y.detach().numpy(), xl.grad.numpy(), {n: g.numpy() for n, g in grads.items()}))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        out_q.put(("error", traceback.format_exc(), None, None))


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_ep_matches_single_process(world, ep):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, ep, q)) for r in range(world)]
    for p in procs:
        p.start()
    status, y0, gx0, grads = q.get(timeout=300)
    for p in procs:
        p.join(timeout=120)
    assert status == "ok", y0
    y0, gx0 = torch.from_numpy(y0), torch.from_numpy(gx0)
    grads = {n: torch.from_numpy(g) for n, g in grads.items()}
    spec, ff, x = _reference(0)
    xr = x.clone().requires_grad_(True)
    y = ff(xr)
    y.square().sum().backward()
    per = x.shape[0] // world
    torch.testing.assert_close(y0, y[:per].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx0, xr.grad[:per], rtol=1e-5, atol=1e-5)
    ref = {n: p.grad for n, p in ff.named_parameters() if p.grad is not None}
    assert set(ref) == set(grads)
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
