"""PP / CP combined with FSDP, TP and compile, through the real training loop (titan-run, gloo).

Each case runs `python -m executor.cli` (torchrun) for 5 steps of a tiny
Llama (dim 64, 4 layers, GQA 4/2, vocab 512 for the byte tokenizer), seq_len
64, global batch 4, fp32, and compares the global loss after every step with
the single-process run of the same model, data and seed, and the global gradient
norm before clipping too (relative 1e-4; tests/distributed/harness.py: assert_matches_single_process).
"""
from __future__ import annotations

import functools

import pytest
import yaml

from search_spaces.plan import Plan
from tests.distributed.harness import assert_matches_single_process

pytestmark = pytest.mark.distributed
GLOBAL_BATCH = 4
TINY = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128, "vocab_size": 512,
        "rope_theta": 10000.0, "max_seq_len": 256, "source": "titan-autoplan combination tests"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-combo.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


# the plan must train GLOBAL_BATCH (checked), and the reference's loss must drop
matches_single_process = functools.partial(assert_matches_single_process, global_batch=GLOBAL_BATCH,
                                           reference_learns_by=0.0)


def test_cp2(tiny_model):
    matches_single_process(Plan(cp=2, microbatch=4), model=tiny_model)


@pytest.mark.slow
def test_cp2_selective_ac_grad_accumulation(tiny_model):
    # op-level SAC saves the per-block attention kernel outputs inside the ring; recompute re-runs the ring
    matches_single_process(Plan(cp=2, microbatch=2, n_microbatches=2, ac="selective"), model=tiny_model)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v", [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
def test_pp2_x_fsdp2(tiny_model, schedule, v):
    # the plan's default reshard_after_forward=True: ZBV needs it off (pipeline.py switches it)
    matches_single_process(Plan(pp=2, dp_shard=2, microbatch=1, n_microbatches=2, schedule=schedule,
                                stages_per_rank=v), model=tiny_model)


@pytest.mark.slow
def test_fsdp2_x_tp2_x_cp2(tiny_model):
    matches_single_process(Plan(dp_shard=2, tp=2, cp=2, microbatch=2), model=tiny_model)


@pytest.mark.slow
def test_pp2_x_dp2_x_tp2_x_cp2(tiny_model):
    matches_single_process(Plan(pp=2, dp_shard=2, tp=2, cp=2, microbatch=1, n_microbatches=2,
                                schedule="Interleaved1F1B", stages_per_rank=2), model=tiny_model)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v", [("1F1B", 1), ("ZBVZeroBubble", 2)])
def test_pp2_x_fsdp2_compiled(tiny_model, schedule, v):
    # ZBV + FSDP + compile: split weight backward gave wrong grads; pipeline.py runs the full backward
    matches_single_process(Plan(pp=2, dp_shard=2, microbatch=1, n_microbatches=2, schedule=schedule,
                                stages_per_rank=v, compile=True), model=tiny_model)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", pytest.param("DualPipeV", marks=pytest.mark.slow)])
def test_pp2_compiled_split_backward_without_fsdp(tiny_model, schedule):
    # a V schedule over compiled blocks with no data parallelism (titan-plan picks it for small jobs on this CPU):
    # the retained input backward needs donated buffers off, and the deferred weight pass gave wrong gradients
    # (the loss 0.8% off by the third step) until pipeline.py ran the full backward there too
    matches_single_process(Plan(pp=2, microbatch=1, n_microbatches=4, schedule=schedule, stages_per_rank=2,
                                compile=True), model=tiny_model)
