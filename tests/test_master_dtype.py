"""Workload key ``master_dtype``: the megatron layout's optimizer copy of the parameters in fp32 (default) or bf16
(Apex's DistributedFusedAdam with dtype bf16, as NVIDIA's DGX Cloud Nemotron-4 340B benchmark configures NeMo)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from cost_models.coefficients import Coefficients
from cost_models.estimate import estimate
from cost_models.specs import SpecError, load_hardware, load_model
from cost_models.workload import Workload
from planner.cli import main
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import load_bench

vr = load_bench("validate_reference")
GIB = 2 ** 30


def _optimizer_bytes(**kw) -> float:
    wl = Workload(seq_len=4096, global_batch=64, state_layout="megatron", zero=1, **kw)
    t = CandidateTable.from_plans([Plan(dp_shard=8, tp=8, pp=1, microbatch=1, n_microbatches=8)])
    est = estimate(t, load_model("llama3-70b"), load_hardware("h100-sxm"), wl, Coefficients())
    return float(est.memory["optimizer"][0])


def test_a_bf16_copy_holds_two_bytes_per_parameter_of_the_shard():
    fp32, bf16 = _optimizer_bytes(), _optimizer_bytes(master_dtype="bf16")
    assert fp32 / bf16 == pytest.approx((4 + 8) / (2 + 8))
    both = _optimizer_bytes(master_dtype="bf16", moment_dtype="bf16")
    assert fp32 / both == pytest.approx((4 + 8) / (2 + 4))     # Apex DistributedFusedAdam dtype bf16: 6 bytes


def test_only_the_megatron_layout_has_a_separate_copy():
    with pytest.raises(SpecError, match="workload key 'master_dtype' is 'bf16' with state_layout 'fsdp2'"):
        Workload(seq_len=64, global_batch=4, master_dtype="bf16")


def test_flag_plan_file_and_json_echo(tmp_path, capsys):
    q = ["estimate", "--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-sxm", "--seq-len", "4096",
         "--global-batch", "64", "--tp", "8", "--state-layout", "megatron", "--zero", "1", "--json"]
    assert main([*q, "--master-dtype", "bf16"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["master_dtype"] == "bf16" and doc["inputs"]["workload"]["master_dtype"] == "bf16"
    assert main(q) == 0
    plain = json.loads(capsys.readouterr().out)
    assert doc["predicted"]["memory_gib"]["optimizer"] < plain["predicted"]["memory_gib"]["optimizer"]
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-70b", "hardware": "h100-sxm", "plan": {"dp_shard": 8, "tp": 8},
                                 "workload": {"seq_len": 4096, "global_batch": 64, "state_layout": "megatron",
                                              "zero": 1, "master_dtype": "bf16"}}))
    assert main(["estimate", "--plan", str(f), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["master_dtype"] == "bf16"


def test_titan_run_refuses_it_in_one_line(tmp_path):
    from executor.config import ConfigError, load_run_config   # lazy: the cost-model tests stay torch-free
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-debug", "plan": {"dp_shard": 2, "microbatch": 2},
                                 "workload": {"seq_len": 64, "global_batch": 4, "master_dtype": "bf16"}}))
    with pytest.raises((ConfigError, SpecError)) as ei:
        load_run_config(str(f), [], world_size=2)
    assert "master_dtype" in str(ei.value) and "\n" not in str(ei.value)


def test_dgx_cloud_nemotron4_340b_fits_with_its_stated_optimizer_and_recompute():
    """128 H100 (TP 8 x PP 8 x DP 2, VP 12): the benchmark's config runs selective recompute with a bf16 optimizer
    state; with an fp32 master copy and moments the same layout would not fit, and without recompute neither."""
    row = next(r for r in vr.load_extra_rows() if r["id"] == "dgxc_v25.01_nemotron4-340b_bf16_128gpu")
    case = vr.build_case(row)
    assert (case.plan.ac, case.workload.master_dtype, case.workload.moment_dtype) == ("selective", "bf16", "bf16")
    pred = vr.predict(case)
    assert pred["fits"] and abs(pred["tokens_per_s_per_gpu"] / 222.1 - 1) < 0.10
    fp32 = dataclasses.replace(case, workload=dataclasses.replace(case.workload, master_dtype="fp32", moment_dtype="fp32"))
    assert not vr.predict(fp32)["fits"]
