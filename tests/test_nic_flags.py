"""The inter-node network of a cluster by flag: --nic-gbps / --gpus-per-nic (and a plan file's ``inputs.nic_gbps`` /
``inputs.gpus_per_nic``) replace the hardware spec's NICs, as a hardware YAML with those keys does, e.g. BLOOM's Jean
Zay (four 100 Gb/s Omni-Path links per 8-GPU node) on the stock a100-80g preset."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from cost_models.specs import load_hardware
from planner.cli import main

Q = ["estimate", "--model", "llama3-70b", "--gpus", "64", "--hardware", "a100-80g", "--tp", "8", "--pp", "2",
     "--dp-shard", "4", "--seq-len", "2048", "--global-batch", "512", "--ac", "full", "--json"]


def _run(args, capsys) -> dict:
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_the_flags_are_the_hardware_files_keys(tmp_path, capsys):
    spec = {k: v for k, v in vars(load_hardware("a100-80g")).items() if v is not None}
    spec.update(name="a100-80g-opa", nic_gbps=100.0, gpus_per_nic=2.0)
    spec.pop("inter_node_bw_gbs")
    spec["efficiency"], spec["gpu_names"] = dict(spec["efficiency"]), list(spec["gpu_names"])
    f = tmp_path / "opa.yaml"
    f.write_text(yaml.safe_dump(spec))
    stock = _run(Q, capsys)
    flags = _run([*Q, "--nic-gbps", "100", "--gpus-per-nic", "2"], capsys)
    filed = _run([*Q[:6], str(f), *Q[7:]], capsys)
    # the same figures; a renamed spec is one no published run validates, the preset with other NICs is not
    assert filed["predicted"].pop("not_validated") == ["hardware a100-80g-opa"]
    assert flags["predicted"].pop("not_validated") == []
    assert flags["predicted"] == filed["predicted"]
    # a quarter of the per-GPU inter-node bandwidth (25 -> 6.25 GB/s): the DP and pipeline traffic cost more
    assert flags["predicted"]["time_s"]["dp_comm"] > 3 * stock["predicted"]["time_s"]["dp_comm"]
    assert flags["inputs"]["nic_gbps"] == 100.0 and flags["inputs"]["gpus_per_nic"] == 2.0
    assert stock["inputs"]["nic_gbps"] == 200.0 and stock["inputs"]["gpus_per_nic"] == 1.0
    # one flag alone keeps the spec's other one
    assert _run([*Q, "--nic-gbps", "200"], capsys)["predicted"] == stock["predicted"]


def test_the_plan_file_keeps_the_network(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["--model", "llama3-70b", "--gpus", "64", "--hardware", "a100-80g", "--nic-gbps", "100",
                 "--gpus-per-nic", "2", "--out", str(out)]) == 0
    assert "a 100 Gb/s NIC per 2" in capsys.readouterr().out
    doc = yaml.safe_load(out.read_text())
    assert doc["inputs"]["nic_gbps"] == 100.0 and doc["inputs"]["gpus_per_nic"] == 2.0
    again = _run(["estimate", "--plan", str(out), "--json"], capsys)
    flags = _run(["estimate", "--plan", str(out), "--json", "--nic-gbps", "100", "--gpus-per-nic", "2"], capsys)
    assert again["predicted"] == flags["predicted"]
    stock = _run(["estimate", "--plan", str(out), "--json", "--nic-gbps", "200", "--gpus-per-nic", "1"], capsys)
    assert stock["predicted"]["step_time_s"] < again["predicted"]["step_time_s"]


@pytest.mark.parametrize("args, says", [
    (["--nic-gbps", "0"], "--nic-gbps (or the plan file's inputs.nic_gbps) must be a positive number"),
    (["--nic-gbps", "nan"], "must be a positive number"),
    (["--gpus-per-nic", "-2"], "--gpus-per-nic (or the plan file's inputs.gpus_per_nic) must be a positive number"),
    (["--hardware", "cpu", "--gpus-per-nic", "2"], "--gpus-per-nic needs --nic-gbps: hardware 'cpu' gives no NIC"),
])
def test_bad_values_are_refused_in_one_line(args, says):
    p = subprocess.run([sys.executable, "-m", "planner.cli", "estimate", "--gpus", "4", "--hardware", "a100-80g",
                        *args], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and says in p.stderr
