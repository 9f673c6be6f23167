"""`--framework`: the workload keys and overlaps another framework's runs use (cost_models/frameworks.py),
the same table the validator maps published rows through."""
from __future__ import annotations

import json

import pytest
import yaml

from cost_models.frameworks import ALIASES, FRAMEWORKS, get_framework
from cost_models.specs import SpecError
from cost_models.workload import Workload
from tests.cost_model_helpers import load_bench, planner_cli

vr = load_bench("validate_reference")



@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_every_regime_is_a_valid_workload(name):
    fw = FRAMEWORKS[name]
    wl = Workload(seq_len=8, global_batch=1, **fw.workload)
    assert all(getattr(wl, k) == v for k, v in fw.workload.items())
    assert fw.describes and (fw.why or name == "titan-run")


def test_aliases_and_unknown_names():
    assert all(get_framework(a) is FRAMEWORKS[b] for a, b in ALIASES.items())
    # names as written by hand: case, spaces and underscores aside
    for spelled, name in [("Megatron-LM", "megatron-lm"), ("megatron_lm", "megatron-lm"), ("NeMo", "megatron-bridge"),
                          ("Megatron-Core", "megatron-lm"), ("TorchTitan", "torchtitan"), (" titan_run ", "titan-run")]:
        assert get_framework(spelled) is FRAMEWORKS[name], spelled
    with pytest.raises(SpecError, match=r"framework 'megatronlm2' is not known \(did you mean 'megatron-lm'\?\)"):
        get_framework("megatronlm2")
    r = planner_cli("estimate", "--model", "llama3-8b", "--gpus", "8", "--hardware", "h100-sxm", "--framework", "deepspeed")
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "megatron-deepspeed" in err, err


MBRIDGE_70B = ["estimate", "--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm", "--seq-len", "8192",
               "--global-batch", "128", "--tp", "4", "--pp", "8", "--dp-shard", "2", "--microbatch", "1",
               "--schedule", "Interleaved1F1B", "--stages-per-rank", "5", "--ac", "none", "--compile", "--float8"]


def test_the_flag_gives_what_the_validator_scores():
    """A Megatron-Bridge row of the shared set, through the public CLI with --framework, gets the
    validator's prediction (the validator maps its rows through the same table)."""
    r = planner_cli(*MBRIDGE_70B, "--framework", "megatron-bridge", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["inputs"]["framework"] == "megatron-bridge"
    assert all(doc["workload"][k] == v for k, v in FRAMEWORKS["megatron-bridge"].workload.items())
    if not (vr.reference_dir() / "published_runs.yaml").is_file():
        pytest.skip("shared reference data not found (set TITAN_REFERENCE_DIR)")
    row = next(r for r in vr.load_rows() if r["id"] == "mbridge_25.11_Llama3_70B_64gpu")
    case = vr.build_case(row)
    assert case.plan.describe() == vr.Plan.from_dict(doc["plan"], runnable=False).describe()
    assert doc["predicted"]["tokens_per_s_per_gpu"] == pytest.approx(vr.predict(case)["tokens_per_s_per_gpu"],
                                                                     rel=1e-5)   # --json rounds to 0.01


def test_the_regime_is_the_flags_it_stands_for(tmp_path):
    """--framework X = its workload flags (its overlaps included); an explicit flag wins."""
    explicit = planner_cli(*MBRIDGE_70B, "--state-layout", "megatron", "--zero", "1", "--selective-ac", "attention",
                    "--grad-dtype", "bf16", "--loss-impl", "fused", "--tp-comm-overlap", "full", "--json")
    via = planner_cli(*MBRIDGE_70B, "--framework", "megatron-bridge", "--json")
    assert explicit.returncode == 0 and via.returncode == 0, (explicit.stderr, via.stderr)
    assert json.loads(explicit.stdout)["predicted"] == json.loads(via.stdout)["predicted"]
    over = planner_cli(*MBRIDGE_70B, "--framework", "megatron-bridge", "--grad-dtype", "fp32", "--tp-comm-overlap",
                       "none", "--json")
    doc = json.loads(over.stdout)
    assert doc["workload"]["grad_dtype"] == "fp32" and doc["workload"]["tp_comm_overlap"] == "none"
    assert doc["predicted"]["time_s"]["tp_comm"] > json.loads(via.stdout)["predicted"]["time_s"]["tp_comm"]
    plain = planner_cli(*MBRIDGE_70B, "--json")
    assert json.loads(plain.stdout)["inputs"]["framework"] == "titan-run"
    assert json.loads(plain.stdout)["predicted"] != json.loads(via.stdout)["predicted"]


def test_a_plan_file_remembers_the_framework(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-8b", "hardware": "h100-sxm",
                                 "plan": {"dp_shard": 8, "microbatch": 1, "ac": "full"},
                                 "workload": {"seq_len": 4096, "global_batch": 64},
                                 "inputs": {"framework": "megatron-deepspeed"}}))
    r = planner_cli("estimate", "--plan", str(f), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["inputs"]["framework"] == "megatron-deepspeed"
    assert doc["workload"]["grad_accum"] == "hp_copy" and doc["workload"]["attention_impl"] == "materialized"


def test_an_unstated_gradient_dtype_is_not_a_verdict_on_the_heavier_one():
    """The megatron layout with grad_dtype not given: Megatron-Bridge's Llama 3 70B layout (trained, 64 H100), in
    bf16, does not fit with Megatron-LM's fp32 main gradients and fits with bf16 ones (the recipe's), so the estimate
    takes bf16 and says so; the same layout with either dtype stated is that dtype's figures, without a note.
    A layout that fits with fp32 keeps fp32 without a note."""
    args = [*MBRIDGE_70B, "--no-float8", "--state-layout", "megatron", "--zero", "1", "--selective-ac", "attention"]
    auto, fp32, bf16 = (json.loads(planner_cli(*args, *extra, "--json").stdout)
                        for extra in ((), ("--grad-dtype", "fp32"), ("--grad-dtype", "bf16")))
    assert fp32["predicted"]["headroom_gib"] < 0 <= bf16["predicted"]["headroom_gib"], "the test needs that layout"
    assert auto["workload"]["grad_dtype"] == "bf16" and auto["predicted"] == bf16["predicted"]
    def dtype_notes(doc):
        return [n for n in doc["knob_notes"] if n.startswith("grad_dtype")]
    assert dtype_notes(auto)[0].startswith("grad_dtype not given: 'bf16', fp32 main gradients do not fit")
    assert dtype_notes(fp32) == dtype_notes(bf16) == [] and fp32["remedies"] is not None
    assert fp32["predicted"]["memory_gib"]["grads"] == pytest.approx(2 * bf16["predicted"]["memory_gib"]["grads"],
                                                                      rel=1e-3)
    roomy = [a if a != "64" else "128" for a in args]     # dp_shard 4: the optimizer shard halves
    small = json.loads(planner_cli(*roomy, "--dp-shard", "4", "--json").stdout)
    assert small["workload"]["grad_dtype"] == "auto" and dtype_notes(small) == []    # as asked: fp32
    assert small["predicted"]["headroom_gib"] >= 0
    # a regime states its dtype: Megatron-LM's fp32 is a verdict, not a default
    lm = json.loads(planner_cli(*args, "--framework", "megatron-lm", "--json").stdout)
    assert lm["workload"]["grad_dtype"] == "fp32" and lm["predicted"] == fp32["predicted"]


# BLOOM 176B's final layout (tr11-176B-ml.slurm): 384 A100 80GB, TP 4, PP 12, DP 8, micro-batch 2, global batch 2048
BLOOM_176B = ["estimate", "--model", "bloom-176b", "--gpus", "384", "--hardware", "a100-80g", "--seq-len", "2048",
              "--global-batch", "2048", "--tp", "4", "--pp", "12", "--dp-shard", "8", "--microbatch", "2"]


def test_a_regime_without_selective_recompute_is_not_given_it(tmp_path):
    """Without --ac, `estimate` compares only the recompute settings the regime's code has (Megatron-DeepSpeed
    of 2021-22: whole layers or none), and says so; a stated --ac it lacks is predicted, with a note."""
    assert FRAMEWORKS["megatron-deepspeed"].ac_choices == ("none", "full")
    model = tmp_path / "bloom.yaml"
    model.write_text(yaml.safe_dump({"name": "bloom-176b", "n_layers": 70, "dim": 14336, "n_heads": 112,
                                     "ffn_hidden": 57344, "vocab_size": 250880, "mlp": "gelu", "norm": "layernorm",
                                     "tie_embeddings": True}))
    q = [*BLOOM_176B]
    q[q.index("bloom-176b")] = str(model)
    chosen = planner_cli(*q, "--framework", "megatron-deepspeed", "--json")
    assert chosen.returncode == 0, chosen.stderr
    doc = json.loads(chosen.stdout)
    assert doc["plan"]["ac"] in ("none", "full")
    assert doc["ac_note"].endswith("; megatron-deepspeed has no selective recompute"), doc["ac_note"]
    assert "selective" not in doc["ac_note"].split(";")[0]
    asked = planner_cli(*q, "--framework", "megatron-deepspeed", "--ac", "selective", "--json")
    assert asked.returncode == 0, asked.stderr
    doc = json.loads(asked.stdout)
    assert doc["plan"]["ac"] == "selective" and doc["ac_note"] is None
    assert "megatron-deepspeed has no selective recompute; predicted as asked (--ac selective)" in doc["knob_notes"]
    # titan-run has all three (its own sync and TP regime stated, so that one workload's plans are compared)
    own = json.loads(planner_cli(*q, "--pp-grad-sync", "last_microbatch", "--tp-activations", "gathered",
                                 "--json").stdout)
    assert "selective" in own["ac_note"]


def test_megatron_regimes_predict_their_fused_kernels_without_compile_flags():
    """A Megatron-state regime's hand-fused kernels are predicted as a compiled plan when the question does not
    say --compile / --no-compile (the validator's rule for its rows), with a note; an explicit flag wins."""
    base = [a for a in MBRIDGE_70B if a != "--compile"]
    stated = json.loads(planner_cli(*MBRIDGE_70B, "--framework", "megatron-bridge", "--json").stdout)
    implied = json.loads(planner_cli(*base, "--framework", "megatron-bridge", "--json").stdout)
    eager = json.loads(planner_cli(*base, "--no-compile", "--framework", "megatron-bridge", "--json").stdout)
    assert implied["plan"]["compile"] is True and eager["plan"]["compile"] is False
    assert implied["predicted"] == stated["predicted"]
    assert eager["predicted"]["step_time_s"] > implied["predicted"]["step_time_s"]
    assert implied["knob_notes"][0].startswith("compile not given: on, for megatron-bridge's fused kernels")
    assert not any(n.startswith("compile") for n in stated["knob_notes"] + eager["knob_notes"])
    # FSDP stacks keep the question's (default: eager) kernels
    fsdp = json.loads(planner_cli(*base, "--framework", "torchtitan", "--json").stdout)
    assert fsdp["plan"]["compile"] is False
    assert {n for n, f in FRAMEWORKS.items() if f.fused_kernels} == {
        "megatron-lm", "megatron-2022", "megatron-bridge", "megatron-deepspeed", "deepseek-hai-llm"}


def test_deepseeks_regime_recomputes_the_reports_modules():
    """HAI-LLM's selective recompute is the DeepSeek-V3 report's list (RMSNorm, MLA up-projections, the SwiGLU
    output), so the report's layout (2,048 H800, PP 16, EP 64) asked without --ac takes it: it fits where Megatron's
    core-attention recompute does not."""
    fw = FRAMEWORKS["deepseek-hai-llm"]
    assert fw.workload["selective_ac"] == "modules"
    assert fw.workload["recompute_modules"] == ("layernorm", "mla_up_proj", "moe_act")
    q = ["estimate", "--model", "deepseek-v3-671b", "--hardware", "h800", "--gpus", "2048", "--pp", "16", "--ep", "64",
         "--seq-len", "4096", "--global-batch", "15360", "--json"]
    doc = json.loads(planner_cli(*q, "--framework", "deepseek-hai-llm").stdout)
    assert doc["plan"]["ac"] == "selective" and doc["predicted"]["peak_memory_gib"] < 78.6
    assert doc["workload"]["recompute_modules"] == ["layernorm", "mla_up_proj", "moe_act"]
    # core attention alone leaves the layout over the device: Megatron-LM's question climbs its module sets
    # (planner.whatif.recompute_module_ladder), and stated as the attention core it takes full recompute
    lm = json.loads(planner_cli(*q, "--framework", "megatron-lm", "--state-layout", "megatron").stdout)
    assert lm["plan"]["ac"] == "selective" and lm["workload"]["recompute_modules"] != ["core_attn"]
    assert any(n.startswith("recompute-modules not given") for n in lm["knob_notes"])
    core = json.loads(planner_cli(*q, "--framework", "megatron-lm", "--selective-ac", "attention").stdout)
    assert core["plan"]["ac"] == "full"


def test_plan_defaults_fill_only_what_is_left_out():
    """`Framework.plan_defaults`: the regime's plan keys where the question gives none, a schedule only with a
    pipeline, the Llama 3 paper's one-unit chunks only where a rank gets two or more (else no interleaving)."""
    meta, tt, lm = FRAMEWORKS["llama3-meta"], FRAMEWORKS["torchtitan"], FRAMEWORKS["megatron-lm"]
    assert meta.plan_defaults({"pp": 16}, 126) == {"reshard_after_forward": False, "schedule": "Interleaved1F1B",
                                                   "stages_per_rank": 8}
    assert meta.plan_defaults({"pp": 1}, 126) == {"reshard_after_forward": False}
    assert meta.plan_defaults({"pp": 128}, 126) == {"reshard_after_forward": False}      # < 2 units a rank
    assert meta.plan_defaults({"pp": 16, "schedule": "1F1B", "reshard_after_forward": True}, 126) == {}
    assert meta.plan_defaults({"pp": 16, "schedule": "Interleaved1F1B"}, 126) == {"reshard_after_forward": False,
                                                                                    "stages_per_rank": 8}
    assert tt.plan_defaults({"pp": 1}, 32) == {"reshard_after_forward": True}
    assert tt.plan_defaults({"pp": 4}, 32) == {"reshard_after_forward": False}
    assert lm.plan_defaults({}, 32) == {"compile": True}
    assert lm.plan_defaults({"compile": False}, 32) == {}
    assert FRAMEWORKS["titan-run"].plan_defaults({"pp": 8}, 32) == {}


def test_a_megatron_state_layout_without_a_framework_is_read_as_megatron_lm(tmp_path):
    """titan-run holds fsdp2 state only, so a question with the megatron layout and no --framework describes a
    Megatron stack: the estimate reads it as --framework megatron-lm (its fused kernels as compile, its selective
    recompute, ZeRO-1), leaving the main gradients' dtype to its fp32 / bf16 comparison, and says so; a stated
    framework, and the fsdp2 layout, are read as before."""
    args = [*MBRIDGE_70B, "--no-float8", "--state-layout", "megatron", "--ac", "selective"]
    implied = json.loads(planner_cli(*args, "--json").stdout)
    lm = json.loads(planner_cli(*args, "--framework", "megatron-lm", "--grad-dtype",
                                implied["workload"]["grad_dtype"], "--json").stdout)
    assert implied["inputs"]["framework"] == "megatron-lm" and implied["predicted"] == lm["predicted"]
    assert implied["knob_notes"][0].startswith("framework not given: 'megatron-lm', the stack a megatron state")
    assert implied["workload"]["zero"] == 1 and implied["workload"]["selective_ac"] in ("attention", "modules")
    assert (implied["workload"]["selective_ac"], implied["workload"]["recompute_modules"]) == \
        (lm["workload"]["selective_ac"], lm["workload"]["recompute_modules"])      # Megatron's, as asked of it
    assert implied["plan"]["compile"] is True
    assert not [n for n in lm["knob_notes"] if n.startswith("framework")]
    own = json.loads(planner_cli(*args, "--framework", "titan-run", "--json").stdout)
    assert own["inputs"]["framework"] == "titan-run" and own["workload"]["selective_ac"] == "auto"
    fsdp2 = json.loads(planner_cli(*MBRIDGE_70B, "--json").stdout)
    assert fsdp2["inputs"]["framework"] == "titan-run"
    # a plan file's layout implies it too, and the search says so
    f = tmp_path / "q.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-8b", "hardware": "h100-sxm", "plan": {"dp_shard": 16},
                                 "workload": {"seq_len": 2048, "global_batch": 64, "state_layout": "megatron"}}))
    doc = json.loads(planner_cli("estimate", "--plan", str(f), "--json").stdout)
    assert doc["inputs"]["framework"] == "megatron-lm" and doc["knob_notes"][0].startswith("framework not given")
    r = planner_cli("--model", "llama3-8b", "--hardware", "h100-sxm", "--gpus", "16", "--seq-len", "2048",
                    "--global-batch", "64", "--state-layout", "megatron", "--no-write")
    assert r.returncode == 0 and "note: framework not given: 'megatron-lm'" in r.stdout, r.stderr


def test_a_partial_zero_stage_without_a_layout_is_the_megatron_layout():
    """ZeRO-0/1/2 exist in the megatron state layout only (fsdp2 shards everything, ZeRO-3): --zero 1 without
    --state-layout and --framework is read as the megatron layout under megatron-lm's regime, the same prediction,
    with a note that says both; --zero 3 leaves titan-run's fsdp2; a partial stage with an fsdp2 layout, stated or
    a framework's, is refused in one line, exit 2."""
    args = [*MBRIDGE_70B, "--no-float8", "--ac", "selective"]
    by_zero = json.loads(planner_cli(*args, "--zero", "1", "--json").stdout)
    layout = json.loads(planner_cli(*args, "--zero", "1", "--state-layout", "megatron", "--json").stdout)
    assert by_zero["workload"]["state_layout"] == "megatron" and by_zero["inputs"]["framework"] == "megatron-lm"
    assert by_zero["predicted"] == layout["predicted"]
    assert by_zero["knob_notes"][0].startswith("state-layout not given: 'megatron', the layout whose ZeRO stage "
                                               "--zero 1 is")
    assert not layout["knob_notes"][0].startswith("state-layout")
    three = json.loads(planner_cli(*args, "--zero", "3", "--json").stdout)
    assert three["workload"]["state_layout"] == "fsdp2" and three["inputs"]["framework"] == "titan-run"
    for extra in (["--state-layout", "fsdp2"], ["--framework", "torchtitan"]):
        r = planner_cli(*args, "--zero", "1", *extra)
        err = r.stderr.strip()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and "is a megatron state layout's ZeRO stage" in err
