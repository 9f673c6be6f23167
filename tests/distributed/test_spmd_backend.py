"""The spmd_types backend is real: FSDP2 storage from spmd-typed params, and the checker catches a bad loss."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from executor.parallel.fsdp import spmd_fsdp_supported
from tests.distributed.harness import ROOT, env

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))]


def test_spmd_fsdp_typechecks_and_rejects_an_unreduced_loss(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "distributed" / "_spmd_worker.py"), "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert "Shard(dim=0)" in r["placements"]
    assert r["typed_backward_ok"]
    assert r["untyped_backward"].startswith("SpmdTypeError") and "Varying loss" in r["untyped_backward"]
