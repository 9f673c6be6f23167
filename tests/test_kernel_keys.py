"""Workload keys ``swiglu_impl`` / ``gqa_kv``: the SwiGLU kernel and how attention takes grouped-query K/V, by
flag and plan file (both were tied to ``state_layout`` before: fsdp2 = titan-run's eager SwiGLU and expanded
K/V, megatron = fused SwiGLU and native K/V; ``gqa_kv: auto`` is now native for both, titan-run passing GQA
K/V to SDPA with enable_gqa, and TorchTitan's regime states ``expanded``).  What each keeps is counted on the executor model's own saved
tensors in tests/test_memory.py; here, the keys on a flagship layout and through the CLI."""
from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from cost_models.coefficients import Coefficients
from cost_models.estimate import GIB, estimate
from cost_models.specs import SpecError, load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import assert_titan_run_refuses, planner_cli

H100 = load_hardware("h100-sxm")
L405 = load_model("llama3-405b")
# the Llama 3 paper's 405B layout at 8K (arXiv:2407.21783 Table 4): TP 8, PP 16, DP 128, no recompute
PLAN = Plan(tp=8, pp=16, dp_shard=128, microbatch=1, n_microbatches=16, schedule="Interleaved1F1B",
            stages_per_rank=2, ac="none", runnable=False)
ESTIMATE = ["estimate", "--model", "llama3-405b", "--gpus", "16384", "--hardware", "h100-sxm", "--seq-len", "8192",
            "--global-batch", "2048", "--tp", "8", "--pp", "16", "--schedule", "Interleaved1F1B", "--stages-per-rank", "2",
            "--ac", "none", "--reshard", "--tp-activations", "gathered",
            "--pp-grad-sync", "last_microbatch", "--json"]


def _activations(**kw) -> float:
    wl = Workload(seq_len=8192, global_batch=2048, **kw)
    return float(estimate(CandidateTable.from_plans([PLAN]), L405, H100, wl, Coefficients()).memory["activations"][0])


def test_each_key_removes_what_it_names_on_the_405b_layout():
    """Per layer and micro-batch on a TP 8 rank (8,192 tokens, bf16): native K/V saves (128 - 8) x 128 x 2 (K
    and V) / 8 x 2 bytes per token less; a fused SwiGLU one ffn-width tensor (53,248 / 8 x 2 bytes) less.  The
    ratio of the two savings does not depend on the in-flight count."""
    base = _activations(gqa_kv="expanded", swiglu_impl="eager")
    # auto: native K/V, and on these eager blocks without recompute titan-run's rebuilt FFN input (fused_ffn)
    assert _activations() == _activations(gqa_kv="native", swiglu_impl="fused_ffn")
    gqa = base - _activations(gqa_kv="native", swiglu_impl="eager")
    swiglu = base - _activations(gqa_kv="expanded", swiglu_impl="fused")
    per_tok_gqa = 2 * (L405.n_heads - L405.n_kv_heads) * L405.head_dim / 8 * 2
    per_tok_swiglu = L405.ffn_hidden / 8 * 2
    assert gqa > 0 and swiglu > 0
    assert gqa / swiglu == pytest.approx(per_tok_gqa / per_tok_swiglu, rel=1e-9)
    both = base - _activations(gqa_kv="native", swiglu_impl="fused")
    assert both == pytest.approx(gqa + swiglu, rel=1e-9)
    # the megatron layout's defaults are these two kernels too: stating the expanded, eager ones restores the
    # fsdp2 figure of the same terms (the layout's other regimes -- TP shards, Megatron's loss -- are held fixed)
    meg = dict(state_layout="megatron", zero=1, tp_activations="gathered", pp_sent_tensors="released", loss_impl="eager",
               moe_weighting="combine", grad_accum="autograd")
    assert _activations(**meg) == pytest.approx(base - gqa - swiglu, rel=1e-9)
    assert _activations(**meg, gqa_kv="expanded", swiglu_impl="eager") == pytest.approx(base, rel=1e-9)


def test_fused_ffn_keeps_gate_and_up_only():
    """swiglu_impl fused_ffn (xformers' SwiGLU op: the whole FFN one function, the product rebuilt in backward)
    keeps one ffn-width tensor less than the 3-tensor fused kernel and two less than eager autograd, per layer
    and micro-batch; under compile the eager FFN keeps what the partitioner keeps, gate, up and the product (fc2's
    weight gradient materializes it in backward, so it is never recomputed), as the fused kernel does, and
    fused_ffn still one tensor less.  titan-run's own FFN (auto) keeps what fused_ffn keeps on eager blocks
    without recompute (its down projection's input rebuilt: executor/models/layers.py ``rebuilt_input``) and
    what the fused kernel keeps where the blocks are compiled."""
    eager = _activations(swiglu_impl="eager")
    fused = _activations(swiglu_impl="fused")
    ffn = _activations(swiglu_impl="fused_ffn")
    # per in-flight micro-batch one ffn-width tensor less kept; the backward makes the product again, one
    # ffn-width tensor of one micro-batch more in its working set (2 bytes x 53,248 / 8 x 8,192 tokens)
    rebuilt = 2 * L405.ffn_hidden / 8 * 8192
    assert eager - fused == pytest.approx(fused - ffn + rebuilt, rel=1e-9) and fused - ffn > 0
    assert _activations() == ffn
    compiled = dataclasses.replace(PLAN, compile=True)
    act = lambda **kw: float(estimate(CandidateTable.from_plans([compiled]), L405, H100,
                                      Workload(seq_len=8192, global_batch=2048, **kw),
                                      Coefficients()).memory["activations"][0])
    assert act(swiglu_impl="fused") == pytest.approx(act(swiglu_impl="eager"), rel=1e-12)
    assert act(swiglu_impl="fused") > act(swiglu_impl="fused_ffn")
    assert act() == act(swiglu_impl="fused")
    wl = Workload(seq_len=64, global_batch=4, swiglu_impl="fused_ffn")
    assert wl.swiglu_fused and wl.swiglu_recomputes_product
    assert not Workload(seq_len=64, global_batch=4, swiglu_impl="fused").swiglu_recomputes_product


def test_gqa_kv_does_nothing_without_grouped_query_attention():
    m = load_model("llama3-debug")
    m = dataclasses.replace(m, name="mha-debug", n_kv_heads=m.n_heads)
    plan = Plan(microbatch=2)
    got = [float(estimate(CandidateTable.from_plans([plan]), m, H100,
                          Workload(seq_len=256, global_batch=2, gqa_kv=v), Coefficients()).memory["activations"][0])
           for v in ("expanded", "native")]
    assert got[0] == got[1]


def test_bad_values_are_refused_in_one_line():
    for key, bad, allowed in (("swiglu_impl", "liger", "auto, eager, fused, fused_ffn"),
                              ("gqa_kv", "grouped", "auto, expanded, native")):
        with pytest.raises(SpecError) as ei:
            Workload(seq_len=64, global_batch=4, **{key: bad})
        msg = str(ei.value)
        assert "\n" not in msg and key in msg and bad in msg and allowed in msg, msg
        r = planner_cli(*ESTIMATE, f"--{key.replace('_', '-')}", bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and bad in r.stderr, r.stderr


def test_flags_plan_file_and_json_echo(tmp_path):
    plain = json.loads(planner_cli(*ESTIMATE, "--gqa-kv", "expanded").stdout)
    assert plain["workload"]["swiglu_impl"] == "auto" and plain["workload"]["gqa_kv"] == "expanded"
    r = planner_cli(*ESTIMATE, "--swiglu-impl", "fused", "--gqa-kv", "native")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["workload"]["swiglu_impl"] == "fused" and doc["workload"]["gqa_kv"] == "native"
    # native K/V save what expanded ones cost; the fused kernel keeps the product that auto rebuilds here
    saved = plain["predicted"]["memory_gib"]["activations"] - doc["predicted"]["memory_gib"]["activations"]
    want = (_activations(gqa_kv="expanded") - _activations(gqa_kv="native", swiglu_impl="fused")) / GIB
    assert saved == pytest.approx(want, rel=1e-3)
    ffn = json.loads(planner_cli(*ESTIMATE, "--swiglu-impl", "fused_ffn", "--gqa-kv", "native").stdout)
    gqa = plain["predicted"]["memory_gib"]["activations"] - ffn["predicted"]["memory_gib"]["activations"]
    assert gqa == pytest.approx((_activations(gqa_kv="expanded") - _activations(gqa_kv="native")) / GIB, rel=1e-3)
    assert gqa > 1.0 and gqa - saved > 1.0
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({"model": "llama3-405b", "plan": PLAN.to_dict(), "workload": {
        "seq_len": 8192, "global_batch": 2048, "swiglu_impl": "fused", "gqa_kv": "native"}}))
    via_file = planner_cli(*ESTIMATE, "--plan", str(plan_file))
    assert via_file.returncode == 0, via_file.stderr
    assert json.loads(via_file.stdout)["predicted"]["memory_gib"] == doc["predicted"]["memory_gib"]


def test_titan_run_refuses_what_it_does_not_run(tmp_path):
    assert_titan_run_refuses(tmp_path, "swiglu_impl", "eager", ["auto", "fused"])
    assert_titan_run_refuses(tmp_path, "swiglu_impl", "fused_ffn", ["auto", "fused"])
    assert_titan_run_refuses(tmp_path, "gqa_kv", "expanded", ["auto", "native"])
