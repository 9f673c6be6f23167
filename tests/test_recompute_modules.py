"""Megatron's selective recompute by submodule (selective_ac: modules + recompute_modules) and the TP
activation regime (tp_activations): what each keeps and recomputes, their flags and plan-file keys, and
titan-run's refusal of the values it does not run."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from cost_models.activations import FULL, SEQ, SHARD, layer_activation_terms
from cost_models.estimate import estimate
from cost_models.flops import attention_dims
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import planner_cli

DSV3 = load_model("deepseek-v3-671b")
H100 = load_hardware("h100-sxm")


def _wl(**kw) -> Workload:
    return Workload(seq_len=4096, global_batch=1024, state_layout="megatron", zero=1, **kw)


def _terms(model, moe, mods, **kw):
    wl = _wl(selective_ac="modules", recompute_modules=mods, **kw)
    return layer_activation_terms(model, wl, moe, "selective", True)


def test_core_attn_alone_is_the_attention_policy():
    for moe in (False, True):
        att = layer_activation_terms(DSV3, _wl(selective_ac="attention"), moe, "selective", True)
        assert np.array_equal(_terms(DSV3, moe, ["core_attn"]), att)


def test_each_module_drops_what_it_recomputes():
    e = 2.0
    base_d, base_m = _terms(DSV3, False, ["core_attn"]), _terms(DSV3, True, ["core_attn"])
    d_qk, d_k, d_v = attention_dims(DSV3)
    up = _terms(DSV3, True, ["core_attn", "mla_up_proj"])
    assert base_m[SHARD] - up[SHARD] == pytest.approx(e * (d_qk + d_k + d_v))      # per-head Q, K and V
    ln = _terms(DSV3, True, ["core_attn", "layernorm"])
    assert base_m[SEQ] - ln[SEQ] == pytest.approx(2 * e * DSV3.dim)               # the two norm outputs
    mlp_dense, mlp_moe = _terms(DSV3, False, ["core_attn", "mlp"]), _terms(DSV3, True, ["core_attn", "mlp"])
    assert np.array_equal(mlp_moe, base_m)                                          # 'mlp' is the dense FFN only
    assert base_d[SHARD] - mlp_dense[SHARD] == pytest.approx(3 * e * DSV3.ffn_hidden)   # gate, up, fc2 input
    act = _terms(DSV3, True, ["core_attn", "moe_act"])
    assert base_m[SHARD] - act[SHARD] == pytest.approx(DSV3.top_k * e * DSV3.moe_ffn_hidden)
    moe = _terms(DSV3, True, ["core_attn", "moe"])
    shared = _terms(DSV3, True, ["core_attn", "shared_experts"])
    assert moe[SHARD] < act[SHARD] and moe[SHARD] < shared[SHARD] < base_m[SHARD]
    # nothing the attention keeps is dropped by the FFN modules
    attn_only = _terms(DSV3, True, ["core_attn", "moe"])
    assert attn_only[SHARD] >= e * (d_qk + d_k + d_v)


def _estimate(plans, model, wl):
    return estimate(CandidateTable.from_plans(plans), model, H100, wl)


def test_recompute_costs_time_and_saves_memory_in_the_estimate():
    plan = Plan(dp_shard=64, pp=8, tp=2, ep=64, microbatch=1, n_microbatches=16, schedule="Interleaved1F1B",
                stages_per_rank=4, ac="selective", compile=True, runnable=False)
    runs = {}
    for mods in (["core_attn"], ["core_attn", "mla_up_proj"], ["core_attn", "moe"]):
        est = _estimate([plan], DSV3, _wl(selective_ac="modules", recompute_modules=mods))
        runs[mods[-1]] = (float(est.step_time_s[0]), float(est.memory["activations"][0]),
                          float(est.time["ep_comm"][0]))
    assert runs["mla_up_proj"][0] > runs["core_attn"][0] and runs["mla_up_proj"][1] < runs["core_attn"][1]
    assert runs["moe"][1] < runs["core_attn"][1]
    assert runs["moe"][2] > runs["core_attn"][2]      # the MoE layer's dispatch and combine run again


def test_tp_activations_sharded_keeps_shards_and_regathers():
    m = load_model("llama3-70b")
    plans = [Plan(dp_shard=16, tp=tp, microbatch=1, n_microbatches=1, ac="none", runnable=False) for tp in (1, 8)]
    plans[0] = dataclasses.replace(plans[0], dp_shard=128)
    wl = lambda v: Workload(seq_len=8192, global_batch=128, tp_activations=v)  # noqa: E731
    g, s = _estimate(plans, m, wl("gathered")), _estimate(plans, m, wl("sharded"))
    assert g.memory["activations"][0] == s.memory["activations"][0]            # tp 1: nothing is gathered
    assert s.memory["activations"][1] < g.memory["activations"][1]
    assert s.time["tp_comm"][1] > g.time["tp_comm"][1]                         # the backward re-gathers
    t_g = layer_activation_terms(m, wl("gathered"), False, "none", False)
    t_s = layer_activation_terms(m, wl("sharded"), False, "none", False)
    assert t_g[FULL] > 0 and t_s[FULL] == 0 and t_s[SEQ] - t_g[SEQ] == pytest.approx(t_g[FULL])
    # auto follows the layout: megatron keeps shards, fsdp2 gathered inputs
    assert not Workload(seq_len=8, global_batch=1, state_layout="megatron").tp_keeps_gathered
    assert Workload(seq_len=8, global_batch=1).tp_keeps_gathered



BASE = ["estimate", "--model", "deepseek-v3-671b", "--gpus", "1024", "--hardware", "h100-sxm", "--seq-len", "4096",
        "--global-batch", "8192", "--tp", "2", "--pp", "8", "--ep", "64", "--ac", "selective", "--state-layout",
        "megatron", "--zero", "1", "--compile"]


def test_flags_plan_file_and_json_echo(tmp_path):
    r = planner_cli(*BASE, "--selective-ac", "modules", "--recompute-modules", "mla_up_proj,mlp",
             "--tp-activations", "gathered", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["workload"]["recompute_modules"] == ["mla_up_proj", "mlp"]
    assert doc["workload"]["tp_activations"] == "gathered" and doc["inputs"]["workload"] == doc["workload"]
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"model": "deepseek-v3-671b", "hardware": "h100-sxm",
                                 "plan": {"dp_shard": 64, "pp": 8, "tp": 2, "ep": 64, "ac": "selective",
                                          "compile": True},
                                 "workload": {"seq_len": 4096, "global_batch": 8192, "state_layout": "megatron",
                                              "zero": 1, "selective_ac": "modules",
                                              "recompute_modules": ["mla_up_proj", "mlp"],
                                              "tp_activations": "gathered"}}))
    r2 = planner_cli("estimate", "--plan", str(f), "--json")
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["predicted"] == doc["predicted"]


def test_recompute_modules_alone_imply_the_modules_policy():
    """--recompute-modules without --selective-ac is Megatron-LM's own spelling of a module list: it implies
    --selective-ac modules (the same prediction as saying both); a stated other policy with a list is refused."""
    docs = []
    for extra in ([], ["--selective-ac", "modules"]):
        r = planner_cli(*BASE, "--recompute-modules", "mlp", *extra, "--json")
        assert r.returncode == 0, r.stderr
        docs.append(json.loads(r.stdout))
    assert docs[0]["workload"]["selective_ac"] == "modules" and docs[0]["workload"]["recompute_modules"] == ["mlp"]
    assert docs[0]["predicted"] == docs[1]["predicted"]


@pytest.mark.parametrize("args,message", [
    (["--selective-ac", "attention", "--recompute-modules", "mlp"],
     "the list is read only with selective_ac 'modules'"),
    (["--selective-ac", "modules", "--recompute-modules", "mlp,atn"], "got 'atn'"),
])
def test_bad_values_are_one_line_exit_2(args, message):
    r = planner_cli(*BASE, *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = planner_cli(*BASE, "--tp-activations", "half")        # argparse's choices: usage and the error, exit 2
    assert r.returncode == 2 and "--tp-activations: invalid choice: 'half'" in r.stderr


@pytest.mark.parametrize("key,value", [("selective_ac", "modules"), ("selective_ac", "attention"),
                                       ("norm_impl", "fused")])
def test_titan_run_refuses_what_it_does_not_run(tmp_path, key, value):
    from executor.config import ConfigError, load_run_config
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-debug", "plan": {"dp_shard": 2, "microbatch": 2},
                                 "workload": {"seq_len": 64, "global_batch": 4, key: value}}))
    with pytest.raises(ConfigError) as ei:
        load_run_config(str(f), [], world_size=2)
    assert f"workload key '{key}'" in str(ei.value) and "\n" not in str(ei.value)


@pytest.mark.parametrize("policy", ["auto", "matmul", "op"])
def test_titan_run_runs_its_selective_policies(tmp_path, policy):
    """titan-run's own selective checkpointing: every matmul output kept (auto, matmul) or TorchTitan's per-op
    policy (op; executor/parallel/activation_checkpoint.py, tests/test_selective_ac.py)."""
    cfg = _run_config(tmp_path, {"dp_shard": 2, "microbatch": 2, "ac": "selective"}, selective_ac=policy)
    assert cfg.workload.selective_policy == ("matmul" if policy == "auto" else policy)


def _run_config(tmp_path, plan: dict, **workload):
    from executor.config import load_run_config
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-debug", "plan": plan,
                                 "workload": {"seq_len": 64, "global_batch": 4, **workload}}))
    return load_run_config(str(f), [], world_size=2)


@pytest.mark.parametrize("plan,allowed", [
    ({"tp": 2, "microbatch": 4, "backend": "dtensor"}, "on backend spmd_types only"),
    ({"tp": 2, "microbatch": 4, "compile": True}, "in eager mode only"),
    ({"tp": 2, "microbatch": 4, "ac": "selective"}, "with ac none or full"),
])
def test_titan_run_keeps_sequence_shards_on_spmd_types_eager_without_selective_ac(tmp_path, plan, allowed):
    # tests/distributed/test_spmd_tp_sharded.py runs it (exactly the gathered run's losses, fewer saved bytes)
    from executor.config import ConfigError
    with pytest.raises(ConfigError) as ei:
        _run_config(tmp_path, plan, tp_activations="sharded")
    msg = str(ei.value)
    assert msg.startswith("workload key 'tp_activations' is 'sharded' with ") and allowed in msg and "\n" not in msg
    for ok in ({"tp": 2, "microbatch": 4}, {"tp": 2, "microbatch": 4, "ac": "full"},
               {"dp_shard": 2, "microbatch": 2, "backend": "dtensor"}):      # tp 1: nothing gathered
        assert _run_config(tmp_path, ok, tp_activations="sharded").workload.tp_keeps_gathered is False
    assert _run_config(tmp_path, plan, tp_activations="gathered").workload.tp_keeps_gathered   # and auto, as today
    assert _run_config(tmp_path, plan).workload.tp_keeps_gathered


def test_norm_impl_fused_keeps_the_input_only():
    m = load_model("llama3-8b")
    kw = dict(seq_len=4096, global_batch=8)
    eager = layer_activation_terms(m, Workload(norm_impl="eager", **kw), False, "none", False)
    fused = layer_activation_terms(m, Workload(norm_impl="fused", **kw), False, "none", False)
    assert eager[SEQ] - fused[SEQ] == pytest.approx(2 * (3 - 1) * 2.0 * m.dim)   # two norms: 3x -> 1x the width
    # auto, eager: titan-run's RMSNorm keeps the input and a per-token fp32 rstd
    auto = layer_activation_terms(m, Workload(**kw), False, "none", False)
    assert auto[SEQ] - fused[SEQ] == 2 * 4.0
    assert np.array_equal(layer_activation_terms(m, Workload(**kw), False, "none", True), layer_activation_terms(
        m, Workload(norm_impl="fused", **kw), False, "none", True))                 # auto: fused when compiled
    # composite (PyTorch's nn.RMSNorm, TorchTitan's): eager's bytes uncompiled, fused's compiled
    for compiled, same in ((False, eager), (True, layer_activation_terms(m, Workload(norm_impl="fused", **kw),
                                                                         False, "none", True))):
        assert np.array_equal(layer_activation_terms(m, Workload(norm_impl="composite", **kw), False, "none",
                                                     compiled), same)
    plan = Plan(dp_shard=8, microbatch=2, n_microbatches=1, ac="none", runnable=False)
    e = _estimate([plan], m, Workload(norm_impl="eager", **kw))
    f = _estimate([plan], m, Workload(norm_impl="fused", **kw))
    assert f.memory["activations"][0] < e.memory["activations"][0]


LADDER_Q = ["estimate", "--model", "deepseek-v3-671b", "--gpus", "1024", "--hardware", "h100-sxm", "--seq-len", "4096",
            "--global-batch", "8192", "--tp", "2", "--pp", "8", "--ep", "64", "--schedule", "Interleaved1F1B",
            "--stages-per-rank", "4", "--framework", "megatron-bridge", "--json"]


def test_unstated_recompute_climbs_megatron_modules_where_the_attention_core_alone_does_not_fit():
    """A megatron question that states no recompute, whose attention-core recompute does not fit (DeepSeek-V3 on
    1,024 H100, Megatron-Bridge's layout): the estimate also tries Megatron-core's module sets (norms, MoE
    activation, MLA up projections; then dense FFNs and shared experts; then whole MoE layers) and keeps the
    fastest that fits, saying so -- the same figures as stating that set; stated modules, or recompute stated as
    the attention core, are kept as asked."""
    from planner.whatif import recompute_module_ladder
    from cost_models.specs import load_model
    ladder = recompute_module_ladder(load_model("deepseek-v3-671b"))
    assert ladder[0] == ("core_attn", "layernorm", "moe_act", "mla_up_proj") and ladder[-1][-1] == "moe"
    assert all(set(a) < set(b) for a, b in zip(ladder, ladder[1:]))
    assert recompute_module_ladder(load_model("llama3-8b")) == [("core_attn", "layernorm"),
                                                                ("core_attn", "layernorm", "mlp")]
    r = planner_cli(*LADDER_Q)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    chosen = doc["workload"]["recompute_modules"]
    assert doc["plan"]["ac"] == "selective" and doc["workload"]["selective_ac"] == "modules" and chosen != ["core_attn"]
    note = next(n for n in doc["knob_notes"] if n.startswith("recompute-modules not given"))
    assert f"'{'+'.join(chosen)}'" in note and "core_attn: " in note and "the fastest setting that fits" in note
    stated = json.loads(planner_cli(*LADDER_Q, "--ac", "selective", "--selective-ac", "modules",
                                    "--recompute-modules", ",".join(chosen)).stdout)
    assert stated["predicted"] == doc["predicted"]
    assert not [n for n in stated["knob_notes"] if n.startswith("recompute-modules")]
    core = json.loads(planner_cli(*LADDER_Q, "--selective-ac", "attention").stdout)
    assert core["workload"]["recompute_modules"] == ["core_attn"] and core["plan"]["ac"] == "full"


def test_unstated_recompute_climbs_under_each_main_gradient_dtype_too():
    """A bf16 megatron question with neither the main gradients' dtype nor the recompute stated (--zero 1 alone:
    Megatron-LM implied, DeepSeek-V3's report layout on 2,048 H800 with DualPipe): the module ladder is tried under
    fp32 main gradients, then bf16, and the fastest setting that fits under the first dtype where one fits is
    kept -- the layout trained, so it must fit -- with the ladder's note; the dtype stays as asked (auto) when fp32
    is kept, and a stated dtype gives the same figures."""
    q = ["estimate", "--model", "deepseek-v3", "--gpus", "2048", "--hardware", "h800", "--pp", "16", "--ep", "64",
         "--schedule", "DualPipe", "--fp8", "--seq-len", "4096", "--global-batch", "15360", "--zero", "1",
         "--ac", "selective", "--json"]
    doc = json.loads(planner_cli(*q).stdout)
    assert doc["predicted"]["headroom_gib"] >= 0
    assert doc["workload"]["selective_ac"] == "modules" and doc["workload"]["grad_dtype"] == "auto"
    assert any(n.startswith("recompute-modules not given") for n in doc["knob_notes"])
    stated = json.loads(planner_cli(*q, "--grad-dtype", "fp32").stdout)
    assert stated["predicted"] == doc["predicted"] and stated["workload"]["recompute_modules"] == \
        doc["workload"]["recompute_modules"]
