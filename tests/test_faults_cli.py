"""Faults of the environment end in one line (exit 2), with real processes: a read-only run dir, a multi-node
launch without a rendezvous endpoint.  The whole fault-injection suite is bench/fault_suite.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.distributed.harness import ROOT, env, titan_run_cmd


def _plan(tmp_path: Path) -> str:
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-debug", "workload": {"seq_len": 64, "global_batch": 4},
                                 "plan": {"dp_shard": 2, "microbatch": 2},
                                 "train": {"steps": 2, "tensorboard": False}}))
    return str(f)


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder writes into fail with EROFS (root: a read-only tmpfs) or EACCES (others: mode 0555)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(d)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"running as root and cannot mount a read-only tmpfs: {r.stderr.strip()}")
        yield d, "read-only file system"
        subprocess.run(["umount", str(d)], check=False)
    else:
        d.chmod(0o555)
        yield d, "permission denied"
        d.chmod(0o755)


def test_read_only_run_dir_is_one_line_exit_2(tmp_path, read_only_dir):
    d, problem = read_only_dir
    run_dir = d / "run"
    tmp = tmp_path / "tmp"          # the temp dir of the run: the once-per-node markers go there
    tmp.mkdir()
    p = subprocess.run(titan_run_cmd("--plan", _plan(tmp_path), "--nproc-per-node", "2", "--run-dir", str(run_dir)),
                       cwd=ROOT, env={**env(), "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1, p.stderr                                  # once, not per rank; no torchrun dump
    assert lines[0].startswith("titan-run: error:") and str(run_dir) in lines[0] and problem in lines[0], lines[0]
    assert "Traceback" not in p.stdout + p.stderr
    assert not list(tmp.glob("titan-run-error-*"))                    # the launcher removed the marker
    assert not list(tmp.glob("torchelastic_*")) and not list(tmp.glob("titan-run-elastic-*"))   # and its log dir


def test_nnodes_2_without_rdzv_endpoint_is_refused(tmp_path):
    p = subprocess.run(titan_run_cmd("--plan", _plan(tmp_path), "--nproc-per-node", "1", "--nnodes", "2",
                                     "--run-dir", str(tmp_path / "run")),
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "--rdzv-endpoint" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()


def test_unresolvable_rdzv_host_is_refused(tmp_path):
    p = subprocess.run(titan_run_cmd("--plan", _plan(tmp_path), "--nproc-per-node", "1", "--nnodes", "2",
                                     "--rdzv-endpoint", "no-such-host.invalid:29400",
                                     "--run-dir", str(tmp_path / "run")),
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "does not resolve" in lines[0], p.stderr
