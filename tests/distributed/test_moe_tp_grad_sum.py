"""titan-run's sum of the MoE gradients over TP (executor/moe_step.py ``sum_moe_grads_over_tp``) in buckets.

Two real gloo processes give their parameters different gradients (a non-contiguous one among them) and sum
them with bucket caps from "every gradient alone" to "all in one bucket": each result equals the sum of the
two ranks' gradients, bitwise (two ranks: one addition), whatever the bucketing.  `grad_buckets` itself is
checked on sizes alone, and the cost model's memory charges one bucket, not all MoE gradients.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch

from executor.moe_step import grad_buckets
from tests.distributed.harness import run_gloo_workers

pytestmark = pytest.mark.distributed

SHAPES = [(3, 5), (7,), (4, 4), (2, 3, 2), (11,)]


def _grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    out = [torch.randn(s, generator=g) for s in SHAPES]
    out[2] = out[2].t()            # a non-contiguous gradient (a transposed view)
    return out


def _worker(rank: int, port: int, caps: list[int], out_q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh

        from executor.moe_step import sum_moe_grads_over_tp
        dist.init_process_group("gloo", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        want = [a + b for a, b in zip(_grads(0), _grads(1))]
        for cap in caps:
            params = [nn.Parameter(torch.zeros(g.shape)) for g in _grads(rank)]
            for p, g in zip(params, _grads(rank)):
                p.grad = g
            params.append(nn.Parameter(torch.zeros(2)))          # no gradient: skipped
            sum_moe_grads_over_tp(params, mesh["tp"], cap_bytes=cap)
            for i, (p, w) in enumerate(zip(params, want)):
                assert torch.equal(p.grad, w), f"cap {cap}: gradient {i} is not the sum of the two ranks'"
            assert params[-1].grad is None
        dist.destroy_process_group()
        out_q.put((rank, None))
    except Exception:
        out_q.put((rank, traceback.format_exc()))


def test_bucketed_sum_equals_the_sum_for_every_cap():
    caps = [1, 4 * 15, 4 * 30, 4 * 200, 1 << 30]      # each alone, pairs, larger groups, everything in one
    run_gloo_workers(_worker, 2, caps, timeout=120)


def test_grad_buckets_cut_by_bytes():
    gs = [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)]            # fp32: 40, 40, 120, 20, 20, 20 bytes
    sizes = [[g.numel() for g in b] for b in grad_buckets(gs, 80)]
    assert sizes == [[10, 10], [30], [5, 5, 5]]                     # a tensor over the cap goes alone
    assert [[g.numel() for g in b] for b in grad_buckets(gs, 1 << 20)] == [[10, 10, 30, 5, 5, 5]]
    assert grad_buckets([], 80) == []


def test_memory_charges_one_bucket_not_every_moe_gradient(monkeypatch):
    """The memory model charges the sum one bucket (not a flat copy of every MoE gradient), and only what that
    bucket exceeds the turn's activations and buffers by: moe-debug at TP 2 on 8 tokens (its MoE gradients,
    10 MiB, are one bucket, larger than the turn's activations and buffers) and mixtral-8x7b at TP 2 x EP 2 on 4,096 (its MoE
    gradients a hundred buckets, its turn larger than one: nothing charged)."""
    import cost_models.memory as memory
    from cost_models.coefficients import Coefficients
    from cost_models.data_parallel import MOE_TP_BUCKET_BYTES, moe_tp_grad_bytes
    from cost_models.layout import rank_params
    from cost_models.specs import load_model
    from cost_models.workload import Workload
    from search_spaces.plan import Plan
    from search_spaces.table import CandidateTable

    for name, plan, seq, charged in (("moe-debug", Plan(tp=2), 8, True),
                                     ("mixtral-8x7b", Plan(dp_shard=2, tp=2, ep=2), 4096, False)):
        model = load_model(name)
        table = CandidateTable.from_plans([plan])
        wl = Workload(seq_len=seq, global_batch=plan.dp_shard)
        rp = rank_params(table, model, **wl.layout_keys)
        total = float(moe_tp_grad_bytes(table, model, rp, rp["busiest_layers"][1])[0])
        assert (total < MOE_TP_BUCKET_BYTES) == charged      # moe-debug: one bucket; mixtral: a hundred
        real = memory.memory_by_rank(table, model, wl, Coefficients())["busiest"]
        monkeypatch.setattr(memory, "MOE_TP_BUCKET_BYTES", 0)
        base = memory.memory_by_rank(table, model, wl, Coefficients())["busiest"]
        monkeypatch.undo()
        turn = float(base["activations"][0] + base["logits"][0] + base["fsdp_buffers"][0])
        extra = float(real["fsdp_buffers"][0] - base["fsdp_buffers"][0])
        assert extra == pytest.approx(max(0.0, min(total, MOE_TP_BUCKET_BYTES) - turn))
        assert (extra > 0) == charged, (seq, extra, turn)
