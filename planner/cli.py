"""`titan-plan`: choose how to split a model over N accelerators (argument parsing and dispatch).

    titan-plan [plan] --model llama3-70b --gpus 256 --hardware h100-sxm \\
               --seq-len 8192 --global-batch-tokens 4M
    titan-plan estimate --model llama3-405b --gpus 16384 --hardware h100-sxm \\
               --tp 8 --pp 16 --dp-shard 128 --ac full --schedule Interleaved1F1B --stages-per-rank 2
    titan-plan list models|hardware|spaces

The planning question (model, hardware, workload, devices) is read by `planner.inputs`.
The planner never imports torch (it must answer for 16,384 devices in well under a
second); it reaches the executor only through plan.yaml.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from cost_models.specs import load_hardware, load_model, preset_names
from search_spaces.plan import AC_MODES, BACKENDS, SCHEDULES
from search_spaces.planfile import write_plan_file
from search_spaces.space import load_space, space_names
from search_spaces.typed import MAX_WORLD_SIZE, InputError, show

from . import calibrate as cal
from . import report
from .dry_run import dry_run_candidates, format_row
from .inputs import PlanInputs, UsageError, add_input_flags, parse_tokens, read_question, resolve_inputs
from .local import detect_local_devices
from .plot import pareto_plot
from .profile import run_profile
from .rank import RANK_BY, plan_candidates
from .trials import TrialSettings, run_trials
from .whatif import cmd_estimate

__all__ = ["main", "build_parser", "parse_tokens", "resolve_inputs", "UsageError"]

SUBCOMMANDS = ("plan", "estimate", "list", "profile", "calibrate")
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["plan"] + argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_counts(args)
        return args.func(args)
    except InputError as e:          # every user-input error class (search_spaces.typed)
        print(f"titan-plan: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return 0
    except OSError as e:             # a file named by a flag that cannot be read or written
        name = show(str(e.filename)) + ": " if e.filename else ""
        print(f"titan-plan: error: {name}{e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE


# the least value of each count flag (None: not given); --gpus is also capped at MAX_WORLD_SIZE
COUNT_FLAGS = {"gpus": 1, "gpus_per_node": 1, "seq_len": 1, "global_batch": 1, "top": 1, "dry_run": 0,
               "trials": 0, "trial_steps": 1, "nproc": 1, "max_bytes": 1, "dp_replicate": 1, "dp_shard": 1,
               "pp": 1, "tp": 1, "cp": 1, "ep": 1, "microbatch": 1, "n_microbatches": 1,
               "stages_per_rank": 1}


def check_counts(args) -> None:
    """Count flags in range, before anything is enumerated (a huge --gpus would never return)."""
    for key, lowest in COUNT_FLAGS.items():
        v = getattr(args, key, None)
        flag = "--" + key.replace("_", "-")
        if v is not None and v < lowest:
            raise UsageError(f"{flag} must be >= {lowest}, got {v}")
        if v is not None and v > MAX_WORLD_SIZE and key != "max_bytes":
            raise UsageError(f"{flag} must be at most {MAX_WORLD_SIZE:,} (the largest world titan-plan plans), "
                             f"got {str(v)[:30]}")
    for key in ("model", "hardware", "space", "calibration", "out"):
        v = getattr(args, key, None)
        if v is not None and not v.strip():
            raise UsageError(f"--{key} must be a name or a path, got {v!r}")
    for key in ("trial_timeout", "memory_margin"):
        v = getattr(args, key, None)
        if v is not None and not (v == v and abs(v) != float("inf")):
            raise UsageError(f"--{key.replace('_', '-')} must be a finite number, got {v}")
    if getattr(args, "trial_timeout", None) is not None and args.trial_timeout <= 0:
        raise UsageError(f"--trial-timeout must be > 0 seconds, got {args.trial_timeout}")
    if getattr(args, "memory_margin", None) is not None and not 0 <= args.memory_margin < 1:
        raise UsageError(f"--memory-margin must be in [0, 1), got {args.memory_margin}")


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="titan-plan",
        description="Enumerate every DP x PP x TP x CP x EP layout (plus micro-batch, pipeline schedule, "
                    "activation checkpointing, FSDP resharding, compile, float8) of a model over N devices, "
                    "score them with analytic memory and time models, and write the best as plan.yaml.",
        epilog="Subcommands: plan (default), estimate, list. 'titan-plan SUBCOMMAND --help' for details.")
    sub = p.add_subparsers(dest="command")

    pp = sub.add_parser("plan", help="rank all layouts and write the best (default)",
                        description="Rank every legal layout and write the best one to plan.yaml.")
    add_input_flags(pp)
    pp.add_argument("--plan", dest="plan_file", help="read the question (model, hardware, workload, device count) "
                                                     "from this plan file; flags given override it")
    pp.add_argument("--space", help="search space: dense, moe, long_context or a YAML path "
                                    "(default: moe for MoE models, long_context from 32K tokens, else dense)")
    pp.add_argument("--top", type=int, default=10, help="how many candidates to print (default 10)")
    pp.add_argument("--out", default="plan.yaml", help="where to write the chosen plan (default plan.yaml)")
    pp.add_argument("--no-write", action="store_true", help="do not write a plan file")
    pp.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    pp.add_argument("--plot", metavar="PNG", help="also save a Pareto plot (tokens/s vs peak memory); "
                                                  "needs the 'plot' extra (matplotlib)")
    pp.add_argument("--rank-by", choices=RANK_BY, default="time",
                    help="time: rank by the predicted step time, feasible when the predicted peak memory fits "
                         "(default); p90: rank by the conservative (p90) step time, feasible when the p90 peak "
                         "memory fits")
    pp.add_argument("--memory-margin", type=float, default=0.0,
                    help="keep this fraction of usable memory free (default 0.0)")
    pp.add_argument("--dry-run", type=int, default=0, metavar="K",
                    help="apply the top K candidates for the full world in one process on the meta device "
                         "(titan-run --dry-run, needs torch): drop those the executor cannot apply, and compare "
                         "their exact per-rank state bytes with the analytic model")
    t = pp.add_argument_group("measured trials (short real runs of the best candidates through titan-run)")
    t.add_argument("--trials", type=int, default=0, metavar="N", help="run N trials (default 0: analytic only)")
    t.add_argument("--trial-steps", type=int, default=6, help="steps per trial, the first 2 untimed (default 6)")
    t.add_argument("--trial-timeout", type=float, default=300.0, help="seconds before a trial is killed (default 300)")
    t.add_argument("--storage", default="sqlite:///titan-trials.db",
                   help="Optuna storage URL (default sqlite:///titan-trials.db); a study resumes from it")
    t.add_argument("--study-name", help="study name (default: from model, hardware and device count)")
    t.add_argument("--launcher", help="command template for a trial, with {plan} {run_dir} {steps} {nproc} "
                                      "(e.g. an srun line); default: titan-run on this node")
    t.add_argument("--run-root", default="runs/trials", help="where trial run folders go (default runs/trials)")
    pp.set_defaults(func=cmd_plan)

    pe = sub.add_parser("estimate", help="predict one given layout (what-if), with breakdowns",
                        description="Predict step time, throughput, MFU and memory of one layout, from a "
                                    "plan file or from flags, e.g. to check a published configuration.")
    add_input_flags(pe)
    pe.add_argument("--plan", dest="plan_file", help="read the layout (and model/hardware/workload) from "
                                                     "this plan file; flags given override it")
    for k, h in (("dp-replicate", "HSDP replica groups"), ("dp-shard", "FSDP shard degree (default: "
                 "what remains of the world)"), ("pp", "pipeline degree"), ("tp", "tensor-parallel degree"),
                 ("cp", "context-parallel degree"), ("ep", "expert-parallel degree (within dp_shard*cp)"),
                 ("microbatch", "sequences per micro-batch (default 1)"),
                 ("n-microbatches", "micro-batches per step (default: what the global batch leaves)"),
                 ("stages-per-rank", "pipeline stages per rank")):
        pe.add_argument(f"--{k}", type=int, help=h)
    pe.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default 1F1B)")
    pe.add_argument("--ac", choices=AC_MODES, help="activation checkpointing (default: the fastest of none, "
                    "selective, full that fits; the choice is printed)")
    pe.add_argument("--reshard", dest="reshard_after_forward", action=argparse.BooleanOptionalAction,
                    default=None, help="FSDP reshard after forward (default yes)")
    pe.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile")
    pe.add_argument("--float8", action=argparse.BooleanOptionalAction, default=None, help="float8 linears")
    pe.add_argument("--backend", choices=BACKENDS, help="executor backend (default spmd_types)")
    pe.add_argument("--json", action="store_true", help="print JSON")
    pe.set_defaults(func=cmd_estimate)

    pf = sub.add_parser("profile", help="measure this machine and write a hardware spec",
                        description="Microbenchmark this machine (GEMM throughput by shape, memory bandwidth, "
                                    "all-reduce/all-gather/reduce-scatter/all-to-all/point-to-point bandwidth and "
                                    "latency by group and message size) in a torchrun subprocess, fit them, and "
                                    "write a hardware spec usable as --hardware PATH.")
    pf.add_argument("--nproc", type=int, help="processes (default: this machine's device count)")
    pf.add_argument("--out", default="hardware-local.yaml", help="spec to write (default hardware-local.yaml)")
    pf.add_argument("--base", help="preset for figures one node cannot measure (default: this machine's)")
    pf.add_argument("--name", help="name in the spec (default: the base preset's name)")
    pf.add_argument("--max-bytes", type=int, default=16 * 2 ** 20, help="largest message (default 16 MiB)")
    pf.add_argument("--raw", help="also keep the raw measurements (JSON) here")
    pf.add_argument("--quick", action="store_true", help="fewer shapes and sizes (seconds, not minutes)")
    pf.set_defaults(func=cmd_profile)

    pc = sub.add_parser("calibrate", help="fit the cost model to measured trials",
                        description="Fit the cost model's coefficients (compute efficiency, link bandwidth and "
                                    "latency, overlap, fixed overheads, memory) to the successful trials of a "
                                    "study with scipy least_squares; report errors before and after, with "
                                    "leave-one-out cross-validation; write a file for --calibration.")
    pc.add_argument("--storage", default="sqlite:///titan-trials.db", help="Optuna storage URL of the trials")
    pc.add_argument("--study-name", help="study (needed when the storage holds several)")
    pc.add_argument("--hardware", help="hardware spec to calibrate (default: the study's)")
    pc.add_argument("--out", default="calibration.yaml", help="file to write (default calibration.yaml)")
    pc.add_argument("--plot", metavar="PNG", help="predicted vs measured, before and after (matplotlib)")
    pc.add_argument("--no-loo", action="store_true", help="skip leave-one-out cross-validation")
    pc.set_defaults(func=cmd_calibrate)

    pl = sub.add_parser("list", help="list presets", description="List model, hardware or space presets.")
    pl.add_argument("what", choices=("models", "hardware", "spaces"))
    pl.set_defaults(func=cmd_list)
    return p


def _default_space(model, workload) -> str:
    if model.is_moe:
        return "moe"
    return "long_context" if workload.seq_len >= 32768 else "dense"


# --------------------------------------------------------------------------- plan
def cmd_plan(args) -> int:
    t0 = time.perf_counter()
    q = resolve_inputs(args, read_question(args.plan_file, args)[1], where=str(args.plan_file or "plan file"))
    model, hw, workload, gpus, gpn, local = q.model, q.hardware, q.workload, q.gpus, q.gpus_per_node, q.local
    space = load_space(args.space or _default_space(model, workload))
    res = plan_candidates(space, model, hw, workload, world_size=gpus, gpus_per_node=gpn, coeffs=q.coeffs,
                          memory_margin=args.memory_margin, rank_by=args.rank_by)
    elapsed = time.perf_counter() - t0
    best = res.best()  # raises PlanningError with the reason when nothing fits
    top = res.order[: max(1, args.top)]
    inputs = {**q.echo(), "space": space.name, "rank_by": args.rank_by}
    contents = {
        "model": q.model_ref,
        "hardware": q.hardware_ref,
        "workload": workload.to_dict(),
        "plan": res.table.plan(best),
        "predicted": report.predicted(res.est, best),
        "inputs": inputs,
        "provenance": report.provenance(["titan-plan"] + sys.argv[1:], res.n_candidates),
    }
    dry_rows = _dry_run(args, res, q, contents) if args.dry_run else None
    best, top = res.best(), res.order[: max(1, args.top)]     # the dry run may have dropped some
    trial_rows = None
    if args.trials:
        chosen, measured, trial_rows = _run_trials(args, res, space, contents, q)
        if chosen is not None:
            contents["plan"] = chosen
            contents["predicted"] = measured.pop("predicted")
            contents["measured"] = measured
    if not args.no_write:
        write_plan_file(args.out, contents)
    if args.plot:
        pareto_plot(res, args.plot, title=f"{model.name} on {gpus} x {hw.name}")
    if args.json:
        doc = {"inputs": inputs, "n_candidates": res.n_candidates, "n_feasible": res.n_feasible,
               "rejected": [{"reason": r.reason, "count": r.count, "unit": r.unit} for r in res.rejected],
               "top": report.candidate_rows(res.table, res.est, top),
               "pareto": report.candidate_rows(res.table, res.est, res.pareto),
               "chosen": contents["plan"].to_dict(), "plan_file": None if args.no_write else args.out,
               "elapsed_s": round(elapsed, 4)}
        print(json.dumps(doc, indent=2))
        return 0
    print(q.headline())
    print(f"scored {res.n_candidates:,} candidates from {res.n_layouts:,} degree layouts in {elapsed:.3f} s; "
          f"{res.n_feasible:,} feasible ({space.name} space)")
    print()
    order = "fastest p90 step first" if args.rank_by == "p90" else "fastest first"
    print(report.format_table(res.table, res.est, top, title=f"top {len(top)} ({order}):",
                              p90=args.rank_by == "p90"))
    print()
    if res.rejected:
        print("rejected:")
        for r in res.rejected:
            print(f"  {r.count:>9,} {r.unit}: {r.reason}")
        print()
    if dry_rows:
        print("dry run (exact parameter + gradient + optimizer bytes of the worst rank; FakeTensor step peak):")
        for r in dry_rows:
            print(f"  {r['plan'].layout_str():<20} {r['plan'].knobs_str():<34} {format_row(r)}")
        print()
    if trial_rows:
        print(f"measured trials (best first), study '{args.study_name or 'default'}' in {args.storage}:")
        for o in trial_rows:
            meas = f"{o.tokens_per_s:,.1f} tok/s" if o.tokens_per_s else o.status
            print(f"  #{o.number:<3} {o.plan.layout_str():<18} {o.plan.knobs_str():<32} "
                  f"measured {meas:<18} predicted {o.predicted.get('tokens_per_s', 0):,.1f} tok/s"
                  + (f"  ({o.reason[:60]})" if o.reason and o.status != "ok" else ""))
        print()
    if "measured" in contents:
        print(f"chosen on measured throughput: {contents['measured']['tokens_per_s']:,.1f} tokens/s")
    else:
        print("chosen plan breakdown:")
        print(report.format_breakdown(res.est, best))
    if not args.no_write:
        print(f"\nwrote {args.out}  (train with: titan-run --plan {args.out})")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _dry_run(args, res, q: PlanInputs, contents: dict) -> list[dict]:
    """titan-run --dry-run of the top candidates; those the executor cannot apply leave the ranking."""
    print(f"[titan-plan] dry-running the top {args.dry_run} candidates ...", file=sys.stderr, flush=True)
    rows = dry_run_candidates(res, [int(i) for i in res.order[: args.dry_run]], model_ref=q.model_ref,
                              workload=contents["workload"])
    failed = {r["index"] for r in rows if r["status"] != "ok"}
    if failed:
        res.order = res.order[[int(i) not in failed for i in res.order]]
        best = res.best()
        contents["plan"] = res.table.plan(best)
        contents["predicted"] = report.predicted(res.est, best)
    return rows


def _run_trials(args, res, space, contents, q: PlanInputs):
    if args.launcher is None and q.local is None:
        here = detect_local_devices()
        if q.gpus > here.count:
            raise UsageError(f"--trials without --launcher run on this node, which has {here.count} devices, "
                             f"but --gpus is {q.gpus}")
    settings = TrialSettings(n_trials=args.trials, steps=args.trial_steps, timeout_s=args.trial_timeout,
                             storage=args.storage, study_name=args.study_name, run_root=args.run_root,
                             launcher=args.launcher)
    w = q.workload
    inputs = {"model": contents["model"], "hardware": contents["hardware"], "gpus": q.gpus,
              "seq_len": w.seq_len, "global_batch": w.global_batch, "dtype": w.dtype,
              "workload": contents["workload"]}
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    rows = run_trials(res, plan_inputs=inputs, settings=settings, space_knobs=dict(space.knobs), log=log)
    args.study_name = settings.study_name   # the name stored in --storage (run_trials sets it), printed below
    ok = [o for o in rows if o.status == "ok"]
    if not ok:
        print("titan-plan: warning: no trial succeeded; keeping the analytic choice", file=sys.stderr)
        return None, None, rows
    best = ok[0]
    measured = {"tokens_per_s": best.tokens_per_s, "step_time_s": best.step_time_s,
                "peak_memory_gib": round((best.peak_memory_bytes or 0) / 2 ** 30, 4),
                "trial": best.number, "run_dir": best.run_dir, "trials_ok": len(ok), "trials_total": len(rows),
                "predicted": best.predicted}
    return best.plan, measured, rows


# --------------------------------------------------------------------------- profile
def cmd_profile(args) -> int:
    local = detect_local_devices()
    nproc = args.nproc or local.count
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {nproc}")
    base = args.base or local.hardware
    try:
        res = run_profile(nproc=nproc, out=args.out, base=base, name=args.name or base, quick=args.quick,
                          max_bytes=args.max_bytes, raw_out=args.raw)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    spec = res["spec"]
    print(f"{local.description}: {nproc} process(es)")
    print(f"  GEMM peak {spec['peak_tflops_fp32' if spec['device'] == 'cpu' else 'peak_tflops_bf16']} TFLOP/s, "
          f"median efficiency {spec['efficiency']['gemm']}, memory bandwidth {spec['memory_bw_gbs']} GB/s")
    for op, f in res["collective_fits"].items():
        print(f"  {op:<15} {f['bw_bytes_per_s'] / 1e9:8.3f} GB/s  latency {f['latency_s'] * 1e6:8.1f} us  "
              f"(fit error median {f['median_abs_pct_err']:.0f}%, {f['points']} points)")
    print(f"wrote {args.out}  (use: titan-plan --hardware {args.out})")
    return 0


# --------------------------------------------------------------------------- calibrate
def cmd_calibrate(args) -> int:
    m = cal.load_measurements(args.storage, args.study_name, args.hardware)
    res = cal.calibrate(m, loo=not args.no_loo)
    cal.save(res, m, args.out)
    print(f"{m.source}: {res['trials']} successful trials of {m.model.name} on {m.hw.name}")

    def row(label, e):
        return (f"  {label:<26} median {e['median_ape_pct']:6.1f}%  worst {e['worst_ape_pct']:6.1f}%  "
                f"spearman {e['spearman']:.3f}")
    print("step time, |predicted - measured| / measured:")
    print(row("before", res["time_before"]))
    print(row("after (in sample)", res["time_after_in_sample"]))
    if "time_after_loo" in res:
        print(row("after (leave-one-out)", res["time_after_loo"]))
    print("peak memory:")
    print(row("before", res["memory_before"]))
    print(row("after (in sample)", res["memory_after_in_sample"]))
    b = res["memory_band_after"]
    print(f"  measured/predicted after: {b['min_measured_over_predicted']:.3f} .. "
          f"{b['max_measured_over_predicted']:.3f}")
    if "memory_band_loo" in res:
        b = res["memory_band_loo"]
        print(f"  measured/predicted leave-one-out: {b['min_measured_over_predicted']:.3f} .. "
              f"{b['max_measured_over_predicted']:.3f}")
    if args.plot:
        cal.plot(res, m, args.plot)
        print(f"wrote {args.plot}")
    print(f"wrote {args.out}  (use: titan-plan --calibration {args.out})")
    return 0


# --------------------------------------------------------------------------- list
def cmd_list(args) -> int:
    if args.what == "models":
        for n in preset_names("models"):
            m = load_model(n)
            kind = f"MoE {m.n_experts}e top{m.top_k}" if m.is_moe else "dense"
            print(f"{n:<18} {kind:<16} layers {m.n_layers:<4} dim {m.dim:<6} heads {m.n_heads}/{m.n_kv_heads}")
    elif args.what == "hardware":
        for n in preset_names("hardware"):
            h = load_hardware(n)
            print(f"{n:<10} {h.peak_tflops_bf16:>7.0f} TFLOP/s bf16  {h.memory_gib:>5.0f} GiB  "
                  f"{h.gpus_per_node}/node  intra {h.intra_node_bw_gbs:g} GB/s  inter {h.inter_node_bw_gbs:g} GB/s")
    else:
        for n in space_names():
            print(f"{n:<14} {load_space(n).description.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
