"""cost_models/specs.py: the workload's validated regime keys."""
from __future__ import annotations

import pytest

from cost_models.specs import SpecError
from cost_models.workload import Workload


def test_workload_regime_keys_are_validated():
    with pytest.raises(SpecError, match="selective_ac"):
        Workload(seq_len=8, global_batch=1, selective_ac="some")
    with pytest.raises(SpecError, match="attention_impl"):
        Workload(seq_len=8, global_batch=1, attention_impl="flash")
    with pytest.raises(SpecError, match="dropout"):
        Workload(seq_len=8, global_batch=1, dropout=1)
