"""Memory audit: the analytic per-rank memory model against the executor's own dry run.

For flagship layouts (llama3-405b TP 8 x PP 16 with V 1, 2, 4 on 8,192-16,384 ranks; llama3-70b
TP 8 x PP 4 / 8; deepseek-v3-671b PP 16 x EP 64 on 2,048; mixtral-8x7b with EP) this runs
``titan-run --dry-run`` (fake process group, meta device, the plan applied as a real run applies
it) on the first, the last and the busiest pipeline rank and prints, per rank, the exact fp32
parameter, gradient and AdamW bytes next to `cost_models.memory.memory_by_rank`'s figures for the
same pipeline rank.  With ``--step`` it also runs the FakeTensor step estimate (``--memory``) of the
layouts marked cheap and compares the whole peak with the model's live-tensor figure (no caching
allocator, no NCCL buffers: what the tracker counts).  (Before executor/dry_run_step.py gave DTensor's
sharding propagation a fake mode of its own, the tracker also counted that propagation's global-shape
tensors: up to tp times the real temporaries.)

Usage: python bench/bench_memory_audit.py [--step] [--only NAME] ; the headline line is printed last.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.coefficients import Coefficients  # noqa: E402
from cost_models.layout import RANKS, rank_index  # noqa: E402
from cost_models.memory import memory_by_rank  # noqa: E402
from cost_models.specs import load_hardware, load_model  # noqa: E402
from cost_models.workload import Workload  # noqa: E402
from search_spaces.plan import Plan  # noqa: E402
from search_spaces.table import CandidateTable  # noqa: E402

GIB = 2 ** 30
STATE = (("params", "params_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes"))


def _plan(**kw) -> dict:
    base = dict(dp_replicate=1, dp_shard=1, pp=1, tp=1, cp=1, ep=1, microbatch=1, n_microbatches=1,
                schedule="1F1B", stages_per_rank=1, ac="full", reshard_after_forward=True, compile=False,
                float8=False, backend="dtensor")
    return {**base, **kw}


# (name, model, hardware, workload, plan, FakeTensor step affordable here)
LAYOUTS = [
    ("405B tp8 pp16 V1 16384 (Llama 3 Table 4)", "llama3-405b", "h100-sxm", dict(seq_len=8192, global_batch=2048),
     _plan(dp_shard=128, pp=16, tp=8, n_microbatches=16, ac="none"), True),
    ("405B tp8 pp16 V1 8192 (32 micro-batches)", "llama3-405b", "h100-sxm", dict(seq_len=8192, global_batch=2048),
     _plan(dp_shard=64, pp=16, tp=8, n_microbatches=32, ac="none"), True),
    ("405B tp8 pp16 V2 8192", "llama3-405b", "h100-sxm", dict(seq_len=8192, global_batch=2048),
     _plan(dp_shard=64, pp=16, tp=8, n_microbatches=32, schedule="Interleaved1F1B", stages_per_rank=2, ac="none"), False),
    ("405B tp8 pp16 V4 16384", "llama3-405b", "h100-sxm", dict(seq_len=8192, global_batch=2048),
     _plan(dp_shard=128, pp=16, tp=8, n_microbatches=16, schedule="Interleaved1F1B", stages_per_rank=4), False),
    ("405B tp8 pp8 fsdp8 512 (TorchTitan T5)", "llama3-405b", "h100-96g-500w", dict(seq_len=8192, global_batch=256),
     _plan(dp_shard=8, pp=8, tp=8, microbatch=4, n_microbatches=8), False),
    ("70B tp8 pp4 256", "llama3-70b", "h100-sxm", dict(seq_len=8192, global_batch=256),
     _plan(dp_shard=8, pp=4, tp=8, n_microbatches=32), True),
    ("70B tp8 pp8 V2 512", "llama3-70b", "h100-sxm", dict(seq_len=8192, global_batch=512),
     _plan(dp_shard=8, pp=8, tp=8, n_microbatches=64, schedule="Interleaved1F1B", stages_per_rank=2), False),
    ("DeepSeek-V3 pp16 ep64 2048 DualPipeV", "deepseek-v3-671b", "h800", dict(seq_len=4096, global_batch=15360),
     _plan(dp_shard=128, pp=16, ep=64, n_microbatches=120, schedule="DualPipeV", stages_per_rank=2, ac="none"), False),
    ("Mixtral 8x7B pp4 ep8 128", "mixtral-8x7b", "h100-sxm", dict(seq_len=4096, global_batch=256),
     _plan(dp_shard=32, pp=4, ep=8, n_microbatches=8), False),
    ("8B pp2 fsdp4 8 (tp 1: step peak)", "llama3-8b", "h100-sxm", dict(seq_len=8192, global_batch=8),
     _plan(dp_shard=4, pp=2, n_microbatches=2, ac="full"), True),
]


def dry_run(model, hardware, workload, plan, ranks, memory: bool) -> dict:
    doc = {"model": model, "hardware": hardware, "workload": {**workload, "dtype": "bf16"}, "plan": plan}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(doc, f)
    cmd = [sys.executable, "-m", "executor.dry_run", "--plan", f.name, "--ranks", ",".join(map(str, ranks)), "--json"]
    out = subprocess.run(cmd + (["--memory"] if memory else []), capture_output=True, text=True, timeout=3600,
                         cwd=Path(__file__).resolve().parents[1])
    Path(f.name).unlink()
    line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode or not line:
        raise RuntimeError(f"dry run failed ({out.returncode}): {(out.stderr or line).strip().splitlines()[-1:]}")
    return json.loads(line)


def audit(name, model_name, hw_name, workload, plan_kw, step: bool) -> list[dict]:
    model, hw, wl = load_model(model_name), load_hardware(hw_name), Workload(**workload)
    plan = Plan(**plan_kw)
    table = CandidateTable.from_plans([plan])
    ana = memory_by_rank(table, model, wl, Coefficients(), hw=hw)
    # the FakeTensor tracker counts live tensors (no caching allocator, no NCCL buffers): the same model
    # with the allocated-bytes semantics of a CPU run
    live = memory_by_rank(table, model, wl, Coefficients(), caching_allocator=False)
    per_stage = plan.world_size // plan.pp
    pp_rank = {w: int(rank_index(table, model, w, wl.pp_weighted)[0]) for w in RANKS}
    ranks = sorted({r * per_stage for r in pp_rank.values()})
    t0 = time.perf_counter()
    doc = dry_run(model_name, hw_name, workload, plan_kw, ranks, memory=step)
    by_global = {r["rank"]: r for r in doc["ranks"]}
    rows = []
    for w in RANKS:
        d = by_global[pp_rank[w] * per_stage]
        row = {"layout": name, "rank": f"{w} (pp {pp_rank[w]})", "dry_s": time.perf_counter() - t0}
        for key, dkey in STATE:
            row[key] = (float(ana[w][key][0]), float(d[dkey]))
        if step and "memory_estimate" in d:
            row["peak"] = (float(sum(live[w][k][0] for k in live[w])), float(d["memory_estimate"]["total"]))
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step", action="store_true", help="also the FakeTensor step peak of the layouts marked cheap")
    ap.add_argument("--only", help="run the layouts whose name contains this (case-insensitive)")
    args = ap.parse_args()
    chosen = [x for x in LAYOUTS if not args.only or args.only.lower() in x[0].lower()]
    if not chosen:
        ap.error(f"--only {args.only!r} matches no layout (names: {', '.join(x[0] for x in LAYOUTS)})")
    rows = []
    for name, m, h, wl, plan, cheap in chosen:
        rows += audit(name, m, h, wl, plan, step=args.step and cheap)
    print(f"{'layout':40s} {'rank':14s} " + " ".join(f"{k + ' ana/dry GiB':>24s}" for k, _ in STATE)
          + f" {'peak ana/FakeTensor':>22s}")
    worst_state, worst_peak = (-1.0, ""), (0.0, "")
    for r in rows:
        cells = []
        for k, _ in STATE:
            a, d = r[k]
            err = abs(a - d) / d * 100 if d else 0.0
            cells.append(f"{a / GIB:8.2f}/{d / GIB:8.2f} {err:5.1f}%")
            if err > worst_state[0]:
                worst_state = (err, f"{r['layout']} {r['rank']} {k}")
        peak = ""
        if "peak" in r:
            a, d = r["peak"]
            err = (a - d) / d * 100
            peak = f"{a / GIB:8.2f}/{d / GIB:8.2f} {err:+5.1f}%"
            if abs(err) > abs(worst_peak[0]):
                worst_peak = (err, f"{r['layout']} {r['rank']}")
        print(f"{r['layout']:40s} {r['rank']:14s} " + " ".join(f"{c:>24s}" for c in cells) + f" {peak:>22s}")
    n_state = len(rows) * len(STATE)
    head = (f"HEADLINE memory audit: {len(rows)} ranks of {len({r['layout'] for r in rows})} layouts; exact state "
            f"bytes (params/grads/optimizer, {n_state} figures) worst {worst_state[0]:.2f}% ({worst_state[1]})")
    if worst_peak[1]:
        head += f"; FakeTensor step peak worst {worst_peak[0]:+.1f}% ({worst_peak[1]})"
    print(head)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
