"""Workload ``tp_activations: sharded`` on the spmd_types backend: TP blocks keep sequence shards.

Megatron's sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2): instead of the
all-gathered ``[b, s, dim]`` inputs of the attention and feed-forward blocks, each rank keeps its
sequence shard and all-gathers it again in backward (``spmd_tensor_parallel._KeepShards``).
The re-gathered tensor is bitwise the forward's, so a sharded run's losses and gradient norms
equal the gathered run's exactly, and both match the single-process run within 1e-4.  A
fake-process-group case counts the bytes one block saves for backward (unique storages seen by
``saved_tensors_hooks``, parameters left out) in both regimes: sharded saves
``2 x [b, s, dim] x (tp - 1) / tp`` fewer, the cost model's FULL -> SEQ term
(``cost_models.activations.layer_activation_terms``), and both totals are the cost model's
to the byte once the rotary tables the block saves are added (the cost model leaves them out); torch's
MemTracker (every live storage) shows the step's peak lower by about that much per block.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.distributed._tools.mem_tracker import MemTracker

from cost_models.activations import FULL, FULL_TP, SEQ, SEQ_TP, SHARD, layer_activation_terms
from cost_models.specs import load_model
from cost_models.workload import Workload
from executor.mesh import build_meshes
from executor.parallel import spmd_step
from executor.parallel.fsdp import spmd_fsdp_supported
from executor.parallel.parallelize import Precision, build_model_parts
from search_spaces.plan import Plan
from tests.distributed.harness import in_fresh_process, ROOT, assert_matches_single_process, env, run_on_its_backend

needs_spmd = pytest.mark.skipif(spmd_fsdp_supported() is not None, reason=str(spmd_fsdp_supported()))
SHARDED = {"workload.tp_activations": "sharded"}
LAYOUTS = {"tp2": Plan(tp=2, microbatch=4), "dp2xtp2": Plan(dp_shard=2, tp=2, microbatch=2),
           "cp2xtp2": Plan(cp=2, tp=2, microbatch=4),     # the ring attention inside the attention module
           # the zero-bubble schedule: backward split into an input- and a weight-gradient step (graph retained)
           "pp2xtp2_zbv": Plan(pp=2, tp=2, microbatch=1, n_microbatches=4, schedule="ZBVZeroBubble",
                               stages_per_rank=2)}


_RUNS: dict = {}


def _run(layout: str, tp_activations: str):
    """The layout's run on spmd_types (no fallback note), within 1e-4 of one process (with the same workload)."""
    if tp_activations == "gathered":
        return run_on_its_backend(LAYOUTS[layout])      # shared with test_spmd_tp.py in one session
    if layout not in _RUNS:
        run, _ = assert_matches_single_process(LAYOUTS[layout], extra=SHARDED)
        assert "backend spmd_types" in run.proc.stdout and "note: backend" not in run.proc.stderr, run.proc.stderr
        _RUNS[layout] = run
    return _RUNS[layout]


@needs_spmd
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2", *(pytest.param(k, marks=pytest.mark.slow) for k in LAYOUTS if k != "tp2")])
def test_sharded_matches_single_process_and_equals_gathered(layout):
    sharded = _run(layout, "sharded")           # within 1e-4 of one process (run_on_its_backend)
    gathered = _run(layout, "gathered")
    assert sharded.losses == gathered.losses, (sharded.losses, gathered.losses)
    assert sharded.grad_norms == gathered.grad_norms, (sharded.grad_norms, gathered.grad_norms)


# --------------------------------------------------------------------------- bytes saved by one block (fake PG)
B, S, TP = 2, 64, 2


def _saved_bytes_case(tp_activations: str) -> dict:
    """llama3-debug at tp 2 on a fake process group (rank 0 of 2), fp32, micro-batch B of S tokens: the bytes of
    the unique storages block 0 saves for backward, parameters (and their views) left out; then a
    typechecked step of the same model, which must run under the spmd_types checker."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # test-only fake process group
    dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
    plan = Plan(tp=TP, microbatch=B)
    meshes = build_meshes(plan, "cpu")
    wl = Workload(seq_len=S, global_batch=B, dtype="fp32", tp_activations=tp_activations)
    model = build_model_parts(load_model("llama3-debug"), plan, meshes, precision=Precision(torch.float32,
                              torch.float32), backend="spmd_types", device=torch.device("cpu"), workload=wl)[0][1]
    storages: dict = {}

    def pack(t):
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):          # parameters and their views (w.t()) are not saved
            st = t.untyped_storage()
            storages[(st.data_ptr(), str(t.device))] = st.nbytes()
        return t

    counting = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    block = model.layers["0"]
    pre = block.register_forward_pre_hook(lambda mod, args: counting.__enter__())
    post = block.register_forward_hook(lambda mod, args, out: counting.__exit__(None, None, None))
    tok = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    model(tok).sum().backward()          # the block's backward unpacks what it kept (re-gathers under sharded)
    pre.remove(), post.remove()
    tracker = MemTracker()        # every storage alive (weakref-tracked), not only what autograd saved
    tracker.track_external(model)
    with tracker:
        model(tok).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    loss = spmd_step.forward_backward(model, tok, tok.roll(-1, 1), meshes, plan, typecheck=True)
    return {"saved": sum(storages.values()), "peak": peak, "finite": bool(torch.isfinite(loss))}


def _in_fresh_process(tp_activations: str) -> dict:
    return in_fresh_process(_saved_bytes_case, tp_activations)


def _analytic_block_bytes(tp_activations: str) -> float:
    """The cost model's bytes one block keeps per rank for the case above (no AC, eager, fp32)."""
    t = layer_activation_terms(load_model("llama3-debug"), Workload(seq_len=S, global_batch=B, dtype="fp32",
                               tp_activations=tp_activations), False, "none", False)
    return B * S * ((t[SEQ] + t[SHARD] + t[SEQ_TP]) / TP + t[FULL] + t[FULL_TP])


@needs_spmd
def test_sharded_saves_the_sequence_shards_of_the_gathered_inputs():
    gathered, sharded = _in_fresh_process("gathered"), _in_fresh_process("sharded")
    assert gathered["finite"] and sharded["finite"]
    dim, fp32 = load_model("llama3-debug").dim, 4
    expected = 2 * B * S * dim * fp32 * (TP - 1) // TP          # the attention's and the FFN's inputs
    assert gathered["saved"] - sharded["saved"] == expected, (gathered, sharded, expected)
    assert _analytic_block_bytes("gathered") - _analytic_block_bytes("sharded") == expected
    for mode, got in (("gathered", gathered), ("sharded", sharded)):
        # the cost model leaves out the rotary tables the block saves (cos / sin, fp32 [s, head_dim / 2] each:
        # 0.6% of the block here); the norms' per-token rstd it counts
        rotary = 2 * S * (load_model("llama3-debug").head_dim // 2) * fp32
        assert got["saved"] == _analytic_block_bytes(mode) + rotary, (mode, got)
    # the step's peak lies in backward, with some blocks' saved tensors freed and one re-gathered tensor (and its
    # flat gather buffer) in flight: lower by 6 of the 8 gathered inputs' savings here, at least half is asked.
    # It fails when anything keeps the gathered tensors alive (the pack hook's object did: peak above gathered's)
    layers = load_model("llama3-debug").n_layers
    assert gathered["peak"] - sharded["peak"] >= layers * expected // 2, (gathered, sharded)


def test_unknown_tp_activations_value_is_refused():
    from executor.parallel.spmd_tensor_parallel import apply_spmd_tp
    with pytest.raises(ValueError, match=r"tp_activations 'half' \(allowed: 'gathered', 'sharded'\)"):
        apply_spmd_tp(torch.nn.Module(), None, tp_activations="half")


@needs_spmd
def test_dry_run_builds_the_sharded_regime(tmp_path):
    # titan-run --dry-run builds the model as a run does (workload included): its FakeTensor step peak drops
    peaks = {}
    for mode in ("gathered", "sharded"):
        f = tmp_path / f"{mode}.yaml"
        f.write_text(yaml.safe_dump({"model": "llama3-debug", "plan": {"dp_shard": 4, "tp": 2, "microbatch": 2},
                                     "workload": {"seq_len": 256, "global_batch": 8, "tp_activations": mode}}))
        r = subprocess.run([sys.executable, "-m", "executor.cli", "--dry-run", "--plan", str(f), "--json", "--memory"],
                           capture_output=True, text=True, timeout=600, env=env(), cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        peaks[mode] = json.loads(r.stdout.strip().splitlines()[-1])["ranks"][0]["memory_estimate"]["act"]
    per_tensor = 2 * 256 * load_model("llama3-debug").dim * 2 // 2        # bf16 [b, s, dim] x (tp - 1) / tp
    assert peaks["gathered"] - peaks["sharded"] >= load_model("llama3-debug").n_layers * per_tensor, peaks
