"""The pipeline receive buffers of `cost_models.memory` against torch's own PipelineStage.

torch.distributed.pipelining allocates one receive buffer per micro-batch for the input of every
non-first stage and the output gradient of every non-last stage, at the first step, and keeps them
(0.5 GiB per direction on each rank of llama3-70b TP 8 x PP 4 with 32 micro-batches): the workload's
``pp_recv_buffers: persistent`` (TorchTitan); titan-run receives per micro-batch and holds none of them.  Here real PipelineStage objects (single-process gloo group, meta
device: the buffers' shapes and dtypes, no memory) are built for the same stage shapes as the
modelled plan, and the bytes their buffers grow by from 4 to 8 micro-batches are compared with what
`memory_by_rank` adds to the first and the last pipeline rank over the same change.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import stage as pp_stage

from cost_models.coefficients import Coefficients
from cost_models.memory import memory_by_rank
from cost_models.specs import load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable

SEQ, TP, PP = 2048, 2, 3


@pytest.fixture(scope="module")
def world():
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _torch_recv_bytes(group, dim: int, n_mb: int) -> dict[int, int]:
    """Bytes of the receive buffers torch's PipelineStage allocates per stage index (of PP stages), for a
    [1, SEQ / TP, dim] bf16 stage input and output (the sequence-parallel residual stream)."""
    x = torch.empty(1, SEQ // TP, dim, dtype=torch.bfloat16, device="meta")
    y = torch.empty_like(x).requires_grad_()
    out = {}
    for idx in range(PP):
        st = PipelineStage(nn.Identity(), idx, PP, torch.device("meta"), input_args=(x,), output_args=(y,),
                           group=group)
        st._inference_mode = pp_stage.InferenceMode.STATIC
        st._prepare_forward_infra(n_mb, (x,), has_backward=True)
        st._prepare_backward_infra(n_mb)
        bufs = [r.buffer for info in (*st.args_recv_info.values(), *st.grad_recv_info.values())
                for r in info if isinstance(getattr(r, "buffer", None), torch.Tensor)]
        out[idx] = sum(b.numel() * b.element_size() for b in bufs)
    return out


def _model_acts(n_mb: int, **wl) -> dict[str, float]:
    plan = Plan(dp_replicate=1, dp_shard=2, pp=PP, tp=TP, cp=1, ep=1, microbatch=1, n_microbatches=n_mb,
                schedule="1F1B", stages_per_rank=1, ac="full", reshard_after_forward=True, compile=False,
                float8=False, backend="dtensor")
    workload = Workload(seq_len=SEQ, global_batch=2 * n_mb, dtype="bf16", **wl)
    by_rank = memory_by_rank(CandidateTable.from_plans([plan]), load_model("llama3-8b"), workload, Coefficients(),
                             caching_allocator=False)
    return {w: float(by_rank[w]["activations"][0]) for w in ("first", "last")}


def test_receive_buffers_match_torch_pipeline_stage(world):
    dim = load_model("llama3-8b").dim
    torch4, torch8 = _torch_recv_bytes(world, dim, 4), _torch_recv_bytes(world, dim, 8)
    # torch: one set per direction; the first stage receives gradients only, the last inputs only
    assert torch8[1] - torch4[1] == 2 * (torch8[0] - torch4[0]) > 0
    m4, m8 = _model_acts(4, pp_recv_buffers="persistent"), _model_acts(8, pp_recv_buffers="persistent")
    assert m8["first"] - m4["first"] == pytest.approx(torch8[0] - torch4[0], rel=1e-9)
    assert m8["last"] - m4["last"] == pytest.approx(torch8[PP - 1] - torch4[PP - 1], rel=1e-9)
    # titan-run's stages (auto: per micro-batch) hold none of them between uses
    a4, a8 = _model_acts(4), _model_acts(8)
    assert a8["first"] == pytest.approx(a4["first"]) and a8["last"] == pytest.approx(a4["last"])


def test_no_receive_buffers_when_the_runtime_frees_them():
    # Megatron's schedules (pp_sent_tensors: freed) receive into fresh tensors per micro-batch
    m4, m8 = _model_acts(4, state_layout="megatron"), _model_acts(8, state_layout="megatron")
    assert m8["first"] == pytest.approx(m4["first"]) and m8["last"] == pytest.approx(m4["last"])


_EMBEDDING_GRAD = r"""
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
mesh = init_device_mesh("cpu", (4,))
emb = parallelize_module(nn.Embedding(64, 8), mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
emb(torch.randint(0, 64, (1, 16))).sum().backward()
import json
print(json.dumps([list(emb.weight.to_local().shape), list(emb.weight.grad.to_local().shape), str(emb.weight.grad.placements)]))
"""


def test_dtensor_vocab_sharded_embedding_gets_a_full_vocab_gradient():
    # the root of the first rank's extra bytes: executor/parallel/tensor_parallel.py shards the embedding
    # RowwiseParallel, and DTensor's embedding backward returns a replicated [vocab, dim] weight gradient
    # (fake process group: one process, the DTensor dispatch of a real run; its own process, since this
    # module's other tests hold a gloo group)
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _EMBEDDING_GRAD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import json
    weight, grad, placements = json.loads(out.stdout.strip().splitlines()[-1])
    assert weight == [16, 8] and grad == [64, 8], out.stdout     # the local shard vs the local gradient
    assert "Replicate" in placements
    # ... which the model counts for the rank holding the embedding when the pipeline defers the sync
    from cost_models.memory import dtensor_embedding_grad_full
    plan = dict(dp_replicate=1, dp_shard=8, pp=4, tp=8, cp=1, ep=1, microbatch=1, n_microbatches=32,
                schedule="1F1B", stages_per_rank=1, ac="full", reshard_after_forward=True, compile=False,
                float8=False)
    table = CandidateTable.from_plans([Plan(**plan, backend="dtensor"), Plan(**plan, backend="spmd_types")])
    assert list(dtensor_embedding_grad_full(table)) == [True, False]
    model, wl = load_model("llama3-70b"), Workload(seq_len=8192, global_batch=256, dtype="bf16")
    by_rank = memory_by_rank(table, model, wl, Coefficients(), caching_allocator=False)
    extra = by_rank["first"]["fsdp_buffers"][0] - by_rank["first"]["fsdp_buffers"][1]
    assert extra == pytest.approx(4.0 * model.vocab_size * model.dim * 7 / 8)
    assert by_rank["last"]["fsdp_buffers"][0] == pytest.approx(by_rank["last"]["fsdp_buffers"][1])
