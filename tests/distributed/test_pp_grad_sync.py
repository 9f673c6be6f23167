"""Workload ``pp_grad_sync: every_microbatch`` in titan-run: FSDP reduce-scatters each micro-batch's gradients
under a pipeline (the Llama 3 paper's "our use of FSDP ... shards optimizer states and gradients", Sec. 3.3.2)
instead of accumulating unsharded fp32 gradients until the last micro-batch (torch.distributed.pipelining).

Real gloo processes through the real ``titan-run``: PP 2 x FSDP 2 matches one process per step (loss and grad
norm within 1e-4 relative) on both backends; the dry run (FSDP2's own hooks on FakeTensors, MemTracker) shows
the gradients held sharded between micro-batches and a lower step peak; the split-backward schedules are
refused in one line before any process starts.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from executor.parallel.fsdp import spmd_fsdp_supported
from search_spaces.plan import Plan
from tests.distributed.harness import ROOT, assert_matches_single_process, env, run_titan, titan_run_cmd

EVERY = {"workload.pp_grad_sync": "every_microbatch"}
needs_spmd = pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))


def _plan(schedule: str, backend: str = "spmd_types") -> Plan:
    v = 2 if schedule == "Interleaved1F1B" else 1
    return Plan(pp=2, dp_shard=2, schedule=schedule, stages_per_rank=v, n_microbatches=2, microbatch=1,
                backend=backend)


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("schedule, backend", [
    ("1F1B", "spmd_types"),
    pytest.param("Interleaved1F1B", "spmd_types", marks=pytest.mark.slow),
    pytest.param("1F1B", "dtensor", marks=pytest.mark.slow),
    pytest.param("GPipe", "dtensor", marks=pytest.mark.slow),
])
def test_every_microbatch_sync_matches_single_process(schedule, backend):
    run, _ = assert_matches_single_process(_plan(schedule, backend), extra=EVERY)
    assert f"backend {backend}" in run.proc.stdout, run.proc.stdout[-2000:]
    assert run.proc.stderr.strip() == "", run.proc.stderr[-2000:]


# counts FSDP2's gradient reductions (one foreach_reduce per FSDP unit and reduction; its collective may be
# gloo's reduce-scatter or titan-run's direct exchange, fsdp.GlooReduceScatter) in each worker process
COUNT_HOOK = """
import os
if os.environ.get("LOCAL_RANK") is not None and os.environ.get("PPG_COUNT_DIR"):
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as _group   # private in torch 2.14
    _orig = _group.foreach_reduce
    def _counted(*args, **kwargs):
        with open(os.path.join(os.environ["PPG_COUNT_DIR"], os.environ["LOCAL_RANK"]), "a") as f:
            f.write("x")
        return _orig(*args, **kwargs)
    _group.foreach_reduce = _counted
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_every_microbatch_reduce_scatters_each_microbatch(tmp_path):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(COUNT_HOOK)
    plan = Plan(pp=2, dp_shard=2, schedule="1F1B", n_microbatches=4, microbatch=1)
    counts = {}
    for sync in ("last_microbatch", "every_microbatch"):
        out = tmp_path / sync
        out.mkdir()
        run_titan(plan, steps=2, extra={"workload.pp_grad_sync": sync},
                  extra_env={"PYTHONPATH": f"{tmp_path / 'hook'}", "PPG_COUNT_DIR": str(out)})
        counts[sync] = {f.name: len(f.read_text()) for f in out.iterdir()}
    assert sorted(counts["last_microbatch"]) == ["0", "1", "2", "3"], counts
    for rank, n in counts["last_microbatch"].items():
        assert n > 0 and n % 2 == 0, counts                         # one reduce-scatter per FSDP unit per step
        assert counts["every_microbatch"][rank] == 4 * n, counts    # ... per micro-batch (4) instead


def _dry_run(tmp_path, grad_sync: str) -> dict:
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({
        "model": "llama3-debug", "workload": {"seq_len": 64, "global_batch": 8},
        "plan": {"dp_shard": 2, "pp": 2, "schedule": "1F1B", "n_microbatches": 4, "microbatch": 1}}))
    cmd = titan_run_cmd("--dry-run", "--plan", str(plan_file), "--memory", "--json",
                         "--ranks", "0", "--set", f"workload.pp_grad_sync={grad_sync}")
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rank,) = json.loads(proc.stdout)["ranks"]
    return rank


def test_every_microbatch_keeps_gradients_sharded_in_the_dry_run(tmp_path):
    last, every = _dry_run(tmp_path, "last_microbatch"), _dry_run(tmp_path, "every_microbatch")
    # gradient bytes held through the step: unsharded (the stage's whole gradient) vs this rank's FSDP shard
    assert every["grads_bytes"] * 2 == last["grads_bytes"], (every["grads_bytes"], last["grads_bytes"])
    m_last, m_every = last["memory_estimate"], every["memory_estimate"]
    assert m_every["sharded_grad"] == every["params_bytes"], m_every     # reduce-scattered into the fp32 shard
    assert m_last.get("sharded_grad", 0.0) == 0.0, m_last                # nothing reduced before the last one
    # and FSDP reshards the parameters after each micro-batch's backward instead of keeping them gathered
    assert m_every["unsharded_param"] < m_last["unsharded_param"], (m_every, m_last)
    assert m_every["total"] < m_last["total"], (m_every["total"], m_last["total"])


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_split_backward_schedules_are_refused_in_one_line(tmp_path, schedule):
    n_mb = 4 if schedule == "DualPipeV" else 2
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({
        "model": "llama3-debug", "workload": {"seq_len": 64, "global_batch": 8, "pp_grad_sync": "every_microbatch"},
        "plan": {"dp_shard": 2, "pp": 2, "schedule": schedule, "stages_per_rank": 2, "n_microbatches": n_mb,
                 "microbatch": 8 // (2 * n_mb)}}))
    proc = subprocess.run(titan_run_cmd("--plan", str(plan_file), "--run-dir", str(tmp_path / "run")), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'pp_grad_sync'" in lines[0] and schedule in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()
