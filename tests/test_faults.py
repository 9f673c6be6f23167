"""The test hooks of executor/faults.py: they fire only where the environment names them, once per run dir."""
import pytest

from executor import faults


def test_kill_due_names_rank_step_and_place_and_fires_once(tmp_path, monkeypatch):
    monkeypatch.delenv("TITAN_RUN_KILL", raising=False)
    assert not faults.kill_due(1, 3, tmp_path)                       # unset: never
    monkeypatch.setenv("TITAN_RUN_KILL", "1:3")
    assert not faults.kill_due(0, 3, tmp_path)                       # another rank
    assert not faults.kill_due(1, 2, tmp_path)                       # another step
    assert not faults.kill_due(1, 3, tmp_path, "save")               # "rank:step" means before the step
    assert faults.kill_due(1, 3, tmp_path)
    assert not faults.kill_due(1, 3, tmp_path)                       # the marker: not again after a restart
    monkeypatch.setenv("TITAN_RUN_KILL", "0:4:save")
    assert not faults.kill_due(0, 4, tmp_path)
    assert faults.kill_due(0, 4, tmp_path, "save")


def test_raise_if_fault(monkeypatch):
    monkeypatch.setenv("TITAN_RUN_FAULT", "1:2")
    faults.raise_if_fault(0, 2)
    faults.raise_if_fault(1, 1)
    with pytest.raises(RuntimeError, match=r"injected fault \(TITAN_RUN_FAULT=1:2\)"):
        faults.raise_if_fault(1, 2)
