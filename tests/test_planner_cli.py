"""titan-plan end to end: tables, plan files, what-if estimates, bad input, no torch."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import yaml

from planner.cli import main, parse_tokens
from search_spaces.plan import Plan
from search_spaces.planfile import read_plan_file


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_parse_tokens():
    assert parse_tokens("4M") == 4 * 2 ** 20
    assert parse_tokens("512K") == 512 * 1024
    assert parse_tokens("1048576") == 2 ** 20
    with pytest.raises(ValueError):
        parse_tokens("lots")


def test_plan_70b_writes_plan(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    rc = main(["--model", "llama3-70b", "--gpus", "256", "--hardware", "h100-sxm", "--seq-len", "8192",
               "--global-batch-tokens", "4M", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "top 10" in text and "rejected:" in text and "out of memory" in text
    pf = read_plan_file(out)
    p = pf["plan"]
    assert p.world_size == 256 and p.global_batch() == 512
    assert pf["model"] == "llama3-70b" and pf["workload"]["seq_len"] == 8192
    pred = pf["predicted"]
    assert 0 < pred["mfu"] < 1 and 0 < pred["peak_memory_gib"] <= 80
    assert pred["tokens_per_s"] == pytest.approx(pred["tokens_per_s_per_gpu"] * 256, rel=1e-3)


def test_plan_json(tmp_path, capsys):
    rc = main(["--model", "llama3-8b", "--gpus", "64", "--hardware", "h100-sxm", "--global-batch", "256",
               "--seq-len", "4096", "--json", "--no-write", "--top", "3"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert len(doc["top"]) == 3 and doc["n_feasible"] > 0 and doc["pareto"]
    times = [r["predicted"]["step_time_s"] for r in doc["top"]]
    assert times == sorted(times)
    # the Pareto front trades memory for speed: memory up => tokens/s up
    front = [(r["predicted"]["peak_memory_gib"], r["predicted"]["tokens_per_s"]) for r in doc["pareto"]]
    assert len(front) > 1 and all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(front, front[1:]))
    assert front[0][1] < front[-1][1]


def test_estimate_from_flags_and_plan_file(tmp_path, capsys):
    rc = main(["estimate", "--model", "llama3-405b", "--gpus", "16384", "--hardware", "h100-sxm",
               "--seq-len", "8192", "--global-batch-tokens", "16M", "--tp", "8", "--pp", "16",
               "--ac", "full", "--schedule", "Interleaved1F1B", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["plan"]["dp_shard"] == 128 and doc["plan"]["n_microbatches"] == 16
    assert doc["predicted"]["memory_gib"]["activations"] > 0
    out = tmp_path / "p.yaml"
    assert main(["--model", "llama3-8b", "--gpus", "16", "--hardware", "a100-80g", "--global-batch", "64",
                 "--seq-len", "2048", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["estimate", "--plan", str(out)]) == 0
    text = capsys.readouterr().out
    assert "memory per device" in text and "time per step" in text


@pytest.mark.parametrize("args, needle", [
    (["--model", "llama3-7b", "--gpus", "8", "--hardware", "h100-sxm"], "unknown model 'llama3-7b'"),
    (["--model", "llama3-8b", "--gpus", "8", "--hardware", "h1000"], "unknown hardware 'h1000'"),
    (["--model", "llama3-8b", "--gpus", "8", "--hardware", "a100"],
     "unknown hardware 'a100' (did you mean 'a100-40g' or 'a100-80g'?)"),
    (["--model", "llama3-405b", "--gpus", "8", "--hardware", "a100-40g", "--seq-len", "8192",
      "--global-batch", "8"], "no layout fits in memory"),
    (["--model", "llama3-8b", "--gpus", "7", "--hardware", "h100-sxm", "--global-batch", "3"], "no layout is legal"),
    (["estimate", "--model", "llama3-8b", "--gpus", "12", "--hardware", "h100-sxm", "--tp", "3",
      "--global-batch", "48"], "tp=3 must divide"),
    (["estimate", "--model", "llama3-8b", "--gpus", "16", "--hardware", "h100-sxm", "--tp", "2",
      "--dp-shard", "2", "--global-batch", "16"], "world size is 16"),
    (["--model", "llama3-8b", "--global-batch-tokens", "1000", "--seq-len", "256", "--gpus", "8",
      "--hardware", "h100-sxm"], "not a multiple of --seq-len"),
])
def test_bad_input_one_line_exit_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_malformed_and_mistyped_yaml(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("dim: [1, 2\n")
    r = run_cli("--model", str(bad), "--gpus", "8", "--hardware", "h100-sxm")
    assert r.returncode == 2 and "malformed YAML" in r.stderr
    bad.write_text(textwrap.dedent("""\
        dim: 512
        n_layers: two
        n_heads: 8
        vocab_size: 1000
        ffn_hidden: 1024
    """))
    r = run_cli("--model", str(bad), "--gpus", "8", "--hardware", "h100-sxm")
    assert r.returncode == 2 and "'n_layers' must be an integer" in r.stderr
    bad.write_text("dim: 512\nn_heads: 8\nvocab_size: 1000\nffn_hidden: 1024\n")
    r = run_cli("--model", str(bad), "--gpus", "8", "--hardware", "h100-sxm")
    assert r.returncode == 2 and "missing key 'n_layers'" in r.stderr
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"model": "llama3-8b", "plan": {"tp": 2, "dp_shard": 2, "pipeline": 2}}))
    r = run_cli("estimate", "--plan", str(plan), "--hardware", "h100-sxm")
    assert r.returncode == 2 and "unknown key 'pipeline'" in r.stderr


def test_local_default_plans_without_torch(tmp_path):
    """The default (local machine) plan works, and the planner never imports torch."""
    code = ("import sys, planner.cli as c; rc = c.main(['--out', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'planner imported torch'; print('RC', rc)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "plan.yaml")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "RC 0" in r.stdout and "llama3-debug" in r.stdout
    assert read_plan_file(tmp_path / "plan.yaml")["plan"].world_size >= 1


def test_list_presets(capsys):
    assert main(["list", "models"]) == 0
    out = capsys.readouterr().out
    for name in ("llama3-debug", "llama3-405b", "deepseek-v3-671b", "qwen3-30b-a3b", "mixtral-8x7b", "moe-debug"):
        assert name in out
    assert main(["list", "hardware"]) == 0
    out = capsys.readouterr().out
    for name in ("a100-40g", "a100-80g", "h100-sxm", "h200", "b200", "mi300x", "cpu"):
        assert name in out


def test_pareto_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "front.png"
    assert main(["--model", "llama3-8b", "--gpus", "32", "--hardware", "h100-sxm", "--global-batch", "128",
                 "--seq-len", "4096", "--no-write", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pareto_front_is_exactly_the_non_dominated_set():
    import numpy as np

    from planner.rank import pareto_front

    rng = np.random.default_rng(0)
    mem, tps = rng.integers(1, 50, 300).astype(float), rng.integers(1, 50, 300).astype(float)
    est = type("E", (), {"peak_memory_bytes": mem, "tokens_per_s": tps})()
    idx = np.arange(300)
    front = set(pareto_front(est, idx).tolist())
    brute = {i for i in idx if not any((mem[j] <= mem[i] and tps[j] > tps[i]) or
                                       (mem[j] < mem[i] and tps[j] >= tps[i]) for j in idx)}
    # ties (same memory and tokens/s) keep one representative
    key = lambda s: {(mem[i], tps[i]) for i in s}  # noqa: E731
    assert key(front) == key(brute) and len(front) == len(key(front))


# ---------------------------------------------------------------------------- every workload key, flag and file
WORKLOAD_ARGS = ["--state-layout", "megatron", "--zero", "1", "--attention-impl", "materialized", "--dropout",
                 "--no-sequence-parallel", "--selective-ac", "attention", "--grad-dtype", "bf16",
                 "--loss-impl", "eager", "--grad-accum", "hp_copy"]
WORKLOAD_SET = {"state_layout": "megatron", "zero": 1, "attention_impl": "materialized", "dropout": True,
                "sequence_parallel": False, "selective_ac": "attention", "grad_dtype": "bf16", "loss_impl": "eager",
                "grad_accum": "hp_copy"}
BASE_8B = ["--model", "llama3-8b", "--gpus", "16", "--hardware", "h100-sxm", "--seq-len", "2048",
           "--global-batch", "64"]


def _estimate_json(capsys, *args) -> dict:
    rc = main(["estimate", *args, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    return doc


def test_every_workload_key_has_a_flag_and_reaches_the_cost_model(capsys):
    from cost_models.workload import Workload
    from planner.inputs import WORKLOAD_KEYS
    assert set(WORKLOAD_KEYS) == {f for f in Workload.__dataclass_fields__}
    base = _estimate_json(capsys, *BASE_8B, "--tp", "2", "--ac", "selective")
    doc = _estimate_json(capsys, *BASE_8B, "--tp", "2", "--ac", "selective", *WORKLOAD_ARGS)
    assert {k: doc["workload"][k] for k in WORKLOAD_SET} == WORKLOAD_SET
    assert doc["inputs"]["workload"] == doc["workload"]          # --json echoes every input
    for k in ("model", "hardware", "gpus", "gpus_per_node", "seq_len", "global_batch", "dtype", "calibration"):
        assert k in doc["inputs"]
    # each setting moves the figure it should: megatron state with ZeRO-1 replicates the fp32 main params
    # over dp; materialized attention, dropout masks and no sequence parallel add activation bytes
    mem, mem0 = doc["predicted"]["memory_gib"], base["predicted"]["memory_gib"]
    assert mem["activations"] > mem0["activations"]
    # and each one alone changes the prediction (on the megatron layout, where zero applies; under this executor's
    # defaults for the rest, not the Megatron regime the layout implies, which sets some of them)
    megatron = [*BASE_8B, "--tp", "2", "--ac", "selective", "--state-layout", "megatron", "--framework", "titan-run"]
    ref = _estimate_json(capsys, *megatron)
    for key, value in WORKLOAD_SET.items():
        name = key.replace("_", "-")
        flag = [f"--{name}"] if value is True else [f"--no-{name}"] if value is False else [f"--{name}", str(value)]
        if key != "state_layout":
            one = _estimate_json(capsys, *megatron, *flag)
            assert one["workload"][key] == value and one["predicted"] != ref["predicted"], key


def test_plan_file_workload_keys_are_read_and_typos_refused(tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-8b", "hardware": "h100-sxm", "plan": {"dp_shard": 8, "tp": 2},
                                 "workload": {"seq_len": 2048, "global_batch": 64, **WORKLOAD_SET}}))
    doc = _estimate_json(capsys, "--plan", str(f))
    assert {k: doc["workload"][k] for k in WORKLOAD_SET} == WORKLOAD_SET and doc["gpus"] == 16
    # a flag wins over the file
    # (bf16 gradients are the megatron layout's: switching the layout by flag also sets them back)
    r = run_cli("estimate", "--plan", str(f), "--state-layout", "fsdp2")
    assert r.returncode == 2 and "'grad_dtype' is 'bf16' with state_layout 'fsdp2'" in r.stderr, r.stderr
    # (and the file's ZeRO-1 is the megatron layout's: fsdp2 takes --zero 3 or none, else a one-line refusal)
    r = run_cli("estimate", "--plan", str(f), "--state-layout", "fsdp2", "--grad-dtype", "fp32")
    assert r.returncode == 2 and "--zero 1 (workload key 'zero') is a megatron state layout's" in r.stderr, r.stderr
    doc = _estimate_json(capsys, "--plan", str(f), "--state-layout", "fsdp2", "--grad-dtype", "fp32", "--zero", "3",
                         "--sequence-parallel", "--tp", "4")
    assert doc["workload"]["state_layout"] == "fsdp2" and doc["workload"]["sequence_parallel"] is True
    assert (doc["plan"]["tp"], doc["plan"]["dp_shard"]) == (4, 4)     # dp_shard re-derived for the new tp
    # the search reads its question from a plan file too
    assert main(["--plan", str(f), "--no-write", "--json", "--top", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {k: doc["inputs"]["workload"][k] for k in WORKLOAD_SET} == WORKLOAD_SET and doc["inputs"]["gpus"] == 16
    f.write_text(yaml.safe_dump({"model": "llama3-8b", "hardware": "h100-sxm", "plan": {"dp_shard": 16},
                                 "workload": {"seq_len": 2048, "global_batch": 64, "state_layot": "megatron"}}))
    for cmd in (["estimate"], ["plan", "--no-write"]):
        r = run_cli(*cmd, "--plan", str(f))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "unknown key 'state_layot'" in r.stderr and "did you mean 'state_layout'" in r.stderr
    r = run_cli("estimate", *BASE_8B, "--selective-ac", "most")
    assert r.returncode == 2 and "--selective-ac" in r.stderr


def test_plan_writes_and_echoes_the_full_workload(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main([*BASE_8B, *WORKLOAD_ARGS, "--out", str(out), "--json", "--top", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {k: doc["inputs"]["workload"][k] for k in WORKLOAD_SET} == WORKLOAD_SET
    pf = read_plan_file(out)
    assert {k: pf["workload"][k] for k in WORKLOAD_SET} == WORKLOAD_SET
    # and estimate reads it back unchanged
    again = _estimate_json(capsys, "--plan", str(out))
    assert again["workload"] == pf["workload"] and again["plan"] == pf["plan"].to_dict()


# ---------------------------------------------------------------------------- what-if layouts titan-run cannot run
def test_estimate_predicts_a_schedule_titan_run_cannot_run(capsys):
    """1F1B with 2 micro-batches on 12 pipeline stages (as a published 176B run did): predicted, with a note."""
    args = ["--model", "llama3-70b", "--gpus", "96", "--hardware", "a100-80g", "--tp", "8", "--pp", "12",
            "--global-batch", "2", "--seq-len", "2048", "--ac", "full"]
    doc = _estimate_json(capsys, *args)
    assert doc["plan"]["n_microbatches"] == 2 and doc["titan_run_can_run"] is False
    assert "titan-run cannot run this schedule" in doc["note"] and doc["predicted"]["step_time_s"] > 0
    assert main(["estimate", *args]) == 0
    text = capsys.readouterr().out
    notes = [line for line in text.splitlines() if "titan-run cannot run" in line]
    assert len(notes) == 1 and "needs at least 12" in notes[0]
    # a runnable layout has no note
    ok = _estimate_json(capsys, *args[:-6], "--global-batch", "24", "--seq-len", "2048", "--ac", "full")
    assert ok["titan_run_can_run"] is True and ok["note"] is None
    # the search keeps the rule: no candidate has fewer micro-batches than its schedule needs
    assert main(["--model", "llama3-70b", "--gpus", "96", "--hardware", "a100-80g", "--global-batch", "4",
                 "--seq-len", "2048", "--json", "--no-write", "--top", "1000"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["top"] and all(r["plan"]["n_microbatches"] >= r["plan"]["pp"] for r in doc["top"])
    assert any("micro-batch count" in r["reason"] for r in doc["rejected"])


def test_rank_by_p90_ranks_and_judges_memory_by_the_conservative_bounds(capsys):
    # (the selective policy stated: the two rankings then count the feasible candidates of the same workload)
    args = ["--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm", "--seq-len", "8192",
            "--global-batch", "128", "--json", "--no-write", "--top", "50", "--selective-ac", "matmul"]
    assert main(args) == 0
    point = json.loads(capsys.readouterr().out)
    assert main(args + ["--rank-by", "p90"]) == 0
    p90 = json.loads(capsys.readouterr().out)
    assert p90["inputs"]["rank_by"] == "p90" and point["inputs"]["rank_by"] == "time"
    rows = [r["predicted"] for r in p90["top"]]
    assert [r["step_time_p90_s"] for r in rows] == sorted(r["step_time_p90_s"] for r in rows)
    usable = rows[0]["peak_memory_gib"] + rows[0]["headroom_gib"]
    assert all(r["peak_memory_p90_gib"] <= usable + 1e-3 for r in rows)
    assert all(r["step_time_p90_s"] >= r["step_time_s"] and r["peak_memory_p90_gib"] >= r["peak_memory_gib"]
               for r in rows)
    # the conservative bound fits fewer layouts, and says so among the rejections
    assert p90["n_feasible"] < point["n_feasible"]
    assert any(r["reason"] == "out of memory (p90 bound)" for r in p90["rejected"])
    r = run_cli("--model", "llama3-8b", "--gpus", "8", "--hardware", "h100-sxm", "--rank-by", "p99")
    assert r.returncode == 2 and "--rank-by" in r.stderr


LLAMA3_405B_T4_LAYOUT = ["--model", "llama3-405b", "--gpus", "16384", "--hardware", "h100-sxm", "--seq-len", "8192",
                         "--global-batch", "2048", "--tp", "8", "--pp", "16"]     # Llama 3 paper, Table 4
LLAMA3_405B_T4 = [*LLAMA3_405B_T4_LAYOUT, "--schedule", "1F1B"]     # under 1F1B, asked
# the same with the gradient sync stated (torch's pipelining: after the last micro-batch), so that the knobs below
# are the only ones the estimate chooses (the schedule as each test asks)
LLAMA3_405B_T4_LAST = [*LLAMA3_405B_T4_LAYOUT, "--pp-grad-sync", "last_microbatch"]
# the 8,192-GPU row of the same table (FSDP 64, 32 micro-batches) under Interleaved1F1B, 4 stages per rank
LLAMA3_405B_T4_8K_IL = ["--model", "llama3-405b", "--gpus", "8192", "--hardware", "h100-sxm", "--seq-len", "8192",
                        "--global-batch", "2048", "--tp", "8", "--pp", "16", "--schedule", "Interleaved1F1B",
                        "--stages-per-rank", "4"]


def test_estimate_takes_a_sync_per_micro_batch_where_only_it_fits(capsys):
    """The Llama 3 layout that trained without recompute (TP 8 x PP 16 x FSDP 64, seq 8K; Table 4) under
    Interleaved1F1B: with the TP activations and the pipeline's gradient sync left to the estimate, it keeps the
    sequence shards and reduce-scatters every micro-batch (titan-run runs both), which fits where the defaults need
    twice the memory, and says so in one note naming both keys and every variant.  (The 16,384-GPU row under 1F1B
    fits with the shards alone since titan-run's FFNs rebuild their down projection's input.)"""
    chosen = _estimate_json(capsys, *LLAMA3_405B_T4_8K_IL, "--ac", "none")
    assert chosen["predicted"]["headroom_gib"] >= 0 and chosen["titan_run_can_run"]
    assert chosen["workload"]["pp_grad_sync"] == "every_microbatch" and chosen["workload"]["tp_activations"] == "sharded"
    stated = _estimate_json(capsys, *LLAMA3_405B_T4_8K_IL, "--ac", "none", "--pp-grad-sync", "every_microbatch",
                            "--tp-activations", "sharded", "--reshard")
    assert chosen["predicted"] == stated["predicted"]
    default = _estimate_json(capsys, *LLAMA3_405B_T4_8K_IL, "--ac", "none", "--tp-activations", "gathered",
                             "--pp-grad-sync", "last_microbatch")
    assert default["predicted"]["headroom_gib"] < 0
    note = chosen["knob_notes"][0]
    assert note.startswith("tp-activations not given: 'sharded'") and "pp-grad-sync not given: 'every_microbatch'" in note
    assert note.count("; ") >= 4 and "gathered, last_microbatch: does not fit" in note
    # stated, the sync is not chosen: the search's rule for a key the question gives
    assert _estimate_json(capsys, *LLAMA3_405B_T4_8K_IL, "--ac", "none", "--pp-grad-sync", "last_microbatch"
                          )["workload"]["pp_grad_sync"] == "last_microbatch"
    # the 16,384-GPU row under 1F1B: the shards alone fit, the sync stays the default
    one = _estimate_json(capsys, *LLAMA3_405B_T4, "--ac", "none")
    assert one["predicted"]["headroom_gib"] >= 0 and one["workload"]["tp_activations"] == "sharded"
    assert one["workload"]["pp_grad_sync"] == "auto"


def test_estimate_without_ac_takes_the_fastest_setting_that_fits(capsys):
    """A layout that trained (405B, TP 8 x PP 16 on 16,384 GPUs) is not judged by its no-recompute peak:
    without --ac the estimate takes the setting the search would, and says so with every peak (the TP
    activations stated gathered: with the shards it fits without recompute, the test above)."""
    fixed = [*LLAMA3_405B_T4_LAST, "--schedule", "1F1B", "--tp-activations", "gathered"]
    chosen = _estimate_json(capsys, *fixed)
    by_ac = {ac: _estimate_json(capsys, *fixed, "--ac", ac) for ac in ("none", "selective", "full")}
    fitting = {ac: d for ac, d in by_ac.items() if d["predicted"]["headroom_gib"] >= 0}
    assert "none" not in fitting and fitting, "the test needs a layout that fits only with recompute"
    fastest = min(fitting, key=lambda ac: fitting[ac]["predicted"]["step_time_s"])
    assert chosen["plan"]["ac"] == fastest
    assert chosen["predicted"] == by_ac[fastest]["predicted"]
    note = chosen["ac_note"]
    assert note.startswith(f"ac not given: '{fastest}', the fastest setting that fits")
    for ac, d in by_ac.items():
        assert f"{ac} {d['predicted']['peak_memory_gib']:.1f} GiB" in note
        assert d["ac_note"] is None                           # given: no choice made, no note
    # a layout that fits without recompute keeps ac none (the fastest)
    small = _estimate_json(capsys, *BASE_8B, "--tp", "2")
    assert small["plan"]["ac"] == "none" and small["predicted"] == _estimate_json(
        capsys, *BASE_8B, "--tp", "2", "--ac", "none")["predicted"]
    # and the text report prints the note
    assert main(["estimate", *fixed]) == 0
    assert f"note: ac not given: '{fastest}'" in capsys.readouterr().out


def test_estimate_without_reshard_takes_the_setting_the_search_would(capsys):
    """reshard_after_forward is a knob of the search space: without --reshard / --no-reshard the estimate takes
    the faster setting that fits (each ac's, then the ac as above) and says so; given, or meaningless (no FSDP
    shards, the megatron layout), there is no choice and no note."""
    args = [*LLAMA3_405B_T4_LAST, "--schedule", "1F1B", "--ac", "full"]
    chosen = _estimate_json(capsys, *args)
    both = {r: _estimate_json(capsys, *args, flag) for r, flag in ((True, "--reshard"), (False, "--no-reshard"))}
    fits = {r: d for r, d in both.items() if d["predicted"]["headroom_gib"] >= 0}
    best = min(fits, key=lambda r: fits[r]["predicted"]["step_time_s"])
    assert both[True]["predicted"] != both[False]["predicted"], "the test needs a layout where it matters"
    assert chosen["plan"]["reshard_after_forward"] is best
    assert chosen["predicted"] == both[best]["predicted"]
    assert chosen["knob_notes"] == [n for n in chosen["knob_notes"] if n.startswith("reshard not given")]
    assert chosen["knob_notes"][0].startswith(f"reshard not given: '{'yes' if best else 'no'}', the fastest setting")
    assert both[True]["knob_notes"] == [] and both[False]["knob_notes"] == []
    hsdp = _estimate_json(capsys, *BASE_8B, "--dp-shard", "1", "--dp-replicate", "16")["knob_notes"]
    assert not [n for n in hsdp if n.startswith("reshard")], hsdp
    mega = _estimate_json(capsys, *args, "--state-layout", "megatron", "--zero", "1")
    assert not [n for n in mega["knob_notes"] if n.startswith("reshard")] and mega["plan"]["reshard_after_forward"]
    assert main(["estimate", *args]) == 0
    assert "note: reshard not given:" in capsys.readouterr().out


def test_estimate_stages_per_rank_without_a_schedule_is_interleaved(capsys):
    """--stages-per-rank 4 without --schedule (a table's "VP 4"): the interleaved schedule, said in a note, the
    same prediction as asking for it; one stage per rank keeps 1F1B without a note."""
    args = [*LLAMA3_405B_T4_LAST, "--ac", "full", "--no-reshard", "--stages-per-rank", "4"]
    implied = _estimate_json(capsys, *args)
    asked = _estimate_json(capsys, *args, "--schedule", "Interleaved1F1B")
    assert implied["plan"]["schedule"] == "Interleaved1F1B" and implied["plan"]["stages_per_rank"] == 4
    assert implied["predicted"] == asked["predicted"]
    assert implied["knob_notes"][0].startswith("schedule not given: 'Interleaved1F1B', the schedule with 4 stages")
    assert not [n for n in asked["knob_notes"] if n.startswith("schedule")]
    one = _estimate_json(capsys, *LLAMA3_405B_T4_LAST, "--ac", "full", "--no-reshard", "--stages-per-rank", "1")
    assert one["plan"]["schedule"] == "1F1B" and not [n for n in one["knob_notes"] if n.startswith("schedule")]


def test_estimate_without_a_schedule_takes_the_fastest_titan_run_runs(capsys):
    """A pipeline asked without --schedule under titan-run's regime (no --framework): each schedule of the search
    space titan-plan would take is estimated (Interleaved1F1B at each stages-per-rank value) and the fastest that
    fits is taken, as the search takes it, with a note naming each; the same prediction as asking for it.  Under
    another stack's regime (Megatron-LM, TorchTitan) the schedule is that stack's default, 1F1B, and no note."""
    chosen = _estimate_json(capsys, *LLAMA3_405B_T4_LAYOUT, "--ac", "none")
    plan = chosen["plan"]
    assert plan["schedule"] != "1F1B", "the test needs a layout where 1F1B is not the fastest"
    v = ["--stages-per-rank", str(plan["stages_per_rank"])] if plan["schedule"] == "Interleaved1F1B" else []
    asked = _estimate_json(capsys, *LLAMA3_405B_T4_LAYOUT, "--ac", "none", "--schedule", plan["schedule"], *v)
    assert asked["predicted"] == chosen["predicted"] and asked["plan"] == plan
    one = _estimate_json(capsys, *LLAMA3_405B_T4, "--ac", "none")
    assert one["predicted"]["headroom_gib"] >= 0
    assert chosen["predicted"]["step_time_s"] < one["predicted"]["step_time_s"]
    note = [n for n in chosen["knob_notes"] if n.startswith("schedule not given")]
    shown = plan["schedule"] + (f" V {plan['stages_per_rank']}" if v else "")
    assert len(note) == 1 and note[0].startswith(f"schedule not given: '{shown}', the fastest setting that fits")
    assert not [n for n in asked["knob_notes"] if n.startswith("schedule")]
    for fw in ("megatron-lm", "torchtitan"):
        other = _estimate_json(capsys, *LLAMA3_405B_T4_LAYOUT, "--ac", "none", "--framework", fw)
        assert other["plan"]["schedule"] == "1F1B" and not [n for n in other["knob_notes"] if "schedule" in n]


def test_estimate_published_table_spellings(capsys):
    """A published table's DP, VP and FP8 columns as flags: --dp N is --dp-shard N / --dp-replicate, --vpp is
    --stages-per-rank, --fp8 is --float8; --dp that contradicts --dp-shard is refused in one line, exit 2."""
    base = ["--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm", "--tp", "4", "--pp", "2",
            "--seq-len", "8192", "--global-batch", "64", "--ac", "full", "--no-reshard"]
    spelled = _estimate_json(capsys, *base, "--dp", "8", "--vpp", "2", "--fp8")
    plain = _estimate_json(capsys, *base, "--dp-shard", "8", "--schedule", "Interleaved1F1B", "--stages-per-rank",
                           "2", "--float8")
    assert spelled["plan"] == plain["plan"] and spelled["predicted"] == plain["predicted"]
    # a Megatron-LM launch script's own flag names
    megatron = _estimate_json(capsys, "--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm",
                              "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                              "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                              "--global-batch-size", "64", "--seq-length", "8192", "--ac", "full", "--no-reshard",
                              "--fp8")
    assert megatron["plan"] == plain["plan"] and megatron["predicted"] == plain["predicted"]
    dist_opt = _estimate_json(capsys, *base, "--recompute-granularity", "selective", "--use-distributed-optimizer")
    layout = _estimate_json(capsys, *base, "--ac", "selective", "--state-layout", "megatron", "--zero", "1")
    assert dist_opt["workload"]["state_layout"] == "megatron" and dist_opt["predicted"] == layout["predicted"]
    hsdp = _estimate_json(capsys, *base, "--dp", "8", "--dp-replicate", "2")
    assert (hsdp["plan"]["dp_replicate"], hsdp["plan"]["dp_shard"]) == (2, 4)
    assert main(["estimate", *base, "--dp", "8", "--dp-shard", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.endswith("--dp 8 is not --dp-replicate 1 x --dp-shard 4; give one of them")


def test_estimate_schedule_names_as_papers_write_them(capsys):
    """--schedule takes the schedules in any case and by the names papers give them; DeepSeek's DualPipe is
    predicted as DualPipeV with a note that says so; an unknown name is refused in one line, exit 2."""
    base = ["--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm", "--tp", "8", "--pp", "4",
            "--seq-len", "8192", "--global-batch", "64", "--ac", "full", "--no-reshard"]
    for spelled, name in [("interleaved", "Interleaved1F1B"), ("Interleaved 1F1B", "Interleaved1F1B"),
                          ("zero-bubble", "ZBVZeroBubble"), ("1f1b", "1F1B"), ("dualpipev", "DualPipeV")]:
        doc = _estimate_json(capsys, *base, "--schedule", spelled)
        assert doc["plan"]["schedule"] == name, spelled
        assert not [n for n in doc["knob_notes"] if "DualPipe'" in n], spelled
    deepseek = _estimate_json(capsys, *base, "--schedule", "DualPipe")
    assert deepseek["plan"]["schedule"] == "DualPipeV"
    assert deepseek["knob_notes"][0].startswith("schedule 'DualPipe' predicted as DualPipeV")
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", *base, "--schedule", "PipeDream-2BW"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "unknown schedule 'PipeDream-2BW'" in err and "DualPipeV" in err


def test_estimate_interleaved_without_stages_per_rank_takes_the_spaces_best(capsys):
    """--schedule Interleaved1F1B without --stages-per-rank: each value of the search space titan-plan would
    take (dense: 2 and 4) and each of 2..8 that leaves every stage a layer (126 layers at PP 16: up to 7) is
    estimated and the fastest that fits is taken and said; given, no choice."""
    args = [*LLAMA3_405B_T4_LAST, "--ac", "full", "--no-reshard", "--schedule", "Interleaved1F1B"]
    chosen = _estimate_json(capsys, *args)
    by_v = {v: _estimate_json(capsys, *args, "--stages-per-rank", str(v)) for v in range(2, 8)}
    fits = {v: d for v, d in by_v.items() if d["predicted"]["headroom_gib"] >= 0}
    best = min(fits, key=lambda v: fits[v]["predicted"]["step_time_s"])
    assert by_v[2]["predicted"]["step_time_s"] != by_v[4]["predicted"]["step_time_s"]
    assert chosen["plan"]["stages_per_rank"] == best and chosen["predicted"] == by_v[best]["predicted"]
    assert chosen["knob_notes"] == [n for n in chosen["knob_notes"] if n.startswith(f"stages-per-rank not given: '{best}'")]
    assert len(chosen["knob_notes"]) == 1 and by_v[2]["knob_notes"] == []
    # a pipeline too short for V 3 (PP 16 x 3 > 32 layers of llama3-8b) only tries what leaves a layer per stage
    small = _estimate_json(capsys, "--model", "llama3-8b", "--gpus", "16", "--hardware", "h100-sxm", "--seq-len",
                           "2048", "--global-batch", "64", "--pp", "16", "--schedule", "Interleaved1F1B", "--ac",
                           "none", "--no-reshard")
    assert small["plan"]["stages_per_rank"] == 2 and small["knob_notes"] == []


def test_estimate_without_ac_when_nothing_fits_takes_the_smallest_peak(capsys):
    args = ["--model", "llama3-405b", "--gpus", "8", "--hardware", "h100-sxm", "--seq-len", "8192",
            "--global-batch", "8"]
    chosen = _estimate_json(capsys, *args)
    peaks = {ac: _estimate_json(capsys, *args, "--ac", ac)["predicted"]["peak_memory_gib"]
             for ac in ("none", "selective", "full")}
    assert chosen["plan"]["ac"] == min(peaks, key=peaks.get)
    assert "no setting fits; the smallest peak" in chosen["ac_note"]


def test_nothing_fits_names_the_smallest_world_that_does(tmp_path):
    """No layout of llama3-70b fits on 2 H100s: the one-line error names the smallest power-of-two multiple of
    the world on which one fits, with that layout, which `titan-plan --gpus K` then picks; on K/2 nothing fits.
    The node shape is the hardware's (a 2-GPU question has 2 per node; the 16-GPU answer has 8)."""
    q = ["--model", "llama3-70b", "--hardware", "h100-sxm", "--global-batch", "64", "--seq-len", "4096"]
    r = run_cli(*q, "--gpus", "2", "--out", str(tmp_path / "a.yaml"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    m = re.search(r"the smallest world that fits is (\d+) x h100-sxm \(--gpus \d+: (\S+) ", r.stderr)
    assert m, r.stderr
    k, layout = int(m.group(1)), m.group(2)
    assert k > 2 and k & (k - 1) == 0
    out = tmp_path / "k.yaml"
    ok = run_cli(*q, "--gpus", str(k), "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    picked = yaml.safe_load(out.read_text())["plan"]
    assert Plan.from_dict(picked).layout_str() == layout, (picked, layout)
    half = run_cli(*q, "--gpus", str(k // 2), "--out", str(tmp_path / "h.yaml"))
    assert half.returncode == 2 and "no layout fits in memory" in half.stderr


# TorchTitan's 8B on 8 nodes of 96 GB H100s, TP 8, 12 sequences of 8K per micro-batch (the shared reference's async-TP
# rows): selective checkpointing fits under TorchTitan's per-op policy only
TT_8B_TP8 = ["--model", "llama3-8b", "--gpus", "64", "--hardware", "h100-96g-500w", "--seq-len", "8192",
             "--global-batch", "96", "--tp", "8", "--microbatch", "12", "--compile"]


def test_estimate_without_selective_ac_takes_the_policy_that_fits(capsys):
    """Without --selective-ac (titan-run runs both policies) the estimate keeps every matmul output where that fits
    and takes TorchTitan's per-op policy where only it lets the faster setting fit, saying so; given, it is kept."""
    chosen = _estimate_json(capsys, *TT_8B_TP8, "--ac", "selective")
    op = _estimate_json(capsys, *TT_8B_TP8, "--ac", "selective", "--selective-ac", "op")
    matmul = _estimate_json(capsys, *TT_8B_TP8, "--ac", "selective", "--selective-ac", "matmul")
    assert matmul["predicted"]["headroom_gib"] < 0 <= op["predicted"]["headroom_gib"]
    assert op["predicted"]["peak_memory_gib"] < matmul["predicted"]["peak_memory_gib"]
    assert op["predicted"]["step_time_s"] > matmul["predicted"]["step_time_s"]     # the recomputed matmuls
    assert chosen["workload"]["selective_ac"] == "op" and chosen["predicted"] == op["predicted"]
    assert chosen["knob_notes"][0].startswith("selective-ac not given: 'op' (TorchTitan's per-op policy")
    assert not [n for n in op["knob_notes"] + matmul["knob_notes"] if n.startswith("selective-ac")]
    # without --ac: selective under the per-op policy is faster than full recompute, and fits
    free = _estimate_json(capsys, *TT_8B_TP8)
    assert free["plan"]["ac"] == "selective" and free["workload"]["selective_ac"] == "op"
    # where every matmul output fits, the default policy stays and nothing is said
    small = _estimate_json(capsys, *TT_8B_TP8[:-3], "--microbatch", "1", "--ac", "selective")
    assert small["workload"]["selective_ac"] == "auto"
    assert not [n for n in small["knob_notes"] if n.startswith("selective-ac")]
