"""How the EP all-to-all reaches other nodes (workload ep_dispatch): every routed copy (titan-run, TorchTitan,
Megatron's alltoall dispatcher) or each token once per distinct remote node, then over NVLink (DeepEP /
HybridEP, Megatron's flex dispatcher); the share and the step's EP time against a hand computation, what
auto resolves to, the validator's recipe key, and -- for every MoE workload key (ep_a2a_overlap,
moe_weighting, ep_dispatch) -- the flag, the plan-file key, the --json echo and the one-line errors."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from cost_models.coefficients import Coefficients
from cost_models.comm import link_params
from cost_models.layout import layer_mix
from cost_models.moe_traffic import ib_share, nvlink_relay, sends_once_per_node
from cost_models.specs import SpecError, load_hardware, load_model
from cost_models.step_time import step_time_breakdown
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import (assert_plan_file_value_refused, assert_titan_run_refuses, load_bench,
                                      planner_cli)

QWEN = load_model("qwen3-30b-a3b")          # 128 experts, top 8, no routing groups
DSV3 = load_model("deepseek-v3-671b")       # 256 experts in 8 groups, a token within its best 4
H100 = load_hardware("h100-sxm")


def _wl(dispatch="auto", layout="megatron", **kw) -> Workload:
    zero = {"zero": 1} if layout == "megatron" else {}
    return Workload(seq_len=4096, global_batch=1024, state_layout=layout, ep_dispatch=dispatch, **zero, **kw)


def test_share_once_per_node_against_a_hand_computation():
    # EP 16 over 2 nodes of 8: a token's 8 experts hit 2 (1 - (1/2)^8) distinct nodes, half of them remote,
    # one network copy each, out of 8 copies
    two = float(ib_share(QWEN, np.array([16]), np.array([8]), True)[0])
    assert two == pytest.approx(2 * (1 - 0.5 ** 8) * (1 / 2) / 8)
    # EP 64 over 8 nodes, no routing groups: all 8 nodes reachable
    eight = float(ib_share(QWEN, np.array([64]), np.array([8]), True)[0])
    assert eight == pytest.approx(8 * (1 - (7 / 8) ** 8) * (7 / 8) / 8)
    # every copy: (p - k) / p, with or without routing groups
    assert float(ib_share(QWEN, np.array([16]), np.array([8]), False)[0]) == pytest.approx(8 / 16)
    assert float(ib_share(DSV3, np.array([64]), np.array([8]), False)[0]) == pytest.approx(56 / 64)
    # node-limited routing once per node: at most 4 of the 8 nodes (one group per node)
    assert float(ib_share(DSV3, np.array([64]), np.array([8]), True)[0]) == pytest.approx(
        4 * (1 - (3 / 4) ** 8) * (7 / 8) / 8)
    # one node: nothing crosses the network either way
    for once in (True, False):
        assert float(ib_share(QWEN, np.array([8]), np.array([8]), once)[0]) == 0.0


def test_nvlink_fan_out_carries_every_remote_copy():
    ep, k = np.array([16, 64]), np.array([8, 8])
    relay = nvlink_relay(QWEN, ep, k, True, rail_optimized=False)
    # relay x network share = the every-copy remote share: each remote copy crosses NVLink on its node
    assert relay * ib_share(QWEN, ep, k, True) == pytest.approx((ep - k) / ep)
    for rail in (False, True):
        assert (nvlink_relay(QWEN, ep, k, False, rail) == float(rail)).all()


@pytest.mark.parametrize("dispatch", ["every_copy", "per_node"])
def test_step_ep_time_against_a_hand_computation(dispatch):
    """Qwen3-30B-A3B, EP 16 on two H100 nodes, no pipeline: 48 MoE blocks x 64 micro-batches x (dispatch +
    combine) x (forward + backward), each all-to-all the slower of its NVLink and network sides."""
    plan = Plan(dp_shard=16, ep=16, microbatch=1, n_microbatches=64, ac="none", compile=True, runnable=False)
    t = CandidateTable.from_plans([plan])
    once = dispatch == "per_node"
    lp = link_params(H100, Coefficients())
    nbytes = 4096 * QWEN.top_k * QWEN.dim * 2.0
    p, k = 16, 8
    off_share = 2 * (1 - 0.5 ** 8) / 2 / 8 if once else (p - k) / p
    relayed = (p - k) / p if once else float(H100.rail_optimized) * off_share
    on = ((k - 1) / p + relayed * (k - 1) / k) * nbytes / lp["intra_bw"] + (k - 1) * lp["intra_alpha"]
    off = off_share * nbytes / lp["inter_bw"] + (p - k) * lp["inter_alpha"]
    _, n_moe = layer_mix(t, QWEN, first=False)
    want = float(n_moe[0]) * 64 * 4 * max(on, off)
    got = step_time_breakdown(t, QWEN, H100, _wl(dispatch), Coefficients())["ep_comm"][0]
    assert got == pytest.approx(want, rel=1e-9)


def test_auto_resolves_by_layout_and_routing():
    assert not sends_once_per_node(DSV3, _wl(layout="fsdp2"))       # titan-run / TorchTitan: every copy
    assert sends_once_per_node(DSV3, _wl())                          # megatron, node-limited: DeepEP's
    assert not sends_once_per_node(QWEN, _wl())                      # megatron, free routing: alltoall
    assert sends_once_per_node(QWEN, _wl("per_node", layout="fsdp2"))
    assert not sends_once_per_node(DSV3, _wl("every_copy"))
    assert Workload(seq_len=8, global_batch=1).ep_dispatch == "auto"
    with pytest.raises(SpecError, match="ep_dispatch.*auto, every_copy, per_node; got 'deepep'"):
        Workload(seq_len=8, global_batch=1, ep_dispatch="deepep")


def test_validator_applies_the_recipes_dispatcher():
    V = load_bench("validate_reference")
    rows = {r["id"]: r for r in V.load_rows() + V.load_extra_rows()} \
        if V.reference_dir().joinpath("published_runs.yaml").is_file() else {}
    if "mbridge_26.06_Qwen3_30B-A3B_16gpu" not in rows:
        pytest.skip("shared reference set not present")
    for rid, want in (("mbridge_26.06_Qwen3_30B-A3B_16gpu", "per_node"),          # flex, HybridEP
                      ("mbridge_25.09_DeepSeek-V3_1024gpu", "per_node"),          # flex, DeepEP
                      ("mbridge_26.02.01_H100_Qwen3_30B-A3B_16gpu_pp2", "per_node"),
                      ("nemo_25.02_B200_Mixtral-8x7B_64gpu", "every_copy")):      # alltoall
        assert V.build_case(rows[rid]).workload.ep_dispatch == want, rid
    named = {rid: rec for rid, rec in V.load_recipes().items() if "token_dispatcher" in rec}
    assert len(named) >= 5
    for rid, rec in named.items():                 # each entry that names a dispatcher applies it
        assert rec.get("ep_dispatch") == ("per_node" if str(rec["token_dispatcher"]).startswith("flex")
                                          else "every_copy"), rid


def test_titan_run_refuses_per_node(tmp_path):
    assert_titan_run_refuses(tmp_path, "ep_dispatch", "per_node", ["auto", "every_copy"], model="moe-debug",
                             plan={"dp_shard": 2, "ep": 2, "microbatch": 2})


# ---------------------------------------------------------------- the MoE workload keys on the CLI
BASE = ["estimate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--hardware", "h100-sxm", "--seq-len", "4096",
        "--global-batch", "1024", "--ep", "16", "--microbatch", "1", "--ac", "none", "--state-layout", "megatron",
        "--zero", "1", "--compile"]


# the pipeline memory keys (tests/test_pp_memory_keys.py) on the same layout, pipelined under the fsdp2 layout
PP_FSDP2 = {"flags": ("--state-layout", "fsdp2", "--zero", "3", "--pp", "2", "--ep", "8", "--schedule",
                      "Interleaved1F1B", "--stages-per-rank", "2"),
            "plan": {"dp_shard": 8, "pp": 2, "ep": 8, "schedule": "Interleaved1F1B", "stages_per_rank": 2},
            "workload": {"state_layout": "fsdp2", "zero": 3}}
# ... with the gradient sync stated, so that the estimate chooses none of the keys (an unstated sync is taken as
# every_microbatch where only that fits: tests/test_planner_cli.py)
PP_FSDP2_LAST = {"flags": (*PP_FSDP2["flags"], "--pp-grad-sync", "last_microbatch"), "plan": PP_FSDP2["plan"],
                 "workload": {"state_layout": "fsdp2", "zero": 3, "pp_grad_sync": "last_microbatch"}}


@pytest.mark.parametrize("key, value, default, term, lower, bad_flag, allowed, extra", [
    ("ep_a2a_overlap", "combined_1f1b", "none", ("time_s", "ep_comm"), True, "a2a", "combined_1f1b", {}),
    ("moe_weighting", "combine", "auto", ("memory_gib", "activations"), False, "probs", "activation", {}),
    ("ep_dispatch", "per_node", "auto", ("time_s", "ep_comm"), True, "deepep", "per_node", {}),
    ("pp_sent_tensors", "freed", "auto", ("memory_gib", "activations"), True, "free", "freed", PP_FSDP2_LAST),
    ("pp_recv_buffers", "persistent", "auto", ("memory_gib", "activations"), False, "keep", "persistent",
     PP_FSDP2_LAST),
    ("pp_grad_sync", "every_microbatch", "auto", ("memory_gib", "grads"), True, "every",
     "every_microbatch", PP_FSDP2),
])
def test_moe_key_flag_plan_file_json_echo_and_bad_values(tmp_path, key, value, default, term, lower, bad_flag,
                                                         allowed, extra):
    flag = "--" + key.replace("_", "-")
    base = [*BASE, *extra.get("flags", ())]
    r0 = planner_cli(*base, "--json")
    r = planner_cli(*base, flag, value, "--json")
    assert r0.returncode == 0 and r.returncode == 0, r.stderr
    d0, doc = json.loads(r0.stdout), json.loads(r.stdout)
    assert d0["workload"][key] == default and doc["workload"][key] == value
    assert doc["inputs"]["workload"] == doc["workload"]
    a, b = doc["predicted"][term[0]][term[1]], d0["predicted"][term[0]][term[1]]
    assert (a < b) if lower else (a > b), (a, b)
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"model": "qwen3-30b-a3b", "hardware": "h100-sxm",
                                 "plan": {"dp_shard": 16, "ep": 16, "microbatch": 1, "ac": "none", "compile": True,
                                          **extra.get("plan", {})},
                                 "workload": {"seq_len": 4096, "global_batch": 1024, "state_layout": "megatron",
                                              "zero": 1, key: value, **extra.get("workload", {})}}))
    r2 = planner_cli("estimate", "--plan", str(f), "--json")
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["predicted"] == doc["predicted"]
    bad = planner_cli(*base, flag, bad_flag)             # argparse's choices: usage and the error
    assert bad.returncode == 2 and f"{flag}: invalid choice: '{bad_flag}'" in bad.stderr
    assert_plan_file_value_refused(tmp_path, key, "yes", allowed)


def test_default_titan_run_workload_sends_every_copy():
    """What titan-run runs (fsdp2, auto) is what it is charged: DeepSeek-V3's node-limited routing does not
    make its all-to-all cheaper there."""
    wl = _wl(layout="fsdp2")
    plan = Plan(dp_shard=64, ep=64, microbatch=1, n_microbatches=16, ac="full", runnable=False)
    t = CandidateTable.from_plans([plan])
    auto = step_time_breakdown(t, DSV3, H100, wl, Coefficients())["ep_comm"][0]
    every = step_time_breakdown(t, DSV3, H100, dataclasses.replace(wl, ep_dispatch="every_copy"),
                                Coefficients())["ep_comm"][0]
    once = step_time_breakdown(t, DSV3, H100, dataclasses.replace(wl, ep_dispatch="per_node"),
                               Coefficients())["ep_comm"][0]
    assert auto == every and once < 0.5 * every


def test_regrouping_by_local_expert_costs_memory_traffic_only_where_it_happens():
    """A rank holding several experts regroups what the every-copy all-to-all hands it (grouped by source rank)
    by local expert and back (titan-run's ExpertParallelExperts, TorchTitan, Megatron's alltoall dispatcher):
    top_k x 4 x 2 bytes x dim per token each way, backward twice the forward.  The per-node dispatch
    permutes once after the dispatch (no extra pass), and a rank with one expert has nothing to regroup."""
    from cost_models.compute import Rates, ep_regroup_bytes
    per_tok = QWEN.top_k * 4 * 2 * QWEN.dim
    t = CandidateTable.from_plans([Plan(dp_shard=d, ep=e, microbatch=1, n_microbatches=1, ac="none", runnable=False)
                                   for d, e in ((16, 16), (128, 128))])
    assert list(ep_regroup_bytes(t, QWEN, _wl("every_copy"), True)) == [per_tok, 0.0]      # 8 experts / 1 per rank
    assert list(ep_regroup_bytes(t, QWEN, _wl("per_node"), True)) == [0.0, 0.0]
    assert list(ep_regroup_bytes(t, QWEN, _wl("every_copy"), False)) == [0.0, 0.0]          # a dense block
    # in the step: forward once, backward twice, per MoE block, on the memory-bound rate
    one = CandidateTable.from_plans([Plan(dp_shard=16, ep=16, microbatch=1, n_microbatches=1, ac="none",
                                          runnable=False)])
    comp = {d: float(step_time_breakdown(one, QWEN, H100, _wl(d), Coefficients())["compute"][0])
            for d in ("every_copy", "per_node")}
    n_moe = float(layer_mix(one, QWEN)[1][0])
    want = 3 * n_moe * 4096 * per_tok / Rates(H100, _wl(), Coefficients()).mem
    assert comp["every_copy"] - comp["per_node"] == pytest.approx(want, rel=0.02)
