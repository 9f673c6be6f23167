"""The parity harness itself (in-process): its tolerance is relative and per step, and the reference
cache tells spec files apart by content."""
from __future__ import annotations

import pytest

from tests.distributed.harness import _model_key, assert_close_per_step


def test_per_step_check_is_relative_and_names_the_step():
    assert_close_per_step([10.0, 2.0], [10.0 + 9e-4, 2.0 - 1.9e-4])          # 0.9e-4 and 0.95e-4 relative
    with pytest.raises(AssertionError, match=r"step 2: grad norm 2\.0 vs reference 2\.00021"):
        assert_close_per_step([10.0, 2.0], [10.0, 2.00021], what="grad norm")
    with pytest.raises(AssertionError, match="3 loss values vs 2"):
        assert_close_per_step([1.0, 1.0, 1.0], [1.0, 1.0])
    assert_close_per_step([1.0 + 5e-7], [1.0], rtol=1e-6)
    with pytest.raises(AssertionError):
        assert_close_per_step([1.0 + 2e-6], [1.0], rtol=1e-6)


def test_reference_cache_key_follows_the_spec_file_content(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("dim: 64\n")
    a = _model_key(str(f))
    assert _model_key(str(f)) == a
    f.write_text("dim: 128\n")
    assert _model_key(str(f)) != a
    assert _model_key("llama3-debug") == ("llama3-debug",)
