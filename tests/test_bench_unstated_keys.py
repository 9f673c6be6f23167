"""bench/bench_unstated_keys.py on the project's own set (bench/reference_extra.yaml, which a checkout always
has; ../shared may be absent): with every workload key kept it reproduces the validation exactly; with the
basic keys only, rows whose framework sets other keys move; a bad --keys value is refused in one line."""
from __future__ import annotations

import pytest

from cost_models.workload import Workload
from tests.cost_model_helpers import load_bench

bench = load_bench("bench_unstated_keys")


@pytest.mark.slow      # (~20 s; tests/test_reference_cli.py checks the CLI against the validator in CI)
def test_all_keys_kept_is_the_validation_itself():
    r = bench.score("extra", tuple(Workload.__dataclass_fields__))
    assert r["full"] == r["cut"] and r["fit"][0] == r["fit"][1] and not r["differ"]
    assert all(d == 0 for d, *_ in r["moved"])


def test_basic_keys_move_the_rows_whose_framework_sets_more():
    r = bench.score("extra", bench.BASIC)
    assert r["differ"]["tp_comm_overlap"] > 0                 # the rows that state TP overlap
    assert r["moved"][0][0] > 0.05                            # at least one row moves by more than 5 points
    assert r["fit"][1] < r["fit"][0]                          # and some memory verdicts rest on those keys


def test_unknown_key_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--keys", "seq_len,sequnce_parallel"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "unknown workload key 'sequnce_parallel'" in err[-1]
