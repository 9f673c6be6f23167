"""The published rows asked as a user who has only the paper would ask them: how far the CLI's own defaults
carry a question that states the layout and little else.

`bench/validate_reference.py` scores each row with everything its mapping knows: the framework's regime, what
the row states, the recipe behind it.  `tests/test_reference_cli.py` checks that the same prediction comes out of
`titan-plan estimate` given every one of those keys as a flag.  This asks each scored row with the minimal
question instead: the model and hardware (the row's, its stated NICs included), the GPUs, sequence and global
batch, the parallel degrees, and of the rest only what the row itself states -- the micro-batch, the recompute,
float8, an interleaved or DualPipe schedule and its chunks, compile, FSDP's sharding strategy, a MoE token
dispatcher (DeepEP / flex: ``--ep-dispatch per_node``; alltoall: ``every_copy``) -- plus
``--framework`` with the row's stack.  Everything else (kernels, overlaps, gradient dtype, pipeline memory keys,
the recipe's facts; and a recompute, schedule or resharding the row leaves out) is what the CLI and the regime
fill in.  It prints the throughput median / worst APE against the measurements, the fit verdicts, how far each
row moves from the validator's prediction, and the rows that move most.

With ``--without-framework`` each row is asked without ``--framework``, with its state layout and ZeRO stage as
flags instead (``--state-layout``, ``--zero``): the question of a user who names how the state is held but not the
stack, which titan-plan reads as titan-run's (fsdp2) or Megatron-LM's (megatron; `planner.inputs.IMPLIED_FRAMEWORK`).

Usage: python bench/bench_minimal_question.py [--set shared|extra|both] [--top N] [--without-framework] ; the
headline is printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import validate_reference as vr  # noqa: E402
from planner.cli import main as planner_main  # noqa: E402


def stated(row: dict) -> dict[str, bool]:
    """Which plan keys the row itself states (not its regime, its recipe or a validator default), read as
    `validate_reference.build_case` reads them."""
    par = row["parallel"]
    rec = str(par.get("recompute", "not stated")).lower()
    sched = str(par.get("schedule", "")).lower()
    vpp = par.get("vpp")
    text = " ".join(str(par.get(k, "")) for k in ("recompute", "techniques", "precision")).lower()
    return {"microbatch": bool(par.get("microbatch") or par.get("local_batch")),
            "ac": rec.startswith(("full", "selective", "none")),
            "schedule": bool(vpp and vp_int(vpp) > 1) or sched.startswith(("dualpipe", "interleaved", "zb", "1f1b",
                                                                           "gpipe")),
            "compile": (bool(str(par.get("compile", "")).strip()) or "compile" in text
                        or "asynctp" in row["id"].lower()),
            "reshard": bool(par.get("sharding_strategy"))}


# workload keys a row's own `parallel:` fields state (build_case), as flags; the precision's 16-bit ZeRO path too
ROW_KEYS = {"sequence_parallel": "sequence_parallel", "recompute_modules": "recompute_modules",
            "moment_dtype": "moment_dtype", "master_dtype": "master_dtype", "float8_cache": "float8_cache",
            "pp_partition": "pp_split", "norm_type": "norm_impl"}


def stated_workload(case, row) -> list[str]:
    """The workload flags for what the row states (its `parallel:` keys and its precision), at the validator's
    reading of them; nothing from its recipe or the validator's per-source rules."""
    par, wl, argv = row["parallel"], case.workload, []
    keys = [w for k, w in ROW_KEYS.items() if par.get(k) not in (None, "")]
    if wl.grad_accum == "autograd" and wl.grad_dtype == "bf16" and wl.state_layout == "megatron":
        keys += ["grad_dtype", "grad_accum"]             # the row's precision: DeepSpeed's 16-bit ZeRO-1 path
    if "recompute_modules" in keys:
        keys.append("selective_ac")
    text = " ".join(str(par.get(k, "")) for k in ("recompute", "techniques", "precision")).lower()
    if par.get("async_tp") or "asynctp" in text.replace(" ", "").replace("-", ""):
        keys.append("tp_comm_overlap")                   # the row's async TP
    for k in dict.fromkeys(keys):
        argv += vr.workload_flag(k, getattr(wl, k))
    dispatcher = str(par.get("token_dispatcher") or "").lower()     # the row's own Dispatcher column
    if dispatcher:
        once = any(w in dispatcher for w in ("deepep", "hybridep", "flex"))
        argv += vr.workload_flag("ep_dispatch", "per_node" if once else "every_copy")
    return argv


def vp_int(v) -> int:
    n = vr._num(v)
    return int(n) if n else 1


def minimal_argv(case, row, folder: Path, framework: bool = True) -> list[str]:
    """`titan-plan estimate` with the layout, what the row states and its framework (`framework`; else its state
    layout and ZeRO stage), nothing else."""
    plan, wl, say = case.plan, case.workload, stated(row)
    stack = (["--framework", vr.FRAMEWORK_OF[str(row.get("framework") or row["id"].split("_")[0])]] if framework
             else ["--state-layout", wl.state_layout, *(["--zero", str(wl.zero)] if wl.state_layout == "megatron"
                                                        else [])])
    stem = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in case.id)
    argv = ["estimate", "--model", vr._spec_ref(case.model, "models", folder, stem),
            *vr._hardware_args(case.hw, folder, stem), "--gpus", str(plan.world_size),
            "--gpus-per-node", str(case.hw.gpus_per_node), "--seq-len", str(wl.seq_len),
            "--global-batch", str(wl.global_batch), "--dp-replicate", str(plan.dp_replicate),
            "--dp-shard", str(plan.dp_shard), "--pp", str(plan.pp), "--tp", str(plan.tp), "--cp", str(plan.cp),
            "--ep", str(plan.ep), *stack]
    if say["microbatch"]:
        argv += ["--microbatch", str(plan.microbatch)]
    if say["ac"]:
        argv += ["--ac", plan.ac]
    if plan.float8:
        argv += ["--float8"]
    if say["schedule"] and plan.pp > 1:
        argv += ["--schedule", plan.schedule, "--stages-per-rank", str(plan.stages_per_rank)]
    if say["compile"]:
        argv += ["--compile" if plan.compile else "--no-compile"]
    if say["reshard"]:
        argv += ["--reshard" if plan.reshard_after_forward else "--no-reshard"]
    return argv + stated_workload(case, row)


def ask(argv: list[str]) -> dict | None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = planner_main([*argv, "--json"])
        except SystemExit as e:
            rc = int(e.code or 0)
    return json.loads(out.getvalue()) if rc == 0 else None


def score(set_name: str, folder: Path, framework: bool = True) -> dict:
    rows = {r["id"]: r for r in vr.load_set(set_name)}
    cases, _ = vr.build_cases(list(rows.values()))
    folder.mkdir(parents=True, exist_ok=True)
    apes_val, apes_min, moved, refused = [], [], [], []
    fit_min = trained = 0
    unfit = []
    for c in cases:
        row = rows[c.id]
        doc = ask(minimal_argv(c, row, folder, framework))
        if doc is None:
            refused.append(c.id)
            continue
        if c.trained:
            trained += 1
            fit_min += doc["predicted"]["headroom_gib"] >= 0
            if doc["predicted"]["headroom_gib"] < 0:
                unfit.append(f"{c.id} ({doc['predicted']['peak_memory_gib']:.1f} GiB)")
        meas = c.measured.get("tokens_per_s_per_gpu")
        if meas is None or "tokens_per_s_per_gpu" in c.not_counted:
            continue
        val = vr.predict(c)["tokens_per_s_per_gpu"]
        got = doc["predicted"]["tokens_per_s_per_gpu"]
        apes_val.append(abs(val - meas) / meas * 100)
        apes_min.append(abs(got - meas) / meas * 100)
        moved.append((abs(got - val) / val * 100, c.id, val, got, meas, doc["plan"], c.plan.describe()))
    return {"n": len(apes_min), "val_median": statistics.median(apes_val), "val_worst": max(apes_val),
            "min_median": statistics.median(apes_min), "min_worst": max(apes_min),
            "moved_median": statistics.median(m[0] for m in moved), "moved": sorted(moved, reverse=True),
            "fit": fit_min, "trained": trained, "refused": refused, "unfit": unfit}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=("shared", "extra", "both"), default="both")
    ap.add_argument("--top", type=int, default=12, help="rows that move most to list (default 12)")
    ap.add_argument("--without-framework", action="store_true",
                    help="ask without --framework, with the row's --state-layout and --zero instead")
    args = ap.parse_args()
    sets = vr.SETS if args.set == "both" else (args.set,)
    heads = []
    asked = "--state-layout / --zero (no --framework)" if args.without_framework else "--framework"
    with tempfile.TemporaryDirectory() as tmp:
        for s in sets:
            if s == "shared" and not (vr.reference_dir() / "published_runs.yaml").is_file():
                print("shared: reference data not found (set TITAN_REFERENCE_DIR)")
                continue
            r = score(s, Path(tmp) / s, not args.without_framework)
            print(f"== set '{s}': {r['n']} throughput rows asked with the layout, what the row states and "
                  f"{asked}")
            for pct, rid, val, got, meas, plan, vplan in r["moved"][: args.top]:
                print(f"  {pct:6.1f}%  {rid:58s} validator {val:10.1f}  minimal {got:10.1f}  measured {meas:10.1f}")
            if r["unfit"]:
                print(f"  trained, predicted not to fit: {', '.join(r['unfit'])}")
            if r["refused"]:
                print(f"  refused: {', '.join(r['refused'])}")
            heads.append(f"{s}: throughput n={r['n']} median {r['val_median']:.1f}% -> {r['min_median']:.1f}%, worst "
                         f"{r['val_worst']:.1f}% -> {r['min_worst']:.1f}%, moved median {r['moved_median']:.1f}%, "
                         f"fit {r['fit']}/{r['trained']}, refused {len(r['refused'])}")
    print(f"HEADLINE minimal question (validator -> layout, stated keys and {asked} only): " + " | ".join(heads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
