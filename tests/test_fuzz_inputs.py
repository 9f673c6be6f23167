"""The CI slice of bench/fuzz_inputs.py: a few hundred generated bad inputs, in-process (< 60 s).

Every 7th generated case, plus every non-YAML file and every ``--out`` target: each bad
input must end in exactly one ``error:`` line and exit code 2 (or, for ``--out`` onto a
symlink, be written through the link), with no traceback, no hang and nothing clobbered;
the valid controls must be accepted.  The long run is ``python bench/fuzz_inputs.py``.
"""
from __future__ import annotations

from bench import fuzz_inputs as fuzz

FILE_GROUPS = ("--out target", "model file, not YAML", "hardware file, not YAML", "space file, not YAML",
               "calibration file, not YAML", "plan file, not YAML", "model file (titan-run), not YAML")


def ci_cases() -> list:
    every = fuzz.all_cases(sample=1, combos=600, seed=0)
    controls = [c for c in every if not c.bad]
    files = [c for c in every if c.bad and c.group in FILE_GROUPS]
    rest = [c for c in every if c.bad and c.group not in FILE_GROUPS][::7]
    return controls + files + rest


def test_generated_bad_inputs_are_refused_in_one_line():
    cases = ci_cases()
    assert sum(c.bad for c in cases) >= 300
    results = [fuzz.run_in_process(c) for c in cases]
    fails = [(r.case.group, r.case.name, r.outcome, r.detail) for r in results if not fuzz.passed(r)]
    assert not fails, fails[:10]
    counts = {o: sum(r.outcome == o for r in results if r.case.bad) for o in fuzz.OUTCOMES}
    assert counts["traceback"] == counts["hang"] == counts["clobbered"] == counts["accepted"] == 0
    assert sum(not r.case.bad and r.outcome == "accepted" for r in results) == sum(not c.bad for c in cases)
    # the symlink --out case writes through the link; the others are refused
    out = {r.case.name: r.outcome for r in results if r.case.group == "--out target"}
    assert out["symlink to a plan file"] == fuzz.THROUGH
    assert out["device node"] == out["pipe"] == out["folder"] == fuzz.GOOD


def test_the_classifier_can_fail():
    """A traceback, a second line or exit 0 are not counted as refusals."""
    case = fuzz.Case("g", "n", "plan", [])
    assert fuzz.classify(case, 2, "titan-plan: error: x\n") == (fuzz.GOOD, "titan-plan: error: x")
    assert fuzz.classify(case, 2, "titan-plan: error: x\nmore\n")[0] == "several lines"
    assert fuzz.classify(case, 1, "Traceback (most recent call last):\n  File x\nKeyError: 'a'\n")[0] == "traceback"
    assert fuzz.classify(case, 0, "")[0] == "accepted"
    assert fuzz.classify(case, None, "")[0] == "hang"
