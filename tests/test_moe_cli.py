"""`titan-run` with mixture-of-experts plans: bad input is one line and exit 2 before any process starts;
a short EP run writes the MoE figures to metrics.jsonl and summary.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cost_models.specs import load_model
from tests.distributed.harness import DEFAULT_TRAIN
from tests.test_executor_cli import assert_one_line_error, run


def write_plan(tmp_path: Path, plan: dict, model="moe-debug", seq_len=32, global_batch=4, train=None) -> str:
    d = {"model": model, "workload": {"seq_len": seq_len, "global_batch": global_batch}, "plan": plan}
    if train is not None:
        d["train"] = train
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(d))
    return str(f)


def topk_too_large(tmp_path: Path) -> str:
    d = load_model("moe-debug").to_dict()
    d.update(name="moe-topk9", top_k=9)          # 8 experts
    f = tmp_path / "moe-topk9.yaml"
    f.write_text(yaml.safe_dump(d))
    return str(f)


BAD = [
    # ep does not divide the number of experts (8)
    ({"dp_shard": 3, "ep": 3, "microbatch": 1}, "moe-debug", 3, 3,
     "ep=3 must divide n_experts=8"),
    # ep does not divide dp_shard*cp
    ({"dp_shard": 2, "ep": 4, "microbatch": 2}, "moe-debug", 2, 4, "must divide dp_shard*cp"),
    # an MoE plan on a dense model
    ({"dp_shard": 2, "ep": 2, "microbatch": 2}, "llama3-debug", 2, 4, "is dense (no experts)"),
]


@pytest.mark.parametrize("plan,model,nproc,gb,message", BAD, ids=["ep-experts", "ep-dp", "ep-dense"])
def test_bad_moe_plan_exits_2_with_one_line(tmp_path, plan, model, nproc, gb, message):
    p = run(["--plan", write_plan(tmp_path, plan, model=model, global_batch=gb), "--nproc-per-node", str(nproc),
             "--run-dir", str(tmp_path / "run")], timeout=120)
    assert_one_line_error(p, message, tmp_path / "run")


def test_top_k_above_experts_exits_2(tmp_path):
    p = run(["--plan", write_plan(tmp_path, {"dp_shard": 2, "ep": 2, "microbatch": 2}, model=topk_too_large(tmp_path)),
             "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")], timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "top_k" in lines[0] and "1..n_experts (8)" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.distributed
def test_ep2_run_reports_routing_and_all_to_all(tmp_path):
    """moe-debug (aux loss on, aux-loss-free bias on) at EP 2: metrics and summary carry the MoE figures."""
    d = load_model("moe-debug").to_dict()
    d.update(name="moe-debug-bias", load_balance_bias=True)
    spec = tmp_path / "moe-bias.yaml"
    spec.write_text(yaml.safe_dump(d))
    train = {**DEFAULT_TRAIN, "steps": 3, "expert_bias_gamma": 0.01}
    p = run(["--plan", write_plan(tmp_path, {"dp_shard": 2, "ep": 2, "microbatch": 2}, model=str(spec), train=train),
             "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")], timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    moe = recs[-1]["moe"]
    tokens = 32 * 4 * 2                                    # every token reaches top_k=2 experts
    assert set(moe["tokens_per_expert"]) == {"1", "2", "3"}  # layer 0 is dense
    for counts in moe["tokens_per_expert"].values():
        assert len(counts) == 8 and sum(counts) == tokens
    assert moe["router_imbalance"] >= 1.0 and moe["ep_rank_imbalance"] >= 1.0
    assert moe["all_to_all_bytes"] > 0 and moe["all_to_all_s"] > 0 and moe["aux_loss_term"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["moe"]["all_to_all_bytes_per_step"] > 0
    # forward + backward, dispatch + combine: 4 x (local tokens x top_k) rows of dim floats, 3 MoE layers
    local_rows = 32 * 2 * 2
    assert summary["moe"]["all_to_all_bytes_per_step"] == pytest.approx(3 * 4 * local_rows * 256 * 4)
