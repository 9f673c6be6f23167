"""The FFN's down projection saves its input as a recipe (``executor/models/layers.py`` `rebuilt_input`): with
``rebuild_product`` on, the SwiGLU product (or the GELU output) is not kept for backward but rebuilt from gate and up
(the GELU input), which the activation keeps anyway.  Gradients are bitwise the same; the product's storage is freed
after forward; the executor turns it on exactly for eager blocks without activation checkpointing."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import yaml

from cost_models.estimate import estimate
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from executor.models.layers import FeedForward
from executor.models.moe import GroupedExperts
from executor.parallel.parallelize import set_rebuild_product


def _run(module, x, *args):
    x = x.detach().clone().requires_grad_(True)
    out = module(x, *args)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_bitwise_the_plain_ones(kind, dtype):
    torch.manual_seed(0)
    plain = FeedForward(64, 176, kind).to(dtype)
    rebuilt = copy.deepcopy(plain)
    rebuilt.rebuild_product = True
    x = torch.randn(2, 24, 64, dtype=dtype)
    a, b = _run(plain, x), _run(rebuilt, x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


@pytest.mark.parametrize("rebuild", [False, True])
def test_the_product_is_freed_after_forward(rebuild):
    """The down projection's input (the product) outlives the forward only when it is saved as is."""
    ff = FeedForward(32, 96)
    ff.rebuild_product = rebuild
    seen = []
    ff.w2.register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0])))
    out = ff(torch.randn(4, 8, 32, requires_grad=True))
    assert (seen[0]() is None) == rebuild
    out.sum().backward()                      # and backward still runs
    assert ff.w2.weight.grad is not None


def test_the_experts_grouped_path_rebuilds_bitwise():
    torch.manual_seed(1)
    plain = GroupedExperts(4, 32, 48)
    for w in (plain.w1, plain.w2, plain.w3):
        torch.nn.init.normal_(w, std=0.2)
    rebuilt = copy.deepcopy(plain)
    rebuilt.rebuild_product = True
    counts = torch.tensor([5, 0, 9, 6])
    x = torch.randn(20, 32)
    a, b = _run(plain, x, counts), _run(rebuilt, x, counts)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_off_under_no_grad_and_compile_and_checkpointing():
    """No graph, no recipe; the executor sets it only where blocks are eager and not checkpointed."""
    ff = FeedForward(16, 48)
    ff.rebuild_product = True
    with torch.no_grad():
        ff(torch.randn(2, 16))                # nothing saved, nothing to intercept
    root = torch.nn.ModuleDict({"a": FeedForward(16, 48), "b": torch.nn.ModuleDict({"c": GroupedExperts(2, 16, 8)})})
    set_rebuild_product(root, True)
    assert root["a"].rebuild_product and root["b"]["c"].rebuild_product
    set_rebuild_product(root, False)
    assert not root["a"].rebuild_product and not root["b"]["c"].rebuild_product


_DTENSOR_SCRIPT = r"""
import copy, os, socket, weakref
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from executor.models.layers import FeedForward
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
base = FeedForward(32, 96)
res = {}
for rebuild in (False, True):
    ff = copy.deepcopy(base)
    ff.rebuild_product = rebuild
    parallelize_module(ff, mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
    seen = []
    ff.w2.register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0])))
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = ff(x)
    alive = seen[0]() is not None
    out.sum().backward()
    res[rebuild] = (out.detach(), x.grad, [p.grad.full_tensor() for p in ff.parameters()], alive)
assert res[False][3] and not res[True][3], "the DTensor over the product is freed only with the rebuild"
assert torch.equal(res[False][0], res[True][0]) and torch.equal(res[False][1], res[True][1])
assert all(torch.equal(a, b) for a, b in zip(res[False][2], res[True][2]))
dist.destroy_process_group()
print("OK")
"""


def test_dtensor_tp_rebuilds_its_rowwise_input():
    """Under DTensor TP, torch's RowwiseParallel wraps the local product in a DTensor whose local tensor aliases
    it: that DTensor is rebuilt too (one gloo process, world 1: a real process group, not a mock)."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _DTENSOR_SCRIPT], cwd=root, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-2000:]


def _dry_run_act(tmp_path, swiglu_impl: str) -> tuple[float, float]:
    """The FakeTensor dry run's activation bytes and the cost model's, on rank 0 of a 2-rank FSDP plan."""
    plan = Plan(dp_shard=2, microbatch=2, n_microbatches=1)
    workload = {"seq_len": 256, "global_batch": 4, "dtype": "fp32", "swiglu_impl": swiglu_impl}
    f = tmp_path / f"plan_{swiglu_impl}.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-debug", "workload": workload, "plan": plan.to_dict()}))
    r = subprocess.run([sys.executable, "-m", "executor.cli", "--dry-run", "--plan", str(f), "--json", "--memory"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])["ranks"][0]
    est = estimate(CandidateTable.from_plans([plan]), load_model("llama3-debug"), load_hardware("cpu"),
                   Workload(**workload))
    return float(row["memory_estimate"]["act"]), float(est.memory["activations"][0])


def test_a_plan_keeping_the_product_runs_without_the_rebuild(tmp_path):
    """`workload: swiglu_impl: fused` (keep gate, up and their product) turns the rebuild off in the executor, as the
    memory model reads it; `auto` rebuilds on eager blocks without recompute.  The dry run's activations differ
    by the kept products, as the model's do: one FFN-width tensor per layer, less the one the rebuilding
    backward makes again at the peak (the last layer's, when the backward starts)."""
    auto_run, auto_model = _dry_run_act(tmp_path, "auto")
    kept_run, kept_model = _dry_run_act(tmp_path, "fused")
    spec = load_model("llama3-debug")
    product = 2 * 256 * spec.ffn_hidden * 4                          # micro-batch 2 x seq 256, fp32
    assert kept_run - auto_run == pytest.approx((spec.n_layers - 1) * product, rel=0.05)
    assert kept_model - auto_model == pytest.approx(kept_run - auto_run, rel=0.05)
