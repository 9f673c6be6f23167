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
import sys

from cost_models.specs import hardware_from_dict, load_hardware, load_model, preset_names
from search_spaces.plan import AC_MODES, BACKENDS, SCHEDULES
from search_spaces.space import load_space, space_names
from search_spaces.typed import MAX_WORLD_SIZE, InputError, OneLineArgumentParser, show

from . import calibrate as cal
from .inputs import UsageError, add_input_flags, parse_tokens, resolve_inputs
from .local import detect_local_devices
from .plan_command import cmd_plan
from .profile import run_profile
from .rank import RANK_BY
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
    p = OneLineArgumentParser(
        prog="titan-plan",
        description="Enumerate every DP x PP x TP x CP x EP layout (plus micro-batch, pipeline schedule, "
                    "activation checkpointing, FSDP resharding, compile, float8) of a model over N devices, "
                    "score them with analytic memory and time models, and write the best as plan.yaml.",
        epilog="Subcommands: plan (default), estimate, profile, calibrate, list. 'titan-plan SUBCOMMAND --help' "
               "for details.")
    sub = p.add_subparsers(dest="command")
    for add in (_add_plan_parser, _add_estimate_parser, _add_profile_parser, _add_calibrate_parser,
                _add_list_parser):
        add(sub)
    return p


def _add_plan_parser(sub) -> None:
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
    _add_trial_flags(pp)
    pp.set_defaults(func=cmd_plan)


def _add_trial_flags(pp) -> None:
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


def _schedule_key(text: str) -> str:
    """A schedule name reduced for matching: letters and digits, lower case."""
    return "".join(ch for ch in str(text).lower() if ch.isalnum())


# the schedules in any case, and the names papers and other frameworks give them
SCHEDULE_ALIASES = {**{_schedule_key(s): s for s in SCHEDULES}, "interleaved": "Interleaved1F1B",
                    "vpp": "Interleaved1F1B", "zbv": "ZBVZeroBubble", "zerobubble": "ZBVZeroBubble",
                    "dualpipe": "DualPipeV", "pipedreamflush": "1F1B"}


def schedule_name(text: str) -> str:
    """--schedule's value: a schedule of SCHEDULES in any case, or the name a paper gives it (DualPipe runs as
    DualPipeV, the zero-bubble V schedule as ZBVZeroBubble); anything else refused with the allowed names."""
    if _schedule_key(text) in SCHEDULE_ALIASES:
        return SCHEDULE_ALIASES[_schedule_key(text)]
    raise argparse.ArgumentTypeError(f"unknown schedule {text!r} (allowed: {', '.join(SCHEDULES)}; "
                                     f"also interleaved, zero-bubble, dualpipe)")


# Megatron-LM's own flag names (megatron/training/arguments.py) for the plan's degrees, accepted as they are written in
# a launch script (the workload's: --seq-length and --global-batch-size, planner.inputs)
MEGATRON_SPELLINGS = {"tp": ("--tensor-model-parallel-size",), "pp": ("--pipeline-model-parallel-size",),
                      "cp": ("--context-parallel-size",), "ep": ("--expert-model-parallel-size",),
                      "microbatch": ("--micro-batch-size",),
                      "stages-per-rank": ("--vpp", "--virtual-pipeline-model-parallel-size")}


class _ScheduleAction(argparse.Action):
    """--schedule: the schedule `schedule_name` reads, and ``schedule_dualpipe`` when it was asked as DeepSeek's
    DualPipe (two parameter copies per rank), which the estimate runs as its V-shaped variant and says so."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            name = schedule_name(values)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(namespace, self.dest, name)
        namespace.schedule_dualpipe = _schedule_key(values) == "dualpipe"


def _add_estimate_parser(sub) -> None:
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
                 ("stages-per-rank", "pipeline stages per rank (Megatron's virtual pipeline size)")):
        pe.add_argument(f"--{k}", *MEGATRON_SPELLINGS.get(k, ()), type=int, help=h)
    pe.add_argument("--dp", dest="dp_degree", type=int, metavar="N",
                    help="data-parallel degree, replicas x shards (a published table's DP): --dp-shard is N / "
                         "--dp-replicate")
    pe.add_argument("--schedule", action=_ScheduleAction, metavar="{" + ",".join(SCHEDULES) + "}",
                    help="pipeline schedule (default: the fastest that fits of those titan-run runs, printed; "
                         "1F1B under --framework or a megatron state; any case, and as papers name them: "
                         "interleaved, zero-bubble / zbv, dualpipe)")
    pe.add_argument("--ac", "--recompute-granularity", choices=AC_MODES,
                    help="activation checkpointing (default: the fastest of none, selective, full that fits; the "
                         "choice is printed; --recompute-granularity is Megatron-LM's name)")
    pe.add_argument("--reshard", dest="reshard_after_forward", action=argparse.BooleanOptionalAction,
                    default=None,
                    help="FSDP reshard after forward (default: not given, the faster setting that fits, as for --ac)")
    pe.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile")
    pe.add_argument("--float8", "--fp8", action=argparse.BooleanOptionalAction, default=None, help="float8 linears")
    pe.add_argument("--backend", choices=BACKENDS, help="executor backend (default spmd_types)")
    pe.add_argument("--json", action="store_true", help="print JSON")
    pe.set_defaults(func=cmd_estimate)


def _add_profile_parser(sub) -> None:
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


def _add_calibrate_parser(sub) -> None:
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


def _add_list_parser(sub) -> None:
    pl = sub.add_parser("list", help="list presets", description="List model, hardware or space presets.")
    pl.add_argument("what", choices=("models", "hardware", "spaces"), help="which presets to list")
    pl.set_defaults(func=cmd_list)


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
    th = res["measurements"].get("threaded")
    if th and "thread_gemm_scaling" in spec:
        t = th["threads"]
        g, m = hardware_from_dict(spec).thread_speedups(t)
        print(f"  one process on all {t} cores: GEMM x{g:.2f}, memory "
              f"bandwidth x{m:.2f} of one thread (a host running fewer "
              "processes than cores gives each cores // processes threads)")
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
        rho = e["spearman"]         # undefined with fewer than 3 trials or when all measured figures are equal
        return (f"  {label:<26} median {e['median_ape_pct']:6.1f}%  worst {e['worst_ape_pct']:6.1f}%  "
                f"spearman {'-' if rho != rho else f'{rho:.3f}'}")
    print("step time, |predicted - measured| / measured:")
    print(row("before", res["time_before"]))
    print(row("after (in sample)", res["time_after_in_sample"]))
    if "time_after_loo" in res:
        print(row("after (leave-one-out)", res["time_after_loo"]))
    elif not args.no_loo:
        print(f"  (no leave-one-out check with {res['trials']} trials: it needs 4; an in-sample fit of so few "
              "trials says little: run more trials)")
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
