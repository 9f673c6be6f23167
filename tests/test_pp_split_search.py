"""titan-plan searches the pipeline split (workload ``pp_split``) when the question states none: each split is
scored as a workload of its own, the one whose best candidate is fastest is chosen and written to the plan file,
and a split stated by flag, plan file or --framework regime is searched alone."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

import search_spaces

from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from planner.cli import main
from planner.rank import plan_candidates
from search_spaces.space import load_space

Q405 = ["--model", "llama3-405b", "--gpus", "16384", "--hardware", "h100-sxm", "--seq-len", "8192",
        "--global-batch", "2048"]
# The dense space with the loop-placement schedules only: the V placement puts the first and the last stage on
# rank 0, so there the weighted split changes no rank's load (with the V schedules both splits' best tie).
LOOP_ONLY = ("GPipe", "1F1B", "Interleaved1F1B")


def loop_space():
    space = load_space("dense")
    return dataclasses.replace(space, knobs={**space.knobs, "schedule": list(LOOP_ONLY)})


@pytest.fixture(scope="module")
def searched():
    model, hw, space = load_model("llama3-405b"), load_hardware("h100-sxm"), loop_space()
    wl = Workload(seq_len=8192, global_batch=2048)
    run = lambda splits: plan_candidates(space, model, hw, wl, world_size=16384, pp_splits=splits)  # noqa: E731
    return run(("layers", "weighted")), run(("layers",)), run(("weighted",))


def test_the_search_is_each_split_alone_then_the_fastest_best(searched):
    both, layers, weighted = searched
    best = {r.workload.pp_split: float(r.step_time()[r.best()]) for r in (layers, weighted)}
    assert both.split_best == pytest.approx(best)
    alone = min((layers, weighted), key=lambda r: float(r.step_time()[r.best()]))
    assert both.workload.pp_split == alone.workload.pp_split
    assert both.table.plan(both.best()) == alone.table.plan(alone.best())
    assert both.n_candidates == alone.n_candidates


def test_llama3_405b_on_16384_gpus_picks_the_weighted_split(searched):
    """126 layers under the loop placement: the layers-only split allows at most 126 stages, the weighted one 128
    (the embedding and the head a stage each), and its best pipeline is faster than any the even split allows."""
    both, layers, _ = searched
    assert both.workload.pp_split == "weighted"
    assert both.split_best["weighted"] < both.split_best["layers"]
    assert (layers.table.pp * layers.table.stages_per_rank).max() <= 126
    assert (both.table.pp * both.table.stages_per_rank).max() == 128


def test_no_pipeline_no_second_search():
    res = plan_candidates(load_space("dense"), load_model("llama3-debug"), load_hardware("cpu"),
                          Workload(seq_len=256, global_batch=8, dtype="fp32"), world_size=1,
                          pp_splits=("layers", "weighted"))
    assert res.split_best == {} and res.workload.pp_split == "layers"


def test_cli_writes_the_chosen_split_and_says_so(tmp_path, capsys):
    out, space = tmp_path / "plan.yaml", tmp_path / "loop.yaml"
    doc = yaml.safe_load((Path(search_spaces.__file__).parent / "dense.yaml").read_text())
    space.write_text(yaml.safe_dump({**doc, "name": "loop", "knobs": {**doc["knobs"], "schedule": list(LOOP_ONLY)}}))
    q = [*Q405, "--space", str(space)]
    assert main([*q, "--out", str(out), "--top", "1"]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.startswith("pipeline split: "))
    assert line.startswith("pipeline split: weighted") and "layers: best step" in line
    assert yaml.safe_load(out.read_text())["workload"]["pp_split"] == "weighted"
    assert main([*q, "--json", "--no-write", "--top", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pp_split"]["chosen"] == "weighted" and set(doc["pp_split"]["best_step_s"]) == {"layers", "weighted"}


@pytest.mark.parametrize("stated, want", [(["--pp-split", "layers"], "layers"),
                                          (["--framework", "megatron-deepspeed"], "layers"),   # GPTModelPipe's default
                                          (["--framework", "llama3-meta"], "weighted")])       # the paper's split
def test_a_stated_split_is_searched_alone(tmp_path, capsys, stated, want):
    out = tmp_path / "plan.yaml"
    assert main([*Q405, *stated, "--json", "--out", str(out), "--top", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "pp_split" not in doc
    assert yaml.safe_load(out.read_text())["workload"]["pp_split"] == want


def test_a_plan_files_split_is_searched_alone(tmp_path, capsys):
    q = tmp_path / "q.yaml"
    q.write_text(yaml.safe_dump({"model": "llama3-405b", "hardware": "h100-sxm", "inputs": {"gpus": 16384},
                                 "plan": {"dp_shard": 256, "pp": 8, "tp": 8},
                                 "workload": {"seq_len": 8192, "global_batch": 2048, "pp_split": "layers"}}))
    out = tmp_path / "plan.yaml"
    assert main(["--plan", str(q), "--json", "--out", str(out), "--top", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "pp_split" not in doc and yaml.safe_load(out.read_text())["workload"]["pp_split"] == "layers"
