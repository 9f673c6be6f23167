"""BLOOM's measured memory (bigscience tr11-176B-ml chronicles-prequel.md, the tables' Mem column): each
mechanism the cost model adds for Megatron-DeepSpeed of Feb-Mar 2022, its bytes computed by hand from the cited
source on one stated row, and the validator's scoring of the Mem column as `nvidia_smi_gib`.

Sources (read at the commits BLOOM ran, see docs/memory_audit.md "BLOOM's Mem column"):
* DeepSpeed 2151c787a (2022-02-18): runtime/pipe/schedule.py TrainSchedule, runtime/pipe/module.py
  ``_is_checkpointable``, runtime/zero/stage_1_and_2.py ``reduce_gradients`` / ``step``, zero/constants.py;
* DeepSpeed olruwase/bf16-updates ab61edb0 (2022-03-09): runtime/bf16_optimizer.py, pipe/engine.py;
* bigscience Megatron-DeepSpeed ae6277f5 (2022-02-21): megatron/mpu/layers.py (--embed-layernorm),
  megatron/model/gpt_model.py GPTModelPipe.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import validate_reference as vr  # noqa: E402
from cost_models.coefficients import Coefficients  # noqa: E402
from cost_models.estimate import GIB  # noqa: E402
from cost_models.layout import in_flight_on_rank  # noqa: E402
from cost_models.memory import DEEPSPEED_REDUCE_BUCKET, memory_by_rank  # noqa: E402
from search_spaces.table import CandidateTable  # noqa: E402

ROWS = {r["id"]: r for r in vr.load_extra_rows()}
FP16_ROW = "bloom_prequel_181B_384gpu_pp6_mbs1"          # 02-21: 181B, TP 8, PP 6, DP 8, MBS 1, 38GB
BF16_ROW = "bloom_rebalance_184B_L100_a64_384gpu_tp8_pp6_mbs2"   # 02-28: BF16 optimizer, TP 8, PP 6, DP 8, MBS 2


def _case(rid):
    return vr.build_case(ROWS[rid])


def _first(case, model=None, workload=None):
    table = CandidateTable.from_plans([case.plan])
    by_rank = memory_by_rank(table, model or case.model, workload or case.workload, Coefficients(), hw=case.hw)
    return {k: float(v[0]) for k, v in by_rank["first"].items()}


def _stage0_params(h, layers, vocab, tp):
    """Local parameters of pipeline stage 0 by hand: `layers` GPT blocks (4h^2 attention + 8h^2 FFN, split tp
    ways; two LayerNorms of weight + bias, replicated) and the vocab-parallel embedding."""
    return layers * (12 * h * h / tp + 4 * h) + vocab * h / tp


def _deepspeed_train_schedule_in_flight(stages, stage_id, micro_batches):
    """The most forwards without their backward on `stage_id` under DeepSpeed's TrainSchedule: its
    ``_step_to_micro_batch`` (deepspeed/runtime/pipe/schedule.py, 2151c787a) replayed over its 2 (m + s - 1) steps."""
    def step_to_mb(step):
        even_step, even_stage = step % 2 == 0, stage_id % 2 == 0
        if even_step and even_stage:
            return step // 2 - stage_id // 2, True
        if not even_step and not even_stage:
            return (step - 1) // 2 - stage_id // 2, True
        if even_step and not even_stage:
            return step // 2 - stages + (stage_id + 1) // 2, False
        return (step - 1) // 2 - stages + 1 + stage_id // 2, False
    live = peak = 0
    for step in range(2 * (micro_batches + stages - 1)):
        mb, fwd = step_to_mb(step)
        if 0 <= mb < micro_batches:
            live += 1 if fwd else -1
            peak = max(peak, live)
    return peak


def test_deepspeed_pipe_buffers_hold_no_extra_micro_batch():
    """TrainSchedule reserves min(stages - stage_id + 1, micro_batches) buffers, one more than 1F1B's in-flight
    count, but the engine frees a buffer's output after its backward and its input at SendGrad: the live
    forwards are pp - r, the cost model's 1F1B count (checked, not added)."""
    case = _case(FP16_ROW)
    table = CandidateTable.from_plans([case.plan])
    pp, n = case.plan.pp, case.plan.n_microbatches
    for r in range(pp):
        assert _deepspeed_train_schedule_in_flight(pp, r, n) == pp - r
        assert float(in_flight_on_rank(table, r)[0]) == pp - r
    assert _deepspeed_train_schedule_in_flight(12, 0, 3) == 3        # capped by the micro-batches


def test_embedding_norm_and_dropout_mask_on_stage_0():
    """GPTModelPipe's EmbeddingPipe is never checkpointed (_is_checkpointable: ParallelTransformerLayerPipe only):
    per in-flight micro-batch stage 0 keeps the embedding LayerNorm's bf16 input and fp32 mean/rstd (torch.nn.
    LayerNorm after the vocab-parallel all-reduce) and the embedding dropout's 1-byte mask, all [s, b, h], no SP."""
    case = _case(FP16_ROW)
    assert case.model.embed_norm and case.workload.dropout and not case.workload.sequence_parallel
    s, b, h = 2048, 1, 14336
    per_mb = s * b * (2 * h + 8) + s * b * h           # norm input + stats, dropout mask
    plain = _first(case, model=vr.dataclasses.replace(case.model, embed_norm=False),
                   workload=vr.dataclasses.replace(case.workload, dropout=False))
    mine = _first(case)
    plain_drop = _first(case, model=vr.dataclasses.replace(case.model, embed_norm=False))
    in_flight = 6                                      # pp - 0 on stage 0 (1F1B / TrainSchedule)
    assert mine["activations"] - plain_drop["activations"] == pytest.approx(in_flight * s * b * (2 * h + 8), rel=1e-9)
    # dropout also changes the blocks' own terms; the embedding's share is the mask alone
    assert mine["activations"] - plain["activations"] > in_flight * per_mb * 0.999


def test_bf16_optimizer_keeps_fp32_and_bf16_gradients():
    """BF16_Optimizer (ab61edb0): fp32_groups_gradients_flat = zeros_like(flat bf16 params), not sharded, and the
    pipe engine's update_hp_grads(clear_lp_grads=False) leaves the bf16 .grad: 6 bytes per local parameter, plus
    the fp32 copy update_hp_grads makes of one .grad at a time, at most the embedding's vocabulary shard, and the
    reduction's fp16 copy of the whole fp32 buffer (engine.py allreduce_bucket: tensor.to(communication_data_type),
    fp16 under ZeRO): 2 more bytes per local parameter; the master copy and the two moments are sharded over DP
    (12 / dp)."""
    case = _case(BF16_ROW)
    assert case.workload.grad_accum == "hp_copy" and case.workload.pp_split == "weighted"
    # --pp-partition-method 'type:transformer|embedding': 100 layers + 2 embeddings over 6 stages, 17 units
    # each, so the first holds the embedding and 16 layers
    local = _stage0_params(12288, 16, 250880, 8)
    m = _first(case)
    assert m["params"] == pytest.approx(2 * local, rel=1e-9)
    assert m["grads"] == pytest.approx((6 + 2) * local + 4 * 250880 * 12288 / 8, rel=1e-9)
    assert m["optimizer"] == pytest.approx(12 * local / 8, rel=1e-9)


def _zero1_step_segments(local, dp, largest, bucket=5e8):
    """DeepSpeed ZeRO-1's reduce and step transients by hand, on the sizes of the BLOOM rows (each larger than the
    one before, so no later request fits a freed earlier segment but where said): the reduce bucket's flat copy
    (2 x max(5e8, largest)), the overflow check's fp32 copy and the norm's fp64 copy of the largest partition view
    (4 and 8 x min(largest, local / dp)), then the flattened 16-bit partition and its fp32 copy."""
    shard = local / dp
    view = min(largest, shard)
    segments = [2 * max(bucket, largest), 4 * view, 8 * view]
    flat16, fp32 = 2 * shard, 4 * shard
    assert segments[0] < segments[1]
    if flat16 <= segments[0]:                 # the 16-bit flat into the smallest free segment that holds it
        free = [segments[0] - flat16, segments[1], segments[2]]
    elif flat16 <= segments[1]:
        free = [segments[0], segments[1] - flat16, segments[2]]
    elif flat16 <= segments[2]:
        free = [segments[0], segments[1], segments[2] - flat16]
    else:
        free, segments = list(segments), segments + [flat16]
    return sum(segments) + (0.0 if any(fp32 <= f for f in free) else fp32)


def test_fp16_zero1_step_transients_and_reduce_bucket():
    """Before 02-28 (fp16, DeepSpeed ZeRO-1 stage_1_and_2.py at 2151c787a): 2-byte .grad by autograd, and the
    segments its reduction and step add after the activations are freed (`memory.deepspeed_step_segments`):
    ZeRO-1 turns contiguous_gradients off (engine.py), so the reduction flattens each bucket of up to
    reduce_bucket_size = 5e8 16-bit elements (zero/constants.py); the step's overflow check and norm copy the
    largest gradient view of the partition to fp32 and fp64; its fp32 gradient partition comes last."""
    case = _case(FP16_ROW)
    assert (case.workload.grad_accum, case.workload.grad_dtype) == ("autograd", "bf16")   # dated 02-21
    assert DEEPSPEED_REDUCE_BUCKET == 5e8
    local = _stage0_params(14336, 12, 250880, 8)       # 72 layers over 6 stages
    emb = 250880 * 14336 / 8
    m = _first(case)
    # DP 8: 4.15e9 local, the partition 0.52e9, the embedding 0.45e9 its largest view; the flat 16-bit partition
    # fits the overflow check's segment, its fp32 copy the norm's: 1e9 + 12 x 0.45e9
    assert _zero1_step_segments(local, 8, emb) == pytest.approx(2 * 5e8 + 12 * emb, rel=1e-12)
    assert m["grads"] == pytest.approx(2 * local + _zero1_step_segments(local, 8, emb), rel=1e-9)
    assert m["optimizer"] == pytest.approx(12 * local / 8, rel=1e-9)


def test_step_segments_reuse_what_fits():
    """A partition small enough for the reduce bucket's freed segment adds nothing beyond it; a tensor larger than
    the bucket sizes the bucket's flat copy."""
    from cost_models.memory import deepspeed_step_segments
    case = _case(FP16_ROW)
    table = CandidateTable.from_plans([case.plan])
    small = deepspeed_step_segments(table, case.workload, np.array([1e7]), np.array([1e6]))
    assert float(small[0]) == pytest.approx(2 * 5e8, rel=1e-12)            # 4e6, 8e6, 2e7 and 4e7 reuse it
    big = deepspeed_step_segments(table, case.workload, np.array([2e8]), np.array([9e8]))
    # bucket 2 x 9e8; the overflow check's 8e8 and the norm's 1.6e9 reuse it, then the flat 4e8 and fp32 8e8 share it
    assert float(big[0]) == pytest.approx(2 * 9e8, rel=1e-12)


def test_dp1_to_dp2_drop_is_the_sharded_state_and_the_step_segments():
    """Section 'Best TFLOPs' (02-17, fp16): 200B, TP 8, PP 10 read 73GB at DP 1 and 51GB at DP 2.  The model's drop,
    by hand: half the master and moments (12 bytes per parameter of the first stage's 2.94e9) and the step
    segments' change -- at DP 1 the flat 16-bit partition and its fp32 copy (2 + 4 bytes per parameter) fit no
    earlier segment, at DP 2 the flat fits the norm's segment and only the fp32 copy (4 / 2) is new -- less the
    NCCL buffers of the data-parallel communicator DP 2 adds: (6 + 4) bytes per parameter, 26.9 GiB where 22 was
    read; each level is within 6% of its reading (75.3 / 73, 48.4 / 51), where the model without the step
    segments read 64.8 and 43.4."""
    one = _case("bloom_prequel_200B_L80_a96_80gpu_dp1_tp8_pp10_mbs1_gbs2048_fp16_0217")
    two = _case("bloom_prequel_200B_L80_a96_160gpu_dp2_tp8_pp10_mbs1_gbs2048_fp16_0217")
    local, emb = _stage0_params(14400, 8, 250880, 8), 250880 * 14400 / 8
    assert _zero1_step_segments(local, 1, emb) - _zero1_step_segments(local, 2, emb) == pytest.approx(
        4 * local, rel=1e-12)
    a, b = vr.predict(one)["nvidia_smi_gib"], vr.predict(two)["nvidia_smi_gib"]
    assert a - b == pytest.approx((6 + 4) * local / GIB - one.hw.nccl_buffer_gib, rel=1e-9)
    assert abs(a / 73 - 1) < 0.06 and abs(b / 51 - 1) < 0.06
