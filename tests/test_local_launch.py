"""executor/launch.py run_local: titan-run starts one node's workers itself (no torchrun agent) and ends every
failure the way its torchrun path does."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from executor import launch
from executor.faults import EXIT_PEER_FAILED

from tests.distributed.harness import ROOT
from tests.distributed.harness import env as _env


def test_failure_line_blames_the_first_rank_that_failed_on_its_own():
    t = 100.0
    line = launch.failure_line({0: (EXIT_PEER_FAILED, 0, 11, t), 1: (1, 1, 12, t + 1), 2: (-9, 2, 13, t + 2)}, 4)
    assert line == "titan-run: error: rank 1 (local rank 1, pid 12) exited with code 1; 3 rank(s) of this node failed"
    line = launch.failure_line({3: (-int(signal.SIGKILL), 3, 14, t)}, 4)
    assert "rank 3 (local rank 3, pid 14) was killed by SIGKILL" in line
    # only peers that gave up: the ranks that never failed are named
    line = launch.failure_line({0: (EXIT_PEER_FAILED, 0, 11, t), 2: (EXIT_PEER_FAILED, 2, 13, t)}, 3)
    assert line.startswith("titan-run: error: rank 0 gave up waiting in a collective for rank(s) 1 (stopped or hung?)")


def test_worker_environment_is_torchruns_standalone_one():
    env = launch.local_worker_env(4, 29555)
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "TORCHELASTIC_RESTART_COUNT")} == {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env      # rank 0 hosts the store
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(launch.REPO_ROOT)


@pytest.mark.skipif(any(os.path.exists(n) for n in launch.GPU_DEVICE_NODES), reason="a GPU host imports torch")
def test_the_launcher_of_a_cpu_run_never_imports_torch(tmp_path):
    """The launcher counts GPUs, reads the plan and starts the workers without torch (seconds a run): checked on
    a real 2-process run, from inside the launcher when it starts the workers."""
    probe = (
        "import sys\n"
        "import executor.launch as L\n"
        "real = L.run_local\n"
        "def run_local(n, a):\n"
        "    print('TORCH_IN_LAUNCHER', 'torch' in sys.modules, flush=True)\n"
        "    return real(n, a)\n"
        "L.run_local = run_local\n"
        "from executor.cli import main\n"
        "sys.exit(main())\n")
    plan = tmp_path / "p.yaml"
    plan.write_text(yaml.safe_dump({"model": "llama3-debug", "workload": {"seq_len": 32, "global_batch": 2},
                                    "plan": {"dp_shard": 2, "microbatch": 1},
                                    "train": {"steps": 1, "tensorboard": False, "profile_step": 0}}))
    p = subprocess.run([sys.executable, "-c", probe, "--plan", str(plan), "--run-dir", str(tmp_path / "run")],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TORCH_IN_LAUNCHER False" in p.stdout
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


@pytest.mark.distributed
def test_sigterm_to_the_launcher_stops_every_worker_in_one_line(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text(yaml.safe_dump({"model": "llama3-debug", "workload": {"seq_len": 32, "global_batch": 2},
                                    "plan": {"dp_shard": 2, "microbatch": 1},
                                    "train": {"steps": 100000, "tensorboard": False, "profile_step": 0}}))
    p = subprocess.Popen([sys.executable, "-m", "executor.cli", "--plan", str(plan), "--run-dir",
                          str(tmp_path / "run")], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "metrics.jsonl").exists():     # training: the workers are up
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        workers = _children(p.pid)
        assert len(workers) == 2, workers
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, out + err
    assert "titan-run: stopped by SIGTERM; the workers were stopped" in err.splitlines()
    assert not [w for w in workers if Path(f"/proc/{w}").exists()], "a worker outlived the launcher"
