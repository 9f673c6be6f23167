"""The spmd_types backend is real: FSDP2 storage from spmd-typed params, and the checker catches a bad loss."""
from __future__ import annotations

import pytest

from executor.parallel.fsdp import spmd_fsdp_supported
from tests.distributed.harness import launch_worker

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))]


def test_spmd_fsdp_typechecks_and_rejects_an_unreduced_loss():
    r = launch_worker("_spmd_worker.py", 2, timeout=300)
    assert "Shard(dim=0)" in r["placements"]
    assert r["typed_backward_ok"]
    assert r["untyped_backward"].startswith("SpmdTypeError") and "Varying loss" in r["untyped_backward"]
