"""Megatron's EP all-to-all overlap (workload ep_a2a_overlap: combined_1f1b): the phase rule of
`step_time._ep_exposed`, where Megatron runs it and where not, the one-line error, titan-run's refusal,
and the validator's recipe file (the flag, the plan-file key and the --json echo: tests/test_moe_dispatch.py)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cost_models import step_time as S
from cost_models.coefficients import Coefficients
from cost_models.comm import axis_links
from cost_models.compute import Rates, layer_gemms
from cost_models.estimate import estimate
from cost_models.flops import layer_matmuls
from cost_models.moe_traffic import PER_NODE_DISPATCH_SMS, a2a_overlap_blocker, a2a_overlap_runs, dispatch_sm_share
from cost_models.specs import SpecError, load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import assert_titan_run_refuses, planner_cli

DSV3 = load_model("deepseek-v3-671b")
QWEN = load_model("qwen3-30b-a3b")
H100 = load_hardware("h100-sxm")
ROOT = Path(__file__).resolve().parents[1]


def _wl(overlap="none", **kw) -> Workload:
    return Workload(seq_len=4096, global_batch=1024, state_layout="megatron", zero=1, ep_a2a_overlap=overlap, **kw)


def _plan(**kw) -> Plan:
    base = dict(dp_shard=16, ep=16, microbatch=1, n_microbatches=64, ac="none", compile=True, runnable=False)
    return Plan(**{**base, **kw})


def _exposed(plans, model, wl, gpu_f, gpu_b):
    table = CandidateTable.from_plans(plans)
    coeffs = Coefficients()
    r = Rates(H100, wl, coeffs)
    tokens = table.microbatch * float(wl.seq_len) / table.cp
    tp = table.tp.astype(np.float64)
    links = axis_links(table, H100, coeffs)
    f, b = S._ep_exposed(table, model, H100, coeffs, links["ep"], r, tokens, tp, gpu_f, gpu_b, wl)
    mlp = layer_gemms(table, model, wl, coeffs, r, True,
                      only={m.name for m in layer_matmuls(model, True) if m.group == "ffn"}.__contains__)[0]
    return f, b, mlp


def test_phase_rule_against_its_formula():
    """Each all-to-all of one micro-batch hides under a computation of the other: combine-backward under
    the attention forward, both dispatches under the expert MLPs (dgrad, wgrad, forward), combine-forward
    under the attention backward; the step's unpaired micro-batch (one, without a pipeline) stays exposed."""
    plans = [_plan()]
    f0, b0, mlp = _exposed(plans, QWEN, _wl(), np.zeros(1), np.zeros(1))
    a2a = f0 / 2                                  # without the overlap: dispatch + combine each way
    assert a2a[0] > 0 and b0[0] == pytest.approx(2 * a2a[0])
    for scale in (0.05, 0.5, 1.0, 3.0):           # compute from far below to far above the all-to-alls
        gpu_f, gpu_b = mlp + scale * a2a, 2 * mlp + scale * a2a
        f, b, _ = _exposed(plans, QWEN, _wl("combined_1f1b"), gpu_f, gpu_b)
        ph1 = np.maximum(0, a2a - (gpu_f - mlp))
        ph2 = np.maximum(0, 2 * a2a - 3 * mlp)
        ph3 = np.maximum(0, a2a - (gpu_b - mlp))
        alone = 1 / 64
        assert f[0] == pytest.approx(alone * f0[0] + (1 - alone) * (ph3 + ph2 / 2)[0])
        assert b[0] == pytest.approx(alone * b0[0] + (1 - alone) * (ph1 + ph2 / 2)[0])
        assert f[0] + b[0] <= f0[0] + b0[0] + 1e-15
    # ample attention compute: what is left is the unpaired micro-batch's share and the dispatches the
    # expert MLPs cannot hide (EP 16 spans two nodes: the dispatches outlast the small experts' GEMMs)
    f, b, _ = _exposed(plans, QWEN, _wl("combined_1f1b"), 100 * a2a, 100 * a2a)
    ph2 = max(0.0, 2 * a2a[0] - 3 * mlp[0])
    assert ph2 > 0 and f[0] + b[0] == pytest.approx((f0[0] + b0[0]) / 64 + 63 / 64 * ph2)


def test_sm_resident_dispatch_costs_its_sms_even_when_hidden():
    """The per-node dispatchers (DeepEP, HybridEP) run their all-to-alls in kernels that hold
    PER_NODE_DISPATCH_SMS SMs: compute beside them runs on the rest, so an all-to-all of time a next to
    compute c takes max(a, c + share * a) -- hidden, it still costs share * a; NCCL's every-copy all-to-all
    states no SM budget and keeps the plain phase rule."""
    share = dispatch_sm_share(QWEN, _wl(ep_dispatch="per_node"), H100)
    assert share == pytest.approx(PER_NODE_DISPATCH_SMS / H100.sm_count)
    assert dispatch_sm_share(QWEN, _wl(ep_dispatch="every_copy"), H100) == 0.0
    assert dispatch_sm_share(QWEN, _wl(ep_dispatch="per_node"), dataclasses.replace(H100, sm_count=None)) == 0.0
    plans = [_plan()]
    wl0, wl1 = _wl(ep_dispatch="per_node"), _wl("combined_1f1b", ep_dispatch="per_node")
    f0, b0, mlp = _exposed(plans, QWEN, wl0, np.zeros(1), np.zeros(1))
    a2a = f0 / 2
    for scale in (0.05, 1.0, 100.0):
        gpu_f, gpu_b = mlp + scale * a2a, 2 * mlp + scale * a2a
        f, b, _ = _exposed(plans, QWEN, wl1, gpu_f, gpu_b)
        ph1 = np.maximum(share * a2a, a2a - (gpu_f - mlp))
        ph2 = np.maximum(share * 2 * a2a, 2 * a2a - 3 * mlp)
        ph3 = np.maximum(share * a2a, a2a - (gpu_b - mlp))
        alone = 1 / 64
        assert f[0] == pytest.approx(alone * f0[0] + (1 - alone) * (ph3 + ph2 / 2)[0])
        assert b[0] == pytest.approx(alone * b0[0] + (1 - alone) * (ph1 + ph2 / 2)[0])
    # ample compute on every side: each hidden all-to-all costs exactly its SM share
    mlp_big = 1e3 * a2a
    f, b, _ = _exposed(plans, QWEN, wl1, mlp + mlp_big, 2 * mlp + mlp_big)
    ph2 = max(share * 2 * a2a[0], 2 * a2a[0] - 3 * mlp[0])       # the dispatches beside the expert MLPs
    assert f[0] + b[0] == pytest.approx((f0[0] + b0[0]) / 64 + 63 / 64 * (2 * share * a2a[0] + ph2))
    assert f[0] + b[0] > (f0[0] + b0[0]) / 64 + 63 / 64 * max(0.0, 2 * a2a[0] - 3 * mlp[0])   # > the plain rule
    # DualPipeV: both directions' all-to-alls beside the other micro-batch's compute
    dual = _plan(dp_shard=8, ep=8, pp=2, schedule="DualPipeV", stages_per_rank=2, n_microbatches=128)
    big = np.full(1, 1e3)
    fd0, bd0, _ = _exposed([dual], QWEN, _wl(), big, big)             # every copy: fully hidden
    fd, bd, _ = _exposed([dual], QWEN, _wl(ep_dispatch="per_node"), big, big)
    assert fd0[0] == 0.0 and bd0[0] == 0.0 and fd[0] > 0 and bd[0] > 0
    fs, _, _ = _exposed([dual], QWEN, _wl(ep_dispatch="per_node"), np.zeros(1), np.zeros(1))
    assert fd[0] == pytest.approx(share * fs[0])


def test_interleaved_warmup_share_stays_exposed():
    pp, v, m = 2, 12, 128
    plan = _plan(dp_shard=8, ep=8, pp=pp, schedule="Interleaved1F1B", stages_per_rank=v, n_microbatches=m)
    big = np.full(1, 1e3)
    f0, b0, _ = _exposed([plan], QWEN, _wl(), big, big)
    f, b, _ = _exposed([plan], QWEN, _wl("combined_1f1b"), big, big)
    warm = (pp - 1) * 2 + (v - 1) * pp + 1        # Megatron's warm-up chunks on the first rank, + 1 for the overlap
    assert f[0] == pytest.approx(f0[0] * warm / (m * v)) and b[0] == pytest.approx(b0[0] * warm / (m * v))


@pytest.mark.parametrize("kw,wl_kw", [
    (dict(pp=2, schedule="1F1B", dp_shard=8, ep=8, n_microbatches=128), {}),    # pp > 1 needs an interleaved pipeline
    (dict(ac="full"), {}),                                                      # no full recompute
    (dict(ac="selective"), dict(selective_ac="modules", recompute_modules=("moe",))),   # no 'moe' module
    (dict(n_microbatches=1, dp_shard=16), {}),                                  # no partner micro-batch
])
def test_not_applied_where_megatron_does_not_run_it(kw, wl_kw):
    plan = _plan(**kw)
    gb = plan.dp_shard * plan.microbatch * plan.n_microbatches
    none = dataclasses.replace(_wl(**wl_kw), global_batch=gb)
    ov = dataclasses.replace(none, ep_a2a_overlap="combined_1f1b")
    e0 = estimate(CandidateTable.from_plans([plan]), QWEN, H100, none)
    e1 = estimate(CandidateTable.from_plans([plan]), QWEN, H100, ov)
    assert e0.time["ep_comm"][0] > 0 and e1.time["ep_comm"][0] == e0.time["ep_comm"][0]


def test_scalar_twin_agrees_with_the_vectorized_rule():
    plans = [_plan(), _plan(ac="full"), _plan(ac="selective"), _plan(ep=1), _plan(n_microbatches=1),
             _plan(dp_shard=8, ep=8, pp=2, schedule="1F1B", n_microbatches=128),
             _plan(dp_shard=8, ep=8, pp=2, schedule="GPipe", n_microbatches=128),
             _plan(dp_shard=8, ep=8, pp=2, schedule="Interleaved1F1B", stages_per_rank=12, n_microbatches=128)]
    table = CandidateTable.from_plans(plans)
    for wl in (_wl("combined_1f1b"), _wl("combined_1f1b", selective_ac="modules", recompute_modules=("moe",)), _wl()):
        runs = a2a_overlap_runs(table, wl)
        why = [a2a_overlap_blocker(p, wl) for p in plans]
        asked = wl.ep_a2a_overlap == "combined_1f1b"
        assert [bool(x) for x in runs] == [asked and w is None for w in why], (wl, why)
    assert sum(a2a_overlap_runs(table, _wl("combined_1f1b"))) == 3     # pp 1 (none, selective), interleaved


def test_estimate_says_when_the_overlap_does_not_apply():
    i = BASE.index("--ac")
    full = [*BASE[:i], "--ac", "full", *BASE[i + 2:], "--ep-a2a-overlap", "combined_1f1b"]
    r = planner_cli(*full, "--json")
    assert r.returncode == 0, r.stderr
    note = json.loads(r.stdout)["overlap_note"]
    assert note.startswith("ep_a2a_overlap 'combined_1f1b' does not apply to this layout (ac full")
    r2 = planner_cli(*full)
    assert r2.returncode == 0 and "note: ep_a2a_overlap 'combined_1f1b' does not apply" in r2.stdout
    r3 = planner_cli(*BASE, "--ep-a2a-overlap", "combined_1f1b", "--json")
    assert json.loads(r3.stdout)["overlap_note"] is None


def test_overlap_cuts_the_step_where_it_runs():
    plans = [_plan(), _plan(dp_shard=64, pp=8, tp=2, ep=64, schedule="Interleaved1F1B", stages_per_rank=4,
                            n_microbatches=16)]
    for model, plan in ((QWEN, plans[0]), (DSV3, plans[1])):
        gb = plan.dp_shard * plan.n_microbatches
        wl0 = dataclasses.replace(_wl(), global_batch=gb)
        wl1 = dataclasses.replace(wl0, ep_a2a_overlap="combined_1f1b")
        e0 = estimate(CandidateTable.from_plans([plan]), model, H100, wl0)
        e1 = estimate(CandidateTable.from_plans([plan]), model, H100, wl1)
        assert e1.time["ep_comm"][0] < e0.time["ep_comm"][0] and e1.step_time_s[0] < e0.step_time_s[0]
        assert e1.time["compute"][0] == pytest.approx(e0.time["compute"][0])
        assert e1.memory["activations"][0] == e0.memory["activations"][0]


def test_default_and_unknown_value():
    assert Workload(seq_len=8, global_batch=1).ep_a2a_overlap == "none"
    with pytest.raises(SpecError, match="ep_a2a_overlap.*none, combined_1f1b; got 'a2a'"):
        Workload(seq_len=8, global_batch=1, ep_a2a_overlap="a2a")



BASE = ["estimate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--hardware", "h100-sxm", "--seq-len", "4096",
        "--global-batch", "1024", "--ep", "16", "--microbatch", "1", "--ac", "none", "--state-layout", "megatron",
        "--zero", "1", "--compile"]


def test_titan_run_refuses_the_overlap(tmp_path):
    assert_titan_run_refuses(tmp_path, "ep_a2a_overlap", "combined_1f1b", ["none"])


def _validator():
    sys.path.insert(0, str(ROOT / "bench"))
    import validate_reference as V
    return V


def test_validator_applies_a_recipe_only_at_its_own_layout():
    V = _validator()
    recipes = V.load_recipes()
    row = {"id": "mbridge_25.09_DeepSeek-V3_1024gpu",
           "parallel": {"tp": 2, "pp": 8, "cp": 1, "vpp": 4, "ep": 64, "global_batch": 8192, "microbatch": 1}}
    assert V.recipe_for(row, recipes) is recipes[row["id"]]
    other = {**row, "parallel": {**row["parallel"], "vpp": 2}}
    assert V.recipe_for(other, recipes) is None
    assert V.recipe_for({**row, "id": "no-such-row"}, recipes) is None
    for rid, rec in recipes.items():            # every entry names its source and the facts it applies
        assert rec["source"]["commit"] and rec["cites"] and rec["layout"]["global_batch"] > 0, rid
        assert rec.get("ep_a2a_overlap", "none") in ("none", "combined_1f1b"), rid
        assert rec.get("recompute", "none") in ("none", "selective", "full"), rid


def test_validator_case_takes_the_recipes_settings():
    V = _validator()
    rows = {r["id"]: r for r in V.load_rows()} if V.reference_dir().joinpath("published_runs.yaml").is_file() else {}
    if "mbridge_25.09_DeepSeek-V3_1024gpu" not in rows:
        pytest.skip("shared reference set not present")
    c = V.build_case(rows["mbridge_25.09_DeepSeek-V3_1024gpu"])
    assert c.plan.ac == "selective" and c.workload.selective_ac == "modules"
    assert c.workload.recompute_modules == ("mla_up_proj", "mlp") and c.workload.ep_a2a_overlap == "combined_1f1b"
    assert c.workload.dp_comm_overlap == "none"
    q = V.build_case(rows["mbridge_25.11_Qwen3_30B-A3B_16gpu"])     # the recipe's layout is not the row's
    assert q.workload.ep_a2a_overlap == "none"
