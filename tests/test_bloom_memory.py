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
    the fp32 copy update_hp_grads makes of one .grad at a time, at most the embedding's vocabulary shard; the
    master copy and the two moments are sharded over DP (12 / dp)."""
    case = _case(BF16_ROW)
    assert case.workload.grad_accum == "hp_copy" and case.workload.pp_split == "weighted"
    # --pp-partition-method 'type:transformer|embedding': 100 layers + 2 embeddings over 6 stages, 17 units
    # each, so the first holds the embedding and 16 layers
    local = _stage0_params(12288, 16, 250880, 8)
    m = _first(case)
    assert m["params"] == pytest.approx(2 * local, rel=1e-9)
    assert m["grads"] == pytest.approx(6 * local + 4 * 250880 * 12288 / 8, rel=1e-9)
    assert m["optimizer"] == pytest.approx(12 * local / 8, rel=1e-9)


def test_fp16_zero1_step_gradient_partition_and_bucket():
    """Before 02-28 (fp16, DeepSpeed ZeRO-1 stage_1_and_2.py): 2-byte .grad by autograd, the step's fp32 gradient
    partition (4 / dp per parameter, `.to(fp32)` of the flattened partition) and, with a pipeline, the contiguous
    reduce bucket of reduce_bucket_size = 5e8 16-bit elements (zero/constants.py)."""
    case = _case(FP16_ROW)
    assert (case.workload.grad_accum, case.workload.grad_dtype) == ("autograd", "bf16")   # dated 02-21
    assert DEEPSPEED_REDUCE_BUCKET == 5e8
    local = _stage0_params(14336, 12, 250880, 8)       # 72 layers over 6 stages
    m = _first(case)
    assert m["grads"] == pytest.approx(2 * local + 2 * 5e8, rel=1e-9)
    assert m["optimizer"] == pytest.approx((12 + 4) * local / 8, rel=1e-9)


def test_dp1_to_dp2_drop_is_the_sharded_state():
    """Section 'Best TFLOPs' (02-17, fp16): 200B, TP 8, PP 10 read 73GB at DP 1 and 51GB at DP 2; the drop is half
    the sharded state of the first stage: 16 bytes per parameter (master, moments, the step's fp32 gradient), less
    the NCCL buffers of the data-parallel communicator that DP 2 adds."""
    one = _case("bloom_prequel_200B_L80_a96_80gpu_dp1_tp8_pp10_mbs1_gbs2048_fp16_0217")
    two = _case("bloom_prequel_200B_L80_a96_160gpu_dp2_tp8_pp10_mbs1_gbs2048_fp16_0217")
    local = _stage0_params(14400, 8, 250880, 8)
    drop = vr.predict(one)["nvidia_smi_gib"] - vr.predict(two)["nvidia_smi_gib"]
    assert drop == pytest.approx(16 * local / 2 / GIB - one.hw.nccl_buffer_gib, rel=1e-9)
    measured = one.measured["nvidia_smi_gib"] - two.measured["nvidia_smi_gib"]
    assert drop == pytest.approx(measured, rel=0.05)


def test_the_mem_column_is_scored_as_nvidia_smi():
    """The validator reads measured.mem_gb_column of a megatron-deepspeed-2022 row as nvidia_smi_gib, predicts it as
    stage 0's device bytes plus the CUDA context, and counts it among the memory metrics."""
    row = copy.deepcopy(ROWS[FP16_ROW])
    row["measured"]["mem_gb_column"] = 41
    case = vr.build_case(row)
    assert case.measured["nvidia_smi_gib"] == 41.0 and case.smi_ranks == ("first",)
    first = _first(case)
    want = sum(first.values()) / GIB + case.hw.cuda_context_gib
    assert vr.predict(case)["nvidia_smi_gib"] == pytest.approx(want, rel=1e-12)
    res = [r for r in vr.evaluate([case]) if r["metric"] == "nvidia_smi_gib"]
    assert res and res[0]["counted"] and res[0]["measured"] == 41.0
    assert vr.summarize(res)["memory"]["n"] == 1
    best = vr.build_case(ROWS["bloom_prequel_200B_L80_a96_80gpu_dp1_tp8_pp10_mbs1_gbs2048_fp16_0217"])
    assert best.smi_ranks == ("first", "last")     # the 'Best TFLOPs' footnote: "first (last) nodes"
    nonbloom = vr.build_case(ROWS[next(k for k, r in ROWS.items() if not k.startswith("bloom")
                                       and "mem_gb_column" not in r.get("measured", {}) and not r.get("not_scorable")
                                       and not r.get("ran_out_of_memory"))])
    assert "nvidia_smi_gib" not in nonbloom.measured


def test_the_oom_layouts_do_not_fit():
    """The three BLOOM layouts of the set the chronicles report as OOM (02-25) are predicted not to fit, among
    them 181B at TP 2, PP 6, DP 32, MBS 1, which the model called feasible (75.3 of 78.7 GiB) before the fp16
    ZeRO-1 step's gradient partition and reduce bucket were counted; so is every OOM layout of the extra set."""
    oom = [vr.build_case(r) for r in ROWS.values() if r.get("ran_out_of_memory") and not r.get("not_scorable")]
    bloom = [c for c in oom if c.id.startswith("bloom")]
    assert len(bloom) == 3
    assert "bloom_prequel_181B_L72_a64_384gpu_dp32_tp2_pp6_mbs1_gbs2048_0225" in {c.id for c in bloom}
    assert not any(vr.predict(c)["fits"] for c in bloom)
    assert np.isfinite([vr.predict(c)["device_peak_gib"] for c in bloom]).all()
    assert vr.oom_check(oom)["misses"] == []


def test_titan_run_refuses_a_model_with_an_embedding_norm(tmp_path):
    """embed_norm describes other frameworks' models to the cost model; titan-run would build the model without it,
    so it refuses the key in one line instead of training a different model."""
    from executor.config import ConfigError   # lazy: the cost-model tests stay torch-free
    from tests.cost_model_helpers import run_config_with_model_key
    with pytest.raises(ConfigError, match="model key 'embed_norm' is true.*set it false"):
        run_config_with_model_key(tmp_path, "embed_norm", True)
    assert not run_config_with_model_key(tmp_path, "embed_norm", False).spec.embed_norm
