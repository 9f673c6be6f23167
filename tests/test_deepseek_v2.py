"""DeepSeek-V2 (arXiv:2405.04434): the preset against the report's stated size, and the trained run's fit verdict
(bench/reference_extra.yaml `deepseekv2_report_236B_h800`) through `titan-plan estimate`, the command line the
validator prints for the row (`python bench/validate_reference.py --cli DIR`)."""
from __future__ import annotations

import json

import pytest

from cost_models.flops import param_counts
from cost_models.specs import load_model
from tests.cost_model_helpers import load_bench, planner_cli

ROW_ID = "deepseekv2_report_236B_h800"


def _row_case():
    vr = load_bench("validate_reference")
    row = next(r for r in vr.load_extra_rows() if r["id"] == ROW_ID)
    return vr, vr.build_case(row)


def test_preset_has_the_reports_236b_total_and_21b_activated_parameters():
    """Sec. 3.1.2: "DeepSeek-V2 comprises 236B total parameters, of which 21B are activated for each token"."""
    m = load_model("deepseek-v2-236b")
    p = param_counts(m)
    assert round(p["total"] / 1e9) == 236, p["total"]
    assert round(p["active"] / 1e9) == 21, p["active"]
    # the stated architecture (Sec. 3.1.2)
    assert (m.n_layers, m.dim, m.n_heads, m.kv_lora_rank, m.q_lora_rank, m.qk_rope_head_dim) == (60, 5120, 128, 512, 1536, 64)
    assert (m.n_experts, m.n_shared_experts, m.top_k, m.moe_ffn_hidden, m.n_dense_layers) == (160, 2, 6, 1536, 1)
    # device-limited routing: 8 devices (D), at most 3 per token (M)
    assert (m.n_expert_groups, m.n_limited_groups) == (8, 3)


def test_row_states_the_reports_layout_and_scores_only_its_fit():
    vr, case = _row_case()
    plan, wl = case.plan, case.workload
    assert (plan.pp, plan.ep, plan.tp, plan.cp, plan.world_size) == (16, 8, 1, 1, 2048)
    assert plan.schedule == "1F1B" and plan.ac == "selective" and not plan.float8
    assert (wl.seq_len, wl.global_batch, wl.state_layout, wl.zero, wl.moment_dtype) == (4096, 9216, "megatron", 1, "fp32")
    assert case.trained and not case.oom
    assert case.measured["tokens_per_s_per_gpu"] == pytest.approx(1e12 / (172800 * 3600))
    assert [r["counted"] for r in vr.evaluate([case])] == [False]     # a training average: shown, not scored


def test_trained_deepseek_v2_run_fits_through_titan_plan_estimate(tmp_path):
    vr, case = _row_case()
    args = vr.cli_args(case, tmp_path)
    assert args[:3] == ["estimate", "--model", "deepseek-v2-236b"]       # the preset itself, not a written copy
    r = planner_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["predicted"]
    want = vr.predict(case)
    assert got["peak_memory_gib"] == pytest.approx(want["device_peak_gib"], abs=2e-3)
    assert got["headroom_gib"] >= 0 and want["fits"], got
    assert vr.fit_check([case]) == {"n": 1, "misses": []}
