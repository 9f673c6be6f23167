"""``tp_comm_overlap: auto``: full for the megatron layout on the GPUs NVIDIA's recipes ship a TP-overlap
(userbuffers) config for (H100 and later: the float8-capable presets), none on A100 and for the fsdp2 layout;
an explicit value always wins.  Checked through the estimate itself, not the helper alone."""
from __future__ import annotations

import pytest

from cost_models.estimate import estimate
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable

PLAN = Plan(dp_shard=8, tp=8, microbatch=1, n_microbatches=4, ac="none", compile=True)


def _tp(hw_name: str, **kw) -> float:
    model, hw = load_model("llama3-70b"), load_hardware(hw_name)
    est = estimate(CandidateTable.from_plans([PLAN]), model, hw, Workload(seq_len=4096, global_batch=32, **kw))
    return float(est.time["tp_comm"][0])


@pytest.mark.parametrize("hw", ["h100-sxm", "b200"])
def test_megatron_on_hopper_and_later_overlaps_tp_by_default(hw):
    kw = dict(state_layout="megatron", zero=1)
    auto, full, none = _tp(hw, **kw), _tp(hw, tp_comm_overlap="full", **kw), _tp(hw, tp_comm_overlap="none", **kw)
    assert none > 0 and full < none
    assert auto == pytest.approx(full, rel=1e-12)


def test_a100_and_the_fsdp2_layout_keep_tp_on_the_critical_path():
    mega = dict(state_layout="megatron", zero=1)
    assert _tp("a100-80g", **mega) == pytest.approx(_tp("a100-80g", tp_comm_overlap="none", **mega), rel=1e-12)
    assert _tp("h100-sxm") == pytest.approx(_tp("h100-sxm", tp_comm_overlap="none"), rel=1e-12)
    assert _tp("h100-sxm") > _tp("h100-sxm", tp_comm_overlap="full")
