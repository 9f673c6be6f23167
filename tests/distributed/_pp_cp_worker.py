"""Worker for the standalone PP / CP parity tests (launched with torchrun, gloo).

Every rank builds the same full model from the same seed, runs the same
single-process reference training (cheap: tiny model), then the parallel
version of one case, and rank 0 writes a JSON report to ``--out``:

* ``ring``:   ring attention fwd/bwd vs single-process SDPA (fp32 and bf16,
              MHA and GQA, cpu_flash and math kernels).
* ``pp``:     PP=world, one 5-step AdamW run per schedule in ``--schedules``.
* ``cp``:     CP=world, 5 steps.
* ``pp_cp``:  PP=2 x CP=world/2, 5 steps with ``--schedules[0]``.
* ``mix``:    ``--pp/--dp/--cp/--tp`` with ``--fsdp``, ``--ac``, ``--compile``:
              this repo's PP split/schedule and ring attention, with test-local
              TP+SP (+loss_parallel) and FSDP2 over dp x cp (independent of the
              executor's train loop, which tests/distributed/test_combinations.py covers).

Every case also reports the step-0 gradient difference and the parameter
difference after the 5 steps, by parameter FQN (so stage modules must keep the
model's names).  A failing rank writes ``<out>.rank<r>.err`` and exits at once,
so torchrun stops the others instead of leaving them hanging in P2P.

Usage: torchrun --standalone --nproc_per_node N _pp_cp_worker.py --case pp --out r.json
(the tests start it with tests/distributed/harness.py: launch_worker).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from cost_models.specs import load_model, model_from_dict  # noqa: E402
from executor.models.llama import Transformer  # noqa: E402
from executor.parallel.context_parallel import apply_cp, cp_shard_batch, head_tail_indices  # noqa: E402
from executor.parallel.pipeline import build_schedule, pipeline_split  # noqa: E402
from executor.parallel.ring_attention import ring_attention  # noqa: E402
from search_spaces.plan import Plan  # noqa: E402

STEPS = 5
LR = 3e-3
REF_GRADS: dict[str, torch.Tensor] = {}   # reference gradients of step 0, by FQN


# --------------------------------------------------------------------------- model / data / reference
def make_spec(name: str):
    if name == "tiny":
        return model_from_dict({"name": "tiny", "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                                "ffn_hidden": 128, "vocab_size": 128, "rope_theta": 10000.0})
    return load_model(name)


def init_model(spec, seed: int = 0) -> Transformer:
    """Deterministic init from init_rule; identical in every process."""
    torch.manual_seed(seed)
    model = Transformer(spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind, std = model.init_rule(name)
            if kind == "ones":
                p.fill_(1.0)
            elif kind == "zeros":
                p.zero_()
            elif kind == "normal":
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.copy_(torch.nn.init.trunc_normal_(torch.empty(p.shape), std=std, a=-3 * std, b=3 * std,
                                                    generator=g))
    return model


def make_data(spec, batch: int, seq: int, steps: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, spec.vocab_size, (steps, batch, seq + 1), generator=g)
    return data[:, :, :-1].contiguous(), data[:, :, 1:].contiguous()


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def reference_run(spec, tokens, labels, steps: int = STEPS, seed: int = 0):
    """Single-process AdamW run over the whole batch: (losses, final named params)."""
    model = init_model(spec, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for i in range(steps):
        loss = loss_fn(model(tokens[i]), labels[i])
        loss.backward()
        if i == 0:
            REF_GRADS.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def param_diff(named_local, ref_params) -> float:
    worst = 0.0
    for n, p in named_local:
        assert n in ref_params, f"parameter FQN {n} not in the reference model"
        worst = max(worst, (p.detach() - ref_params[n]).abs().max().item())
    return worst


def grad_diff(named_local) -> float:
    """Max |grad - reference grad| over the local parameters (DTensor grads are gathered)."""
    worst = 0.0
    for n, p in named_local:
        g = p.grad
        if g is None:
            raise AssertionError(f"parameter {n} has no gradient")
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        d = (g - REF_GRADS[n]).abs().max().item()
        if os.environ.get("PP_CP_DEBUG") and d > 1e-6:
            print(f"[rank {dist.get_rank()}] grad diff {n}: {d:.3g} (|ref| {REF_GRADS[n].abs().max():.3g}, "
                  f"ratio {(g.norm() / REF_GRADS[n].norm()).item():.4f})", flush=True)
        worst = max(worst, d)
    return worst


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def allreduce_grads(params, group):
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)


# --------------------------------------------------------------------------- cases
def case_ring(args):
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    rank = mesh.get_local_rank()
    results = []
    for kernel in ("cpu_flash", "math"):
        for dtype in (torch.float32, torch.bfloat16):
            for h, hk in ((4, 4), (4, 2), (4, 1)):
                for c in (4, 5):
                    g = torch.Generator().manual_seed(1000 + h * 10 + hk + c)
                    b, s, d = 2, 2 * cp * c, 16
                    q = torch.randn(b, h, s, d, generator=g)
                    k = torch.randn(b, hk, s, d, generator=g)
                    v = torch.randn(b, hk, s, d, generator=g)
                    dout = torch.randn(b, h, s, d, generator=g)
                    # reference: single-process causal SDPA (fp32) on the whole sequence
                    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
                    rep = h // hk
                    ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(rep, 1),
                                                         vr.repeat_interleave(rep, 1), is_causal=True)
                    ref.backward(dout)
                    pos = head_tail_indices(s, cp, rank)
                    ql, kl, vl = (t.index_select(2, pos).to(dtype).requires_grad_() for t in (q, k, v))
                    out = ring_attention(ql, kl, vl, group, kernel)
                    out.backward(dout.index_select(2, pos).to(dtype))
                    errs = {
                        "out": (out.float() - ref.detach().index_select(2, pos)).abs().max().item(),
                        "dq": (ql.grad.float() - qr.grad.index_select(2, pos)).abs().max().item(),
                        "dk": (kl.grad.float() - kr.grad.index_select(2, pos)).abs().max().item(),
                        "dv": (vl.grad.float() - vr.grad.index_select(2, pos)).abs().max().item(),
                    }
                    if dtype != torch.float32:  # single-process SDPA in the same dtype, for scale
                        qb, kb, vb = (t.to(dtype).requires_grad_() for t in (q, k, v))
                        ob = F.scaled_dot_product_attention(qb, kb.repeat_interleave(rep, 1),
                                                            vb.repeat_interleave(rep, 1), is_causal=True)
                        ob.backward(dout.to(dtype))
                        for name, a, r in (("out", ob, ref), ("dq", qb.grad, qr.grad), ("dk", kb.grad, kr.grad),
                                           ("dv", vb.grad, vr.grad)):
                            errs["base_" + name] = (a.float() - r.detach()).abs().max().item()
                    t = torch.tensor(list(errs.values()))
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    results.append({"kernel": kernel, "dtype": str(dtype).split(".")[-1], "heads": h,
                                    "kv_heads": hk, "chunk": c, "cp": cp,
                                    **dict(zip(errs.keys(), t.tolist()))})
    # meta tensors: shape inference path without communication
    qm = torch.empty(2, 4, 8, 16, device="meta", requires_grad=True)
    km = torch.empty(2, 2, 8, 16, device="meta", requires_grad=True)
    om = ring_attention(qm, km, km, group)
    om.sum().backward()
    meta_ok = om.shape == qm.shape and qm.grad.shape == qm.shape and om.device.type == "meta"
    return {"cases": results, "meta_ok": bool(meta_ok)}


def _pp_plan(schedule: str, pp: int, n_mb: int, mb: int) -> Plan:
    v = 1 if schedule in ("GPipe", "1F1B") else 2
    return Plan(pp=pp, schedule=schedule, stages_per_rank=v, n_microbatches=n_mb, microbatch=mb)


def case_pp(args, spec, tokens, labels, ref_losses, ref_params):
    pp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
    out = {}
    for schedule in args.schedules.split(","):
        plan = _pp_plan(schedule, pp, args.n_mb, args.batch // args.n_mb)
        full = init_model(spec)
        stages = pipeline_split(full, plan, mesh["pp"])
        del full
        runner = build_schedule(stages, plan, mesh["pp"], loss_fn, "cpu")
        params = [p for _, m in stages for p in m.parameters()]
        opt = torch.optim.AdamW(params, lr=LR)
        positions = torch.arange(tokens.shape[-1])
        losses, times = [], []
        for i in range(STEPS):
            t0 = time.perf_counter()
            loss = runner.step(tokens[i], labels[i], positions)
            if i == 0:
                gd = grad_diff([(n, p) for _, m in stages for n, p in m.named_parameters()])
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item() if loss is not None else None)
        named = [(n, p) for _, m in stages for n, p in m.named_parameters()]
        pd = torch.tensor([param_diff(named, ref_params)])
        dist.all_reduce(pd, op=dist.ReduceOp.MAX)
        gathered = [None] * pp
        dist.all_gather_object(gathered, losses)
        losses = next(l for l in gathered if l[0] is not None)
        fqns = [None] * pp
        dist.all_gather_object(fqns, sorted(n for _, m in stages for n, _ in m.named_parameters()))
        n_fqn = len(set(sum(fqns, [])))
        out[schedule] = {"losses": losses, "param_diff": pd.item(), "grad_diff": max_over_ranks(gd),
                         "step_s": times,
                         "stage_ids": [s for s, _ in stages], "n_fqns": n_fqn,
                         "n_ref_fqns": len(ref_params)}
        dist.barrier()
    return out


def case_cp(args, spec, tokens, labels, ref_losses, ref_params):
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    model = init_model(spec)
    apply_cp(model, mesh["cp"])
    if args.compile:
        for block in model.layers.values():
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, times = [], []
    for i in range(STEPS):
        t0 = time.perf_counter()
        tok, lab, pos = cp_shard_batch(tokens[i], labels[i], mesh["cp"])
        loss = loss_fn(model(tok, pos), lab)
        loss.backward()
        allreduce_grads(model.parameters(), mesh["cp"].get_group())
        if i == 0:
            gd = grad_diff(model.named_parameters())
        opt.step()
        opt.zero_grad()
        l = loss.detach().clone()
        dist.all_reduce(l, op=dist.ReduceOp.AVG)
        losses.append(l.item())
        times.append(time.perf_counter() - t0)
    pd = torch.tensor([param_diff(model.named_parameters(), ref_params)])
    dist.all_reduce(pd, op=dist.ReduceOp.MAX)
    return {"cp": {"losses": losses, "param_diff": pd.item(), "grad_diff": max_over_ranks(gd), "step_s": times}}


def case_pp_cp(args, spec, tokens, labels, ref_losses, ref_params):
    world = dist.get_world_size()
    pp, cp = 2, world // 2
    mesh = init_device_mesh("cpu", (pp, cp), mesh_dim_names=("pp", "cp"))
    schedule = args.schedules.split(",")[0]
    plan = Plan(pp=pp, cp=cp, schedule=schedule, stages_per_rank=1 if schedule in ("GPipe", "1F1B") else 2,
                n_microbatches=args.n_mb, microbatch=args.batch // args.n_mb)
    full = init_model(spec)
    stages = pipeline_split(full, plan, mesh["pp"])
    del full
    for _, m in stages:
        apply_cp(m, mesh["cp"])
    runner = build_schedule(stages, plan, mesh["pp"], loss_fn, "cpu")
    params = [p for _, m in stages for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    losses, times = [], []
    for i in range(STEPS):
        t0 = time.perf_counter()
        tok, lab, pos = cp_shard_batch(tokens[i], labels[i], mesh["cp"])
        loss = runner.step(tok, lab, pos)
        allreduce_grads(params, mesh["cp"].get_group())
        if i == 0:
            gd = grad_diff([(n, p) for _, m in stages for n, p in m.named_parameters()])
        opt.step()
        opt.zero_grad()
        if loss is not None:
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["cp"].get_group())
            loss = loss.item()
        losses.append(loss)
        times.append(time.perf_counter() - t0)
    named = [(n, p) for _, m in stages for n, p in m.named_parameters()]
    pd = torch.tensor([param_diff(named, ref_params)])
    dist.all_reduce(pd, op=dist.ReduceOp.MAX)
    gathered = [None] * world
    dist.all_gather_object(gathered, losses)
    losses = next(l for l in gathered if l[0] is not None)
    return {f"pp_cp_{schedule}": {"losses": losses, "param_diff": pd.item(), "grad_diff": max_over_ranks(gd),
                                  "step_s": times}}


def apply_tp_for_test(module, tp_mesh):
    """TP + sequence parallel + loss_parallel layout (the TORCH_ON_CPU.md idiom), for the mix case."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    top = {}
    if module.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if module.norm is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(module, tp_mesh, top)
    for block in module.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def _checkpoint_block(block):
    """Full activation checkpointing of one block without changing parameter FQNs (test-local)."""
    from torch.utils.checkpoint import checkpoint
    fwd = block.forward
    block.forward = lambda *a, **k: checkpoint(fwd, *a, use_reentrant=False, **k)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def case_mix(args, spec, tokens, labels, ref_losses, ref_params):
    """PP x DP(FSDP) x CP x TP with this repo's PP/CP modules and a test-local TP/FSDP setup."""
    import contextlib

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    pp, dp, cp, tp = args.pp, args.dp, args.cp, args.tp
    assert pp * dp * cp * tp == dist.get_world_size()
    mesh = init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    schedule = args.schedules.split(",")[0]
    n_mb = args.n_mb
    local_batch = tokens.shape[1] // dp
    plan = Plan(pp=pp, dp_shard=dp, cp=cp, tp=tp, schedule=schedule,
                stages_per_rank=1 if schedule in ("GPipe", "1F1B") else 2,
                n_microbatches=n_mb if pp > 1 else 1, microbatch=local_batch // (n_mb if pp > 1 else 1),
                compile=args.compile, reshard_after_forward=not args.no_reshard)
    full = init_model(spec)
    stages = pipeline_split(full, plan, mesh["pp"]) if pp > 1 else [(0, full)]
    for _, m in stages:
        if tp > 1:
            apply_tp_for_test(m, mesh["tp"])
        if cp > 1:
            apply_cp(m, mesh["cp"])
        if args.ac:
            for block in m.layers.values():
                _checkpoint_block(block)
        if args.compile:
            for block in m.layers.values():
                block.compile()
        if args.fsdp:
            for block in m.layers.values():
                fully_shard(block, mesh=dp_cp, reshard_after_forward=plan.reshard_after_forward)
            fully_shard(m, mesh=dp_cp, reshard_after_forward=plan.reshard_after_forward)
    ctx = loss_parallel if tp > 1 else contextlib.nullcontext
    runner = build_schedule(stages, plan, mesh["pp"], loss_fn, "cpu", step_context=ctx) if pp > 1 else None
    params = [p for _, m in stages for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    dp_rank = mesh["dp"].get_local_rank()
    losses, times = [], []
    for i in range(STEPS):
        t0 = time.perf_counter()
        tok = tokens[i][dp_rank * local_batch:(dp_rank + 1) * local_batch]
        lab = labels[i][dp_rank * local_batch:(dp_rank + 1) * local_batch]
        if cp > 1:
            tok, lab, pos = cp_shard_batch(tok, lab, mesh["cp"])
        else:
            pos = torch.arange(tok.shape[1])
        if runner is not None:
            loss = runner.step(tok, lab, pos)
        else:
            with ctx():
                loss = loss_fn(stages[0][1](tok, pos), lab)
                loss.backward()
            loss = _full(loss.detach())
        if not args.fsdp and dp * cp > 1:
            allreduce_grads(params, dp_cp.get_group())
        if i == 0:
            gd = grad_diff([(n, p) for _, m in stages for n, p in m.named_parameters()])
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item() if loss is not None else 0.0, 1.0 if loss is not None else 0.0],
                         dtype=torch.float64)
        dist.all_reduce(t)
        losses.append((t[0] / t[1]).item())
        times.append(time.perf_counter() - t0)
    named = [(n, _full(p.detach())) for _, m in stages for n, p in m.named_parameters()]
    pd = max_over_ranks(param_diff(named, ref_params))
    name = f"pp{pp}_dp{dp}_cp{cp}_tp{tp}" + ("_fsdp" if args.fsdp else "") + ("_compile" if args.compile else "") \
        + ("_ac" if args.ac else "")
    return {name: {"losses": losses, "param_diff": pd, "grad_diff": max_over_ranks(gd), "step_s": times,
                   "schedule": schedule}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=("ring", "pp", "cp", "pp_cp", "mix"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama3-debug")
    ap.add_argument("--schedules", default="GPipe,1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--n-mb", type=int, default=4)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--ac", action="store_true")
    ap.add_argument("--no-reshard", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(1)
    if os.environ.get("PP_CP_DUMP_AFTER"):  # debugging hangs: dump every thread's stack, then exit
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["PP_CP_DUMP_AFTER"]), exit=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    t0 = time.perf_counter()
    result: dict = {"torch": torch.__version__, "world": dist.get_world_size()}
    try:
        if args.case == "ring":
            result.update(case_ring(args))
        else:
            spec = make_spec(args.model)
            tokens, labels = make_data(spec, args.batch, args.seq)
            ref_losses, ref_params = reference_run(spec, tokens, labels)
            result["ref_losses"] = ref_losses
            fn = {"pp": case_pp, "cp": case_cp, "pp_cp": case_pp_cp, "mix": case_mix}[args.case]
            result["runs"] = fn(args, spec, tokens, labels, ref_losses, ref_params)
    except Exception:
        # a failing rank reports and exits at once; torchrun then stops the others (no hang)
        err = traceback.format_exc()
        print(err, file=sys.stderr, flush=True)
        with open(f"{args.out}.rank{dist.get_rank()}.err", "w") as f:
            f.write(err)
        os._exit(1)
    result["wall_s"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()

