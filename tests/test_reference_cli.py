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


# every row of each set; the CI run takes every 4th row of the extra set (its ~370 rows cost ~30 s here), the
# slow run all of them
_ROWS = [pytest.param(w, 1, id=w, marks=[pytest.mark.slow] if w == "extra" else []) for w in vr.SETS]
_ROWS.append(pytest.param("extra", 4, id="extra-every-4th"))


@pytest.mark.parametrize("which,stride", _ROWS)
def test_each_scored_row_through_the_cli_gets_the_validators_prediction(which, stride, tmp_path):
    if which == "shared" and not (vr.reference_dir() / "published_runs.yaml").is_file():
        pytest.skip("shared reference data not found (set TITAN_REFERENCE_DIR)")
    cases, _ = vr.build_cases(vr.load_set(which))
    cases = cases[::stride]
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
    assert checked == len(cases) and checked > (20 if which == "shared" else 200 // stride), checked


def test_layouts_only_titan_run_cannot_run_are_predicted_with_a_note(tmp_path):
    """More virtual stages than layers (Zero Bubble's interleaved 1F1B): other frameworks ran it, so estimate
    predicts it and says in one line why titan-run cannot."""
    base = ["estimate", "--hardware", "h100-sxm", "--gpus", "8", "--seq-len", "256", "--global-batch", "16", "--json"]
    for extra, words in ((["--model", "llama3-debug", "--pp", "2", "--schedule", "Interleaved1F1B",
                           "--stages-per-rank", "3"], "> 4 layers"),):
        r = planner_cli(*base, *extra)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["titan_run_can_run"] is False and "titan-run cannot run this layout" in doc["note"], doc["note"]
        assert words in doc["note"] and doc["predicted"]["tokens_per_s_per_gpu"] > 0, doc["note"]
    # pipeline ranks without any layer stay illegal
    r = planner_cli(*base, "--model", "llama3-debug", "--pp", "8")
    assert r.returncode == 2 and "layout is not legal" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# the plan flags a regime sets (`Framework.plan_defaults`), by plan key
_PLAN_FLAG = {"compile": ("--compile", "--no-compile"), "reshard_after_forward": ("--reshard", "--no-reshard"),
              "schedule": ("--schedule",), "stages_per_rank": ("--stages-per-rank",)}


def _without_regime_flags(argv: list[str], keys) -> list[str]:
    out, skip = [], False
    flags = {f for k in keys for f in _PLAN_FLAG[k]}
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in flags:
            skip = a in ("--schedule", "--stages-per-rank")      # those take a value
            continue
        out.append(a)
    return out


def test_a_regimes_plan_keys_need_no_flags(tmp_path):
    """A published row asked with `--framework NAME` and without the plan keys that framework's runs set (compile
    for Megatron's fused kernels; the Llama 3 paper's interleaved schedule, one-unit chunks and no resharding) gets
    the validator's plan and prediction: the CLI fills them in as the validator does."""
    rows = {r["id"]: r for r in vr.load_extra_rows()}
    ids = ["llama3paper_t4_405B_8192gpu_seq8k", "llama3paper_t4_405B_16384gpu_seq8k",
           "llama3paper_t4_405B_16384gpu_seq128k", "mtnlg_530B_2240gpu", "dgxc_v25.01_gpt3-175b_bf16_128gpu",
           "torchtitan_T5_405B_512gpu_1F1B", "torchtitan_perf202404_llama3_8B_64gpu_lb1_ac_selective_op"]
    for rid in ids:
        row = rows[rid]
        case = vr.build_case(row)
        fw = vr.get_framework(vr.FRAMEWORK_OF[row["framework"]])
        keys = [k for k, v in fw.plan_defaults({"pp": case.plan.pp}, case.model.n_layers).items()
                if getattr(case.plan, k) == v]
        assert keys, rid
        argv = _without_regime_flags(vr.cli_args(case, tmp_path), keys) + ["--framework", fw.name, "--json"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert planner_main(argv) == 0, (rid, argv)
        doc = json.loads(out.getvalue())
        assert vr.Plan.from_dict(doc["plan"], runnable=False).describe() == case.plan.describe(), rid
        assert doc["predicted"]["tokens_per_s_per_gpu"] == pytest.approx(
            vr.predict(case)["tokens_per_s_per_gpu"], rel=1e-4, abs=0.01), rid
        assert any(n.startswith(("compile not given", "schedule not given", "reshard not given"))
                   for n in doc["knob_notes"]), rid
