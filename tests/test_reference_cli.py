"""Every scored published row is a `titan-plan estimate` command line (bench/validate_reference.py's
`cli_args`): the public CLI, given the row's flags (model and hardware as presets or YAML files), predicts
what the validator scores, row by row, in both sets.  Nothing the validator applies is out of a user's reach."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import yaml

from cost_models.specs import load_model
from planner.cli import main as planner_main
from tests.cost_model_helpers import load_bench, planner_cli

vr = load_bench("validate_reference")


def _cli_predicts(case, folder) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = planner_main(vr.cli_args(case, folder) + ["--json"])
    assert rc == 0, (case.id, vr.cli_args(case, folder))
    return json.loads(out.getvalue())


@pytest.mark.parametrize("which", vr.SETS)
def test_each_scored_row_through_the_cli_gets_the_validators_prediction(which, tmp_path):
    if which == "shared" and not (vr.reference_dir() / "published_runs.yaml").is_file():
        pytest.skip("shared reference data not found (set TITAN_REFERENCE_DIR)")
    cases, _ = vr.build_cases(vr.load_set(which))
    checked = 0
    for case in cases:
        want = vr.predict(case)
        doc = _cli_predicts(case, tmp_path)
        assert vr.Plan.from_dict(doc["plan"], runnable=False).describe() == case.plan.describe(), case.id
        got = doc["predicted"]
        # --json rounds tokens/s to 0.01 and memory to 0.001 GiB
        assert got["tokens_per_s_per_gpu"] == pytest.approx(want["tokens_per_s_per_gpu"], rel=1e-4, abs=0.01), case.id
        assert got["peak_memory_gib"] == pytest.approx(want["device_peak_gib"], abs=2e-3), case.id
        assert (got["headroom_gib"] >= 0) == want["fits"], case.id
        checked += 1
    assert checked == len(cases) and checked > (20 if which == "shared" else 200), checked


def test_layouts_only_titan_run_cannot_run_are_predicted_with_a_note(tmp_path):
    """Tied embeddings under tp/pp (BLOOM) and more virtual stages than layers (Zero Bubble's interleaved 1F1B):
    other frameworks ran them, so estimate predicts them and says in one line why titan-run cannot."""
    spec = load_model("llama3-debug").to_dict()          # 4 layers
    tied = tmp_path / "tied.yaml"
    tied.write_text(yaml.safe_dump({**spec, "name": "tied-debug", "tie_embeddings": True}))
    base = ["estimate", "--hardware", "h100-sxm", "--gpus", "8", "--seq-len", "256", "--global-batch", "16", "--json"]
    for extra, words in ((["--model", str(tied), "--tp", "2"], "ties its embeddings"),
                         (["--model", "llama3-debug", "--pp", "2", "--schedule", "Interleaved1F1B",
                           "--stages-per-rank", "3"], "> 4 layers")):
        r = planner_cli(*base, *extra)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["titan_run_can_run"] is False and "titan-run cannot run this layout" in doc["note"], doc["note"]
        assert words in doc["note"] and doc["predicted"]["tokens_per_s_per_gpu"] > 0, doc["note"]
    # pipeline ranks without any layer stay illegal
    r = planner_cli(*base, "--model", "llama3-debug", "--pp", "8")
    assert r.returncode == 2 and "layout is not legal" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
