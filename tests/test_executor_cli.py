"""`titan-run` from the outside: help, bad input (exit 2, one line), self-test, a short run, a failing rank."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from executor.config import ConfigError, load_run_config
from executor.parallel.parallelize import resolve_backend, spmd_plan_unsupported
from search_spaces.plan import Plan
from executor.data import DataError
from tests.distributed.harness import ROOT, env, titan_run_cmd


def run(args, timeout=300, extra_env=None, cwd=None):
    e = env()
    e.update(extra_env or {})
    return subprocess.run(titan_run_cmd(*args), cwd=cwd or ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout)


def write_plan(tmp_path: Path, plan: dict, train: dict | None = None, **top) -> str:
    d = {"model": "llama3-debug", "workload": {"seq_len": 64, "global_batch": 4}, "plan": plan, **top}
    if train is not None:
        d["train"] = train
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(d))
    return str(f)


# --------------------------------------------------------------------------- no processes
def test_help():
    p = run(["--help"], timeout=60)
    assert p.returncode == 0
    for opt in ("--plan", "--nproc-per-node", "--steps", "--set", "--run-dir", "--self-test"):
        assert opt in p.stdout
    if shutil.which("titan-run"):       # the console script, when the package is installed
        q = subprocess.run(["titan-run", "--help"], capture_output=True, text=True, timeout=60, env=env())
        assert q.returncode == 0 and "--plan" in q.stdout


BAD = [
    ({"dp_shard": 4, "microbatch": 1}, None, 2, "world size is 2"),
    ({"tp": 3, "microbatch": 4}, None, 3, "tp=3 must divide n_heads=8"),
    ({"pp": 8, "n_microbatches": 8, "microbatch": 4, "dp_shard": 1}, None, 8, "pp = 8 > 4 layers: a pipeline rank would hold no layer"),
    ({"dp_shard": 2, "microbatch": 2, "sharding": 1}, None, 2, "unknown key 'sharding'"),
    ({"dp_shard": 2, "microbatch": 2}, {"lrr": 1.0}, 2, "unknown key 'lrr'"),
    ({"dp_shard": 2, "microbatch": 2, "ac": "some"}, None, 2, "plan key 'ac' must be one of"),
    ({"dp_shard": 2, "microbatch": 3}, None, 2, "global batch is 4"),
]


def assert_one_line_error(p, message: str, run_dir: Path) -> None:
    """titan-run refused the input: exit 2, one 'titan-run: error:' line naming `message`, nothing started."""
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("titan-run: error:") and message in lines[0], lines[0]
    assert not run_dir.exists()          # nothing started


@pytest.mark.parametrize("plan,train,nproc,message", BAD, ids=["world", "tp-heads", "pp-layers", "plan-key",
                                                               "train-key", "ac-value", "batch"])
def test_bad_plan_exits_2_with_one_line(tmp_path, plan, train, nproc, message):
    p = run(["--plan", write_plan(tmp_path, plan, train), "--nproc-per-node", str(nproc), "--run-dir",
             str(tmp_path / "run")], timeout=120)
    assert_one_line_error(p, message, tmp_path / "run")


def test_bad_override_and_missing_file(tmp_path):
    p = run(["--set", "bogus=1"], timeout=120)
    assert p.returncode == 2 and "unknown key 'bogus'" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = run(["--plan", str(tmp_path / "nope.yaml")], timeout=120)
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_float8_without_torchao_is_bad_input(tmp_path):
    import importlib.util
    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is installed")
    p = run(["--plan", write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2, "float8": True}), "--run-dir",
             str(tmp_path / "run")], timeout=120)
    assert p.returncode == 2 and "torchao is not installed" in p.stderr


def test_config_overrides_and_default_layout(tmp_path):
    cfg = load_run_config(None, ["tp=2", "train.lr=1e-3", "workload.seq_len=128"], world_size=4)
    assert (cfg.plan.tp, cfg.plan.dp_shard, cfg.plan.microbatch) == (2, 2, 4)
    assert cfg.train.lr == 1e-3 and cfg.seq_len == 128 and cfg.global_batch == 8
    f = write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2}, {"steps": 7},
                   predicted={"tokens_per_s": 1.0}, provenance={"by": "titan-plan"}, inputs={})
    cfg = load_run_config(f, [], world_size=2)      # titan-plan's extra top-level keys are ignored
    assert cfg.train.steps == 7 and cfg.plan.dp_shard == 2
    with pytest.raises(ConfigError, match="world size is 4"):
        load_run_config(f, [], world_size=4)


# issue 15: inputs that used to be accepted, or caught only after the processes started
SILENT = [
    ("top-level typo", {"trian": {"steps": 3}}, "unknown key 'trian' (did you mean 'train'?)"),
    ("dtype fp8", {"workload": {"seq_len": 64, "global_batch": 4, "dtype": "fp8"}},
     "workload: key 'dtype' must be one of bf16, fp32; got 'fp8'"),
    ("state_layout", {"workload": {"seq_len": 64, "global_batch": 4, "state_layout": "bogus"}},
     "key 'state_layout' must be one of fsdp2, megatron"),
    ("lr inf", {"train": {"lr": float("inf")}}, "train: key 'lr' must be a finite number >= 0, got inf"),
    ("lr nan", {"train": {"lr": float("nan")}}, "train: key 'lr' must be a finite number >= 0, got nan"),
    ("grad_clip nan", {"train": {"grad_clip": float("nan")}}, "key 'grad_clip' must be a finite number"),
    ("steps 0", {"train": {"steps": 0}}, "train: key 'steps' must be an integer >= 1, got 0"),
    ("min_lr_ratio 5", {"train": {"min_lr_ratio": 5}}, "key 'min_lr_ratio' must be a number in [0, 1], got 5"),
    ("beta 2.0", {"train": {"beta2": 2.0}}, "key 'beta2' must be a number in [0, 1), got 2.0"),
    ("seq_len over max", {"workload": {"seq_len": 100000, "global_batch": 4}},
     "workload key 'seq_len' (100000) is more than model 'llama3-debug' allows (max_seq_len 1024)"),
    ("huge integer", {"workload": {"seq_len": 10 ** 30, "global_batch": 4}}, "must be an integer of at most"),
]


def _silent_plan(tmp_path: Path, change: dict) -> str:
    d = {"model": "llama3-debug", "workload": {"seq_len": 64, "global_batch": 4},
         "plan": {"dp_shard": 2, "microbatch": 2}}
    d.update(change)
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(d))
    return str(f)


@pytest.mark.parametrize("label,change,message", SILENT, ids=[s[0] for s in SILENT])
def test_issue15_bad_values_refused_before_processes(tmp_path, label, change, message):
    with pytest.raises(ConfigError) as ei:
        load_run_config(_silent_plan(tmp_path, change), [], world_size=2)
    assert message in str(ei.value) and "\n" not in str(ei.value)


def test_issue15_model_file_checked_before_processes(tmp_path):
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump({"dim": 250, "n_layers": 2, "n_heads": 16, "vocab_size": 512, "ffn_hidden": 512}))
    with pytest.raises(ConfigError, match=r"dim \(250\) must be divisible by n_heads \(16\)"):
        load_run_config(_silent_plan(tmp_path, {"model": str(m)}), [], world_size=2)
    with pytest.raises(ConfigError, match="the world size must be in 1..1,048,576"):
        load_run_config(_silent_plan(tmp_path, {}), [], world_size=2 ** 21)
    with pytest.raises(ConfigError, match="an empty name"):
        load_run_config(_silent_plan(tmp_path, {"model": ""}), [], world_size=2)


@pytest.mark.parametrize("label,dry", [("top-level typo", False), ("lr nan", False), ("beta 2.0", True),
                                       ("seq_len over max", True)])
def test_issue15_launcher_and_dry_run_refuse_in_one_line(tmp_path, label, dry):
    change, message = {s[0]: (s[1], s[2]) for s in SILENT}[label]
    plan = _silent_plan(tmp_path, change)
    if dry:                                    # the dry run validates the same way as the launcher
        p = run(["--dry-run", "--plan", plan], timeout=120)
    else:
        p = run(["--plan", plan, "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")], timeout=120)
    assert_one_line_error(p, message, tmp_path / "run")


def test_issue15_dry_run_world_and_unreadable_plans(tmp_path):
    plan = _silent_plan(tmp_path, {})
    for world, message in (("3", "but the world size is 3"), ("0", "the world size must be in 1..1,048,576"),
                           (str(2 ** 63), "the world size must be in 1..1,048,576")):
        p = run(["--dry-run", "--plan", plan, "--world", world], timeout=120)
        assert_one_line_error(p, message, tmp_path / "run")
    (tmp_path / "bin.yaml").write_bytes(b"\x7fELF\xff\xfe\x00")
    for f, message in ((tmp_path / "bin.yaml", "not a UTF-8 text file"), (tmp_path, "is a folder"),
                       (tmp_path / ("n" * 4000), "File name too long")):
        p = run(["--plan", str(f), "--run-dir", str(tmp_path / "run")], timeout=120)
        assert_one_line_error(p, message, tmp_path / "run")



def test_dry_run_refuses_bad_input_before_importing_torch(tmp_path):
    """A bad --world or --ranks, or a plan the world cannot hold, is answered by the dry run's torch-free front
    (executor/dry_run_args.py) in one line, exit 2, torch never imported; a good one is prepared for execution."""
    plan = _silent_plan(tmp_path, {})
    cases = ((["--world", "3"], "but the world size is 3"), (["--world", "2", "--ranks", "x"],
             "--ranks must be comma-separated integers, got 'x'"), (["--ranks", "5"], "--ranks 5 is outside the world of 2"))
    code = ("import sys, json; from executor.cli import main; argv = json.loads(sys.argv[1]); rc = main(argv); "
            "assert 'torch' not in sys.modules, 'imported torch'; print('RC', rc)")
    for extra, message in cases:
        r = subprocess.run([sys.executable, "-c", code, json.dumps(["--dry-run", "--plan", plan, *extra])],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "RC 2" in r.stdout, r.stdout + r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("titan-run: error: ") and lines[0].endswith(message), r.stderr
    from executor.dry_run_args import DryRun, prepare
    ready = prepare(["--plan", plan, "--ranks", "0,1", "--memory"])
    assert isinstance(ready, DryRun) and ready.world == 2 and ready.ranks == [0, 1] and ready.memory

# issue 14: data and tokenizer contents are read before any process group starts
def _tokenizer_json(path: Path, n_tokens: int) -> str:
    """A real tokenizer.json (the tokenizers package) with `n_tokens` tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(n_tokens - 1)}
    vocab["[UNK]"] = n_tokens - 1
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


def _file(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD_DATA = [   # (id, train keys from the folder, what the one line says besides the file's name)
    ("csv", lambda d: {"data": _file(d / "corpus.csv", "text,label\nhello,1\n")},
     "is a .csv file; titan-run reads .txt (one document per file) or .jsonl"),
    ("jsonl-not-json", lambda d: {"data": _file(d / "c.jsonl", '{"text": "a"}\nnot json\n')},
     "line 2 is not JSON"),
    ("jsonl-no-text", lambda d: {"data": _file(d / "c.jsonl", '{"text": "a"}\n{"body": "b"}\n')},
     "line 2 has no 'text' field (got keys 'body')"),
    ("jsonl-text-not-string", lambda d: {"data": _file(d / "c.jsonl", '{"text": 3}\n')},
     "line 1: 'text' must be a string, got int"),
    ("corpus-too-small", lambda d: {"data": _file(d / "small.txt", "tiny")},
     "has 6 tokens (tokenizer bytes, at most train.max_corpus_bytes = 16,000,000 bytes read), fewer than one "
     "global batch needs: 4 sequences x (seq_len 64 + 1) = 260"),
    ("tokenizer-not-json", lambda d: {"tokenizer": _file(d / "tokenizer.json", "vocab: [a, b]\n")},
     "cannot be read as a tokenizer.json"),
    ("tokenizer-vocab", lambda d: {"tokenizer": _tokenizer_json(d / "tokenizer.json", 600)},
     "has 600 tokens, more than the vocab_size 512 of model 'llama3-debug': set vocab_size: 600 (or more) in a "
     "model YAML"),
]


# the suite is at its 30-minute budget: the JSONL and unreadable-tokenizer cases are slow (the CSV, too-small corpus
# and vocabulary cases take the same path through the launcher in CI)
_SLOW_BAD_DATA = {"jsonl-not-json", "jsonl-no-text", "jsonl-text-not-string", "tokenizer-not-json"}


@pytest.mark.parametrize("case,train,message", [pytest.param(*b, marks=pytest.mark.slow) if b[0] in _SLOW_BAD_DATA
                                                else b for b in BAD_DATA], ids=[b[0] for b in BAD_DATA])
def test_issue14_bad_data_and_tokenizer_refused_before_processes(tmp_path, case, train, message):
    """Launched (torchrun, 2 processes) or dry-run: one line naming the file and the problem, exit 2."""
    keys = train(tmp_path)
    plan = write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2}, {**keys, "steps": 2, "tensorboard": False})
    named = next(iter(keys.values()))
    for args in (["--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")], ["--dry-run"]):
        p = run(["--plan", plan, *args], timeout=120)
        assert_one_line_error(p, message, tmp_path / "run")
        assert named in p.stderr, p.stderr


def test_issue14_good_data_passes_the_check(tmp_path):
    """The check reads what training reads: a folder of .txt and .jsonl with enough text is accepted."""
    (tmp_path / "data").mkdir()
    _file(tmp_path / "data" / "a.txt", "x" * 200)
    _file(tmp_path / "data" / "b.jsonl", "\n".join(json.dumps({"text": "y" * 30}) for _ in range(3)) + "\n")
    plan = write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2}, {"data": str(tmp_path / "data")})
    cfg = load_run_config(plan, [], world_size=2)        # 202 + 3 x 32 = 298 tokens >= 4 x 65
    assert cfg.train.data == str(tmp_path / "data")
    with pytest.raises(DataError, match="has 298 tokens"):
        load_run_config(plan, ["workload.seq_len=128"], world_size=2)     # 4 x 129 = 516 needed


@pytest.mark.parametrize("make,message", [
    (lambda d: (d / "c.jsonl").write_bytes(b'{"text": "\xff\xfe"}\n'), "c.jsonl' is not UTF-8 text"),
    (lambda d: (d / "notes.md").write_text("# notes"), "has no .txt or .jsonl files"),
    (lambda d: (d / "c.jsonl").write_text("[1, 2]\n"), "line 1 has no 'text' field (got list)"),
    (lambda d: (d / "c.txt").write_text(""), "has 2 tokens (tokenizer bytes"),     # BOS + EOS only
], ids=["jsonl-not-utf8", "folder-without-corpus", "jsonl-line-a-list", "empty"])
def test_issue14_corpus_problems_are_one_line_naming_the_file(tmp_path, make, message):
    data = tmp_path / "data"
    data.mkdir()
    make(data)
    plan = write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2}, {"data": str(data)})
    with pytest.raises(DataError) as ei:
        load_run_config(plan, [], world_size=2)
    assert message in str(ei.value) and "\n" not in str(ei.value) and str(data) in str(ei.value)


@pytest.mark.distributed
def test_issue14_builtin_corpus_too_small_for_the_batch_is_one_line(tmp_path):
    """The built-in corpus is not read before the launch (the planner's dry runs use it for any batch); a run
    whose batch it cannot fill stops in the worker with one line and exit 2, not a traceback."""
    p = run(["--nproc-per-node", "1", "--steps", "1", "--set", "train.max_corpus_bytes=1", "--set",
             "workload.seq_len=1024", "--run-dir", str(tmp_path / "run")], timeout=300)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "fewer than one global batch (8)" in lines[0], p.stderr
    assert lines[0].startswith("titan-run: error: the corpus has") and "train.max_corpus_bytes" in lines[0]


@pytest.mark.distributed
def test_issue14_bad_data_under_a_plain_torchrun_is_said_once(tmp_path):
    """torchrun started by hand (no titan-run launcher): the first rank to fail says it, once, before torchrun's
    own report."""
    plan = write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2}, {"data": _file(tmp_path / "c.csv", "a,b\n")})
    logs = tmp_path / "elastic"          # torchrun's log dir, where the workers' once-per-node marker goes
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--log-dir", str(logs), "-m", "executor.cli", "--plan", plan, "--run-dir",
                        str(tmp_path / "run")], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("titan-run: error:")]
    assert len(lines) == 1 and "c.csv' is a .csv file" in lines[0], p.stderr
    assert "exitcode  : 2" in p.stderr and not (tmp_path / "run").exists()
    assert len(list(logs.glob("*/attempt_0/titan-run-error-*"))) == 1


# --------------------------------------------------------------------------- real processes
@pytest.mark.slow
@pytest.mark.distributed
def test_self_test_4_processes():
    p = run(["--self-test", "--nproc-per-node", "4"], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "self-test verdict: PASS" in p.stdout
    assert sum(line.rstrip().endswith("PASS") for line in p.stdout.splitlines()) >= 9   # 8 axes + shards


@pytest.mark.distributed
def test_short_default_run_writes_metrics(tmp_path):
    run_dir = tmp_path / "run"
    p = run(["--steps", "3", "--run-dir", str(run_dir)], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for k in ("loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_device", "mfu", "step_time_s",
                  "data_time_s", "comm_s"):
            assert k in r
        assert r["loss"] > 0 and r["tokens_per_s"] > 0
    assert recs[1]["profiled"] and len(recs[1]["peak_memory_bytes"]) == 2 and recs[1]["peak_memory_bytes_max"] > 1e6
    assert recs[-1]["comm_s"].get("dp_shard", 0) > 0          # FSDP traffic on the dp_shard axis
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())
    assert plan["plan"]["dp_shard"] == 2 and plan["workload"]["seq_len"] == 256


@pytest.mark.distributed
def test_failing_rank_fails_the_run_without_hanging(tmp_path):
    f = write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2}, {"steps": 5, "tensorboard": False})
    p = run(["--plan", f, "--run-dir", str(tmp_path / "run")], timeout=180, extra_env={"TITAN_RUN_FAULT": "1:2"})
    assert p.returncode != 0
    assert "[rank 1] RuntimeError: injected fault" in p.stderr
    assert "titan-run: error: rank 1 (local rank 1, pid " in p.stderr and "exited with code 1" in p.stderr, p.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "error"


def test_float8_with_tp_on_dtensor_is_refused_in_one_line(tmp_path):
    """Float8 under TP runs on spmd_types (global amax scales, parallel/spmd_float8.py); the dtensor backend has
    no float8 TP here, so that plan is refused before any process starts, whether or not torchao is installed."""
    f = write_plan(tmp_path, {"tp": 2, "microbatch": 4, "float8": True, "backend": "dtensor"})
    p = run(["--plan", f, "--run-dir", str(tmp_path / "run")], timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "plan key 'float8' with tp > 1 runs on backend spmd_types only" in p.stderr
    assert not (tmp_path / "run").exists()
    assert spmd_plan_unsupported(Plan(dp_shard=2, tp=2, float8=True)) is None
    assert resolve_backend(Plan(dp_shard=2, tp=2, float8=True), SimpleNamespace(spmd_dp=None),
                           announce=True) == "spmd_types"


# --------------------------------------------------------------------------- measured against the plan
def test_prediction_is_carried_only_for_the_run_it_was_made_for(tmp_path):
    pred = {"step_time_s": 0.5, "step_time_p90_s": 0.6, "peak_memory_gib": 0.25, "peak_memory_p90_gib": 0.3}
    f = write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2}, predicted=pred, inputs={"hardware": "cpu"})
    assert load_run_config(f, [], world_size=2).prediction == pred
    assert load_run_config(f, ["train.lr=1e-3"], world_size=2, steps=3).prediction == pred   # train.* only
    for other in (["plan.reshard_after_forward=false"], ["workload.seq_len=32"], ["model=llama3-debug"]):
        assert load_run_config(f, other, world_size=2).prediction is None, other
    assert load_run_config(None, [], world_size=2).prediction is None


def test_versus_prediction_figures_and_line(tmp_path):
    from cost_models.specs import load_hardware
    from executor.summary import prediction_applies, prediction_line, versus_prediction
    pred = {"step_time_s": 0.5, "step_time_p90_s": 0.6, "peak_memory_gib": 0.25, "peak_memory_p90_gib": 0.3}
    v = versus_prediction(pred, 0.65, 2**28)["vs_plan"]
    assert v["step_time_error"] == pytest.approx(0.3) and v["peak_memory_error"] == pytest.approx(0.0)
    line = prediction_line({"vs_plan": v})
    assert "step 0.650 s measured / 0.500 s predicted (+30.0%, beyond the p90 bound 0.600 s)" in line, line
    assert "peak memory 256 MiB measured / 256 MiB predicted (+0.0%, within the p90 bound 307 MiB)" in line, line
    assert "titan-plan profile" in line and "titan-plan --trials N" in line and "\n" not in line
    fast = prediction_line(versus_prediction(pred, 0.45, None))
    assert "(-10.0%, within the p90 bound 0.600 s)" in fast and "profile" not in fast and "peak" not in fast
    assert versus_prediction(None, 0.65, None) == {} and prediction_line({}) is None
    # the hardware the prediction was made for: a preset name or a file path, as titan-plan was given it
    cpu, h100 = load_hardware("cpu"), load_hardware("h100-sxm")
    hw_file = tmp_path / "hw.yaml"
    hw_file.write_text(yaml.safe_dump({**cpu.to_dict(), "name": "cpu-here"}))
    for hw_key, ok in ((None, True), ("cpu", True), (str(hw_file), True)):
        f = write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2}, predicted=pred,
                       inputs={"hardware": hw_key or "cpu"}, **({"hardware": hw_key} if hw_key else {}))
        cfg = load_run_config(f, [], world_size=2)
        assert prediction_applies(cfg, load_hardware(hw_key or "cpu"), "cpu") is ok, hw_key
        assert not prediction_applies(cfg, load_hardware(hw_key or "cpu"), "cuda")   # another device kind
    f = write_plan(tmp_path, {"dp_shard": 2, "microbatch": 2}, predicted=pred, inputs={"hardware": "h100-sxm"})
    assert not prediction_applies(load_run_config(f, [], world_size=2), cpu, "cpu")   # made for an H100
    assert not prediction_applies(load_run_config(f, [], world_size=2), h100, "cpu")


@pytest.mark.distributed
def test_run_from_a_titan_plan_file_reports_against_its_prediction(tmp_path):
    plan_file = tmp_path / "plan.yaml"
    p = subprocess.run([sys.executable, "-m", "planner.cli", "--seq-len", "64", "--global-batch", "4", "--out",
                        str(plan_file)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    predicted = yaml.safe_load(plan_file.read_text())["predicted"]
    run_dir = tmp_path / "run"
    r = run(["--plan", str(plan_file), "--steps", "4", "--run-dir", str(run_dir)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    v = json.loads((run_dir / "summary.json").read_text())["vs_plan"]
    assert v["predicted_step_time_s"] == predicted["step_time_s"] and v["step_time_s"] > 0
    assert v["step_time_error"] == pytest.approx(v["step_time_s"] / predicted["step_time_s"] - 1)
    line = [x for x in r.stdout.splitlines() if x.startswith("titan-run: vs the plan: ")]
    assert len(line) == 1 and f"{v['predicted_step_time_s']:.3f} s predicted" in line[0], r.stdout
