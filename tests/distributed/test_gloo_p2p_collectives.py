"""The point-to-point twins of the SP boundary collectives and FSDP2's reduce-scatter (gloo) against the library ones.

On real gloo processes: ``seq_collectives`` all-gather / reduce-scatter over the sequence dim (with
their autograd, as autograd.Functions and as the custom ops compiled blocks trace),
``fsdp.GlooReduceScatter`` (SUM and AVG over a flat rank-major buffer) and ``fsdp.GlooAllGather`` (sync
and async, the input in the output or not; bitwise on any number of ranks: it only moves bytes), each
compared with the library collective on the same inputs: bitwise on 2 ranks, within 1e-6 on 3
(the local sum runs in rank order, gloo's ring in its own).  Then FSDP2 with both comms installed
(the reduce-scatters left in flight until the next one / the end of backward) against FSDP2's own
comms: the same gradients after one backward and after an accumulating second one.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.harness import free_port

pytestmark = pytest.mark.distributed


def _same(a: torch.Tensor, b: torch.Tensor, world: int, what: str) -> None:
    if world == 2:
        assert torch.equal(a, b), f"{what}: not bitwise equal, max diff {(a - b).abs().max().item():.3g}"
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _done(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (an AsyncCollectiveTensor, or already a plain tensor)."""
    return t.wait() if callable(getattr(t, "wait", None)) else t


def _worker(rank: int, world: int, port: int, out_q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        from executor.parallel.fsdp import GlooAllGather, GlooReduceScatter
        from executor.parallel.seq_collectives import (GatherSeq, ScatterSeq, all_gather_seq, all_gather_seq_op,
                                                       reduce_scatter_seq, reduce_scatter_seq_op)

        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.new_group(list(range(world)))
        gen = torch.Generator().manual_seed(rank)
        for b in (1, 2):                     # b == 1 receives straight into the output
            full = torch.randn(b, 6 * world, 5, 3, generator=gen)       # [batch, seq, ...], a pending sum per rank
            want = _done(funcol.reduce_scatter_tensor(full, "sum", 1, group))
            _same(reduce_scatter_seq(full, group, rank, world), want, world, f"reduce_scatter_seq b={b}")
            shard = torch.randn(b, 6, 5, 3, generator=gen)
            want = _done(funcol.all_gather_tensor(shard, 1, group))
            assert torch.equal(all_gather_seq(shard, group, rank, world), want), f"all_gather_seq b={b}"

            # autograd: the gather's backward is the reduce-scatter of the gradient, and the other way round
            w = torch.randn(b, 6 * world, 5, 3, generator=gen)
            x1, x2 = shard.clone().requires_grad_(), shard.clone().requires_grad_()
            (GatherSeq.apply(x1, group, rank, world) * w).sum().backward()
            (funcol.all_gather_single(x2, 1, group) * w).sum().backward()
            _same(x1.grad, x2.grad, world, f"GatherSeq backward b={b}")
            v = torch.randn(b, 6, 5, 3, generator=gen)
            y1, y2 = full.clone().requires_grad_(), full.clone().requires_grad_()
            (ScatterSeq.apply(y1, group, rank, world) * v).sum().backward()
            (funcol.reduce_scatter_single(y2, "sum", 1, group) * v).sum().backward()
            assert torch.equal(y1.grad, y2.grad), f"ScatterSeq backward b={b}"

            # the custom ops a compiled block traces (titan::all_gather_seq / reduce_scatter_seq), with autograd
            name = group.group_name
            x3, y3 = shard.clone().requires_grad_(), full.clone().requires_grad_()
            (all_gather_seq_op(x3, name, rank, world) * w).sum().backward()
            (reduce_scatter_seq_op(y3, name, rank, world) * v).sum().backward()
            assert torch.equal(x3.grad, x1.grad) and torch.equal(y3.grad, y1.grad), f"custom op backward b={b}"
            assert torch.equal(all_gather_seq_op(shard, name, rank, world), all_gather_seq(shard, group, rank, world))
            assert torch.equal(reduce_scatter_seq_op(full, name, rank, world),
                               reduce_scatter_seq(full, group, rank, world)), f"custom op b={b}"

        comm = GlooReduceScatter()
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            flat = torch.randn(world * 1000, generator=gen)
            want = torch.empty(1000)
            dist.reduce_scatter_tensor(want, flat.clone(), op=op, group=group)
            got = comm.allocate((1000,), dtype=torch.float32, device=torch.device("cpu"))
            assert comm(output_tensor=got, input_tensor=flat, group=group, op=op) is None
            _same(got, want, world, f"GlooReduceScatter {op}")

        gather = GlooAllGather()
        for async_op in (False, True):
            for in_place in (True, False):     # FSDP2's input is this rank's chunk of the output; a separate one too
                shard = torch.randn(777, generator=gen)
                want = torch.empty(world * 777)
                dist.all_gather_into_tensor(want, shard, group=group)
                got = gather.allocate((world * 777,), dtype=torch.float32, device=torch.device("cpu"))
                inp = got.narrow(0, rank * 777, 777) if in_place else shard.clone()
                if in_place:
                    inp.copy_(shard)
                work = gather(output_tensor=got, input_tensor=inp, group=group, async_op=async_op)
                if async_op:
                    assert isinstance(work, dist.Work) and work.wait()
                else:
                    assert work is None
                assert torch.equal(got, want), f"GlooAllGather async={async_op} in_place={in_place}"
        out_q.put((rank, "ok"))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        out_q.put((rank, traceback.format_exc()))


def _fsdp_worker(rank: int, world: int, port: int, out_q) -> None:
    """FSDP2 with titan-run's gloo comms (deferred reduce-scatters) vs the library's, same weights and data."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from executor.parallel import fsdp

        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))

        def build(ours: bool) -> nn.Module:
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(12, 30), nn.Tanh(), nn.Linear(30, 12)) for _ in range(3)],
                                  nn.Linear(12, 4))     # the root's own parameters
            for block in model[:3]:
                fully_shard(block, mesh=mesh)
                if ours:
                    fsdp.use_gloo_reduce_scatter(block, mesh)
            fully_shard(model, mesh=mesh)
            if ours:
                fsdp.use_gloo_reduce_scatter(model, mesh)
            return model

        ours, ref = build(True), build(False)
        gen = torch.Generator().manual_seed(rank)
        for micro in range(2):           # the second backward accumulates into the sharded grads: synchronous
            x = torch.randn(5, 12, generator=gen)
            for model in (ours, ref):
                model(x).pow(2).mean().backward()
            assert not fsdp._IN_FLIGHT, "reduce-scatters left in flight after backward"
            for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
                _same(a.grad.to_local(), b.grad.to_local(), world, f"{name}.grad after backward {micro + 1}")
        comms = [m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm for m in (*ours[:3], ours)]
        assert all(isinstance(c, fsdp.GlooReduceScatter) for c in comms), comms
        # each unit deferred its first backward's reduce-scatter (the root's runs in FSDP's final callback)
        assert [c.deferred for c in comms] == [1] * 4, [c.deferred for c in comms]
        out_q.put((rank, "ok"))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        out_q.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_with_the_gloo_comms_matches_the_library_comms(world):
    _run(_fsdp_worker, world)


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_collectives_match_the_library_collectives(world):
    _run(_worker, world)


def _run(worker, world: int) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    for rank, res in sorted(results.items()):
        assert res == "ok", f"rank {rank}: {res}"
