"""`titan-run` from the outside: help, bad input (exit 2, one line), self-test, a short run, a failing rank."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from executor.config import ConfigError, load_run_config
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
    ({"pp": 8, "n_microbatches": 8, "microbatch": 4, "dp_shard": 1}, None, 8, "pp*stages_per_rank = 8 > 4 layers"),
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
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "error"
