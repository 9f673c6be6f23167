"""Expert parallelism folded over the TP ranks (Megatron-core's "MoE parallel folding": with whole experts an EP
group is ep consecutive ranks of a stage's tp x cp x dp, so ep may exceed dp x cp), a what-if of `titan-plan
estimate` that titan-run, which carves ep out of dp_shard x cp, does not run."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cost_models.coefficients import Coefficients
from cost_models.comm import axis_links
from cost_models.estimate import estimate
from cost_models.memory import memory_by_rank
from cost_models.specs import SpecError, load_hardware, load_model
from cost_models.uncertainty import regimes
from cost_models.workload import Workload
from planner.cli import main as plan_main
from search_spaces import constraints as C
from search_spaces.plan import Plan, PlanError
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import load_bench

QWEN = load_model("qwen3-30b-a3b")          # 128 experts
HW = load_hardware("h100-sxm")
FOLDED = dict(dp_shard=16, pp=2, tp=2, ep=32, microbatch=1, n_microbatches=64)


def _wl(**kw):
    return Workload(seq_len=4096, global_batch=1024, state_layout="megatron", zero=1, **kw)


def test_a_plan_may_fold_ep_over_tp_only_as_a_what_if():
    with pytest.raises(PlanError, match=r"'ep' \(32\) must divide dp_shard\*cp \(16\*1=16\)"):
        Plan(**FOLDED)                                       # titan-run's rule
    p = Plan(**FOLDED, runnable=False)
    assert p.expert_fsdp_size == 1
    with pytest.raises(PlanError, match=r"'ep' \(64\) must divide dp_shard\*cp\*tp \(16\*1\*2=32\)"):
        Plan(**{**FOLDED, "ep": 64}, runnable=False)         # no layout has more EP ranks than a stage
    t = C.Target.of(QWEN, world_size=64, seq_len=4096, global_batch=1024, gpus_per_node=8)
    assert C.check_plan(p, t, runnable=False) == []
    assert [w for w, _ in C.titan_run_limits(p, t)] == ["layout"]


def test_folding_needs_megatrons_whole_experts():
    wl, note = _wl().for_expert_layout(32, 16, 2)
    assert wl.expert_tp == "1" and not wl.experts_tp_split and "expert_tp not given: '1'" in note
    assert _wl(expert_tp="1").for_expert_layout(32, 16, 2) == (_wl(expert_tp="1"), None)
    assert _wl().for_expert_layout(8, 16, 2) == (_wl(), None)               # ep within dp x cp: as it was
    with pytest.raises(SpecError, match="expert_tp 1"):
        _wl(expert_tp="tp").for_expert_layout(32, 16, 2)
    with pytest.raises(SpecError, match="state_layout' to megatron"):
        Workload(seq_len=4096, global_batch=1024).for_expert_layout(32, 16, 2)


def test_whole_experts_put_an_ep_group_on_consecutive_ranks():
    t = CandidateTable.from_plans([Plan(dp_shard=8, tp=2, ep=8, microbatch=1, n_microbatches=64)])
    spread = axis_links(t, HW, Coefficients(), ep_stride_tp=True)["ep"]       # 16 ranks: two nodes
    packed = axis_links(t, HW, Coefficients(), ep_stride_tp=False)["ep"]      # 8 ranks: one node
    assert spread.per_node[0] == 4 and packed.per_node[0] == 8
    assert not _wl(expert_tp="1").ep_stride_tp and _wl().ep_stride_tp
    assert Workload(seq_len=4096, global_batch=1024, expert_tp="1").ep_stride_tp      # titan-run: ep in dp x cp
    est_spread = estimate(t, QWEN, HW, _wl())                 # experts split over TP: Megatron's default
    est_packed = estimate(t, QWEN, HW, _wl(expert_tp="1"))
    assert est_packed.time["ep_comm"][0] < est_spread.time["ep_comm"][0]
    assert regimes(t, QWEN, HW, _wl(expert_tp="1"))["expert parallel within a node"][0]
    assert regimes(t, QWEN, HW, _wl())["expert parallel across nodes"][0]


def test_folded_ep_holds_its_share_of_the_experts():
    folded = CandidateTable.from_plans([Plan(**FOLDED, runnable=False)])
    half = CandidateTable.from_plans([Plan(**{**FOLDED, "ep": 16})])
    wl = _wl(expert_tp="1")
    a = memory_by_rank(folded, QWEN, wl, Coefficients(), hw=HW)["first"]
    b = memory_by_rank(half, QWEN, wl, Coefficients(), hw=HW)["first"]
    # 32 EP ranks hold half the experts of 16 each; the optimizer shards the same expert bytes per rank
    # (expert data parallel dp*tp/ep: 1 against 2)
    assert a["params"][0] < b["params"][0]
    assert a["optimizer"][0] == pytest.approx(b["optimizer"][0], rel=1e-9)
    est = estimate(folded, QWEN, HW, wl)
    assert np.isfinite(est.step_time_s[0]) and est.time["ep_comm"][0] > 0


def test_estimate_cli_predicts_a_folded_layout_with_notes(capsys):
    argv = ["estimate", "--model", "qwen3-30b-a3b", "--gpus", "64", "--hardware", "h100-sxm", "--tp", "2", "--pp",
            "2", "--ep", "32", "--seq-len", "4096", "--global-batch", "1024", "--state-layout", "megatron",
            "--ac", "none", "--json"]
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["ep"] == 32 and out["workload"]["expert_tp"] == "1"
    assert not out["titan_run_can_run"] and "must divide dp_shard*cp" in out["note"]
    assert any("expert_tp not given" in n for n in out["knob_notes"])
    # titan-run's own layout refuses it in one line, exit 2
    assert plan_main(argv[:-5] + ["--ac", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "folded over the TP ranks is Megatron-core's layout" in err[0]


def test_the_search_never_folds():
    from planner.rank import plan_candidates
    from search_spaces.space import load_space
    r = plan_candidates(load_space("moe"), QWEN, HW, Workload(seq_len=4096, global_batch=256), world_size=64,
                        gpus_per_node=8)
    t = r.table
    assert len(t) and np.all(t.fsdp_size % t.ep == 0)


def test_qwen3_235b_rows_are_scored():
    vr = load_bench("validate_reference")
    rows = [r for r in vr.load_set("shared") if r["id"] == "mbridge_25.11_Qwen3_235B-A22B_256gpu"]
    case = vr.build_case(rows[0])
    assert case.plan.ep == 32 and case.plan.fsdp_size == 16 and case.workload.expert_tp == "1"
    assert vr.predict(case)["tokens_per_s_per_gpu"] > 0
