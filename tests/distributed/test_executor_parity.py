"""titan-run's training matches a single-process run, layout by layout (real gloo processes).

Each case runs the real executor (`python -m executor.cli`, torchrun) for 5 steps
of llama3-debug at seq_len 64, global batch 4, fp32, and compares the global
loss after every step with the single-process run of the same model, data and
seed (relative 1e-4; in practice the difference is ~1e-6), and the global gradient
norm before clipping too (tests/distributed/harness.py: assert_matches_single_process).
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from search_spaces.plan import Plan
from tests.distributed.harness import (DEFAULT_SEQ_LEN, DEFAULT_TRAIN, assert_close_per_step,
                                       assert_matches_single_process, reference_losses)

pytestmark = pytest.mark.distributed
GLOBAL_BATCH = 4
# the reference's loss must drop by more than 1.0 in the 5 steps
matches_single_process = functools.partial(assert_matches_single_process, global_batch=GLOBAL_BATCH,
                                           reference_learns_by=1.0)


def test_fsdp2_with_grad_accumulation_spmd_types_backend():
    matches_single_process(Plan(dp_shard=2, microbatch=1, n_microbatches=2))    # backend spmd_types (default)


def test_fsdp2_dtensor_backend():
    matches_single_process(Plan(dp_shard=2, microbatch=2, backend="dtensor", reshard_after_forward=False))


def test_tp_sp_with_selective_ac():
    matches_single_process(Plan(tp=2, microbatch=4, ac="selective"))


@pytest.mark.parametrize("backend", ["spmd_types", pytest.param("dtensor", marks=pytest.mark.slow)])
def test_fsdp_x_tp_with_torchtitans_selective_policy(backend):
    # workload selective_ac 'op': every other matmul of a block recomputed in backward, all-gathers again
    matches_single_process(Plan(dp_shard=2, tp=2, microbatch=2, ac="selective", backend=backend), nproc=4,
                           extra={"workload.selective_ac": "op"})


@pytest.mark.slow
def test_hsdp_2x2_with_full_ac():
    matches_single_process(Plan(dp_replicate=2, dp_shard=2, microbatch=1, ac="full"))


@pytest.mark.slow
def test_fsdp_x_tp_2x2():
    matches_single_process(Plan(dp_shard=2, tp=2, microbatch=2))


@pytest.mark.slow
def test_fsdp_x_tp_2x2_compiled():
    # compile + TP on the default backend (spmd_types: the vocab-parallel embedding is exact under
    # compile, docs/torch_on_cpu.md 8e); the dtensor backend keeps its embedding unsharded (8c)
    matches_single_process(Plan(dp_shard=2, tp=2, microbatch=2, compile=True))


def test_single_process_matches_a_plain_pytorch_loop():
    """The executor at world 1 vs a hand-written loop: same init values, same batches, same AdamW/LR/clip."""
    from cost_models.specs import load_model
    from executor.data import PackedBatches, load_token_stream
    from executor.init import full_value
    from executor.models.llama import Transformer
    from executor.tokenizer import ByteTokenizer

    steps, t = 5, {**DEFAULT_TRAIN, "steps": 5}
    want = reference_losses(steps=steps, global_batch=GLOBAL_BATCH)

    torch.manual_seed(0)
    spec = load_model("llama3-debug")
    model = Transformer(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_value(model.init_rule(name), p.shape, seed=t["seed"], fqn=name, device=torch.device("cpu")))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=t["lr"], betas=(0.9, 0.95), eps=1e-8, foreach=True)
    warmup, min_ratio = t["warmup"], 0.1

    def lr_factor(s):
        if s < warmup:
            return (s + 1) / warmup
        prog = min(1.0, (s - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    stream = load_token_stream("stdlib", ByteTokenizer(), t["max_corpus_bytes"])
    batches = PackedBatches(stream, seq_len=DEFAULT_SEQ_LEN, global_batch=GLOBAL_BATCH, dp_rank=0, dp_size=1,
                            seed=t["seed"])
    got = []
    for _ in range(steps):
        x, y = batches.next_batch()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        got.append(loss.item())
    assert_close_per_step(got, want)
