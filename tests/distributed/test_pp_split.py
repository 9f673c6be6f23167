"""Workload ``pp_split: weighted`` in titan-run: the embedding and the LM head count as one layer each when the
layers are cut into pipeline stages (DeepSpeed's ``type:transformer|embedding``, Megatron's account-for-embedding
/ loss split, the Llama 3 paper), so the end stages hold a layer fewer, down to a stage holding only the embedding
or only the norm and head.

Real gloo processes through the real ``titan-run``, compared with one process per step (loss and grad norm within
1e-4 relative): PP 2 x Interleaved1F1B with 3 stages per rank on the 4-layer debug model cuts 6 units into 6
stages, so stage 0 is the embedding alone and stage 5 the norm and head alone; the self-test checks every layer is
held once; the stage layer counts are the cost model's (`cost_models.layout.stage_layer_counts`).
"""
from __future__ import annotations

import pytest

from cost_models.layout import stage_layer_counts
from executor.parallel.fsdp import spmd_fsdp_supported
from executor.parallel.pipeline import split_layers
from search_spaces.plan import Plan
from tests.distributed.harness import assert_matches_single_process, run_titan

WEIGHTED = {"workload.pp_split": "weighted"}
needs_spmd = pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))


def test_weighted_split_leaves_the_end_stages_a_layer_fewer():
    assert [len(r) for r in split_layers(4, 6, weighted=True)] == [0, 1, 1, 1, 1, 0] == stage_layer_counts(4, 6, True)
    assert [len(r) for r in split_layers(70, 12, weighted=True)] == [5] + [6] * 10 + [5]     # BLOOM-176B, PP 12
    assert [len(r) for r in split_layers(10, 4, weighted=True)] == [2, 3, 3, 2]
    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
    assert [len(r) for r in split_layers(10, 1, weighted=True)] == [10]                       # no pipeline: no units
    assert [list(r) for r in split_layers(4, 3, weighted=True)] == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match=r"\+2 units"):
        split_layers(4, 7, weighted=True)


@pytest.mark.distributed
@pytest.mark.parametrize("dp_shard", [1, pytest.param(2, marks=[pytest.mark.slow, needs_spmd])])
def test_stages_of_only_the_embedding_or_the_head_match_single_process(dp_shard):
    # dp_shard 1 runs nothing typed (titan-run's backend for a pipeline alone is dtensor: no collective but
    # the P2P); dp_shard 2 runs the spmd_types stages under FSDP
    plan = Plan(pp=2, dp_shard=dp_shard, schedule="Interleaved1F1B", stages_per_rank=3, n_microbatches=2,
                microbatch=1)
    run, _ = assert_matches_single_process(plan, extra=WEIGHTED)
    assert run.proc.stderr.strip() == "", run.proc.stderr[-2000:]
    if dp_shard > 1:
        assert "backend spmd_types" in run.proc.stdout, run.proc.stdout[-2000:]


def test_more_stages_than_units_is_refused_in_one_line():
    """pp*stages_per_rank above the layers + 2 units: one line naming the keys, exit 2, before any process."""
    run = run_titan(Plan(pp=2, schedule="Interleaved1F1B", stages_per_rank=4, n_microbatches=2), steps=1,
                    extra=WEIGHTED, expect_ok=False, timeout=300)
    assert run.proc.returncode == 2, run.proc.stdout[-2000:] + run.proc.stderr[-2000:]
    lines = [ln for ln in run.proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pp*stages_per_rank = 8 > 4 layers (+2 units" in lines[0], run.proc.stderr
