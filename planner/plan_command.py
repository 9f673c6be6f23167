"""`titan-plan plan` (the default subcommand): score every candidate of the search space, dry-run
and trial the best when asked, write the choice as plan.yaml and print the ranking."""
from __future__ import annotations

import json
import sys
import time
import typing

from cost_models.frameworks import get_framework
from cost_models.specs import load_hardware
from cost_models.workload import Workload
from search_spaces.constraints import model_build_error
from search_spaces.planfile import write_plan_file
from search_spaces.space import load_space

from . import report
from .dry_run import dry_run_candidates, format_row
from .inputs import PlanInputs, UsageError, implied_framework_note, read_question, resolve_inputs
from .local import detect_local_devices
from .plot import pareto_plot
from .rank import PlanningError, plan_candidates, smallest_fitting_world
from .trials import TrialSettings, run_trials


def default_space(model, workload) -> str:
    """The search space `titan-plan` takes when --space is not given."""
    if model.is_moe:
        return "moe"
    return "long_context" if workload.seq_len >= 32768 else "dense"


def pp_splits_to_search(args, given: dict, q: PlanInputs) -> tuple[str, ...] | None:
    """Every pipeline split (workload ``pp_split``) when the question states none -- by flag, in the plan file's
    workload or through --framework's regime -- since titan-run runs each; None (the stated one) otherwise."""
    stated = (getattr(args, "pp_split", None) is not None or "pp_split" in (given.get("workload") or {})
              or "pp_split" in get_framework(q.framework).workload)
    return None if stated else typing.get_args(typing.get_type_hints(Workload)["pp_split"])


def tp_activations_to_search(q: PlanInputs) -> tuple[str, ...] | None:
    """Both TP activation regimes titan-run runs -- ``auto`` (the gathered inputs kept) and ``sharded`` (the sequence
    shards kept, all-gathered again in backward, on spmd_types eager blocks) -- when the question leaves the key
    ``auto`` (not given by flag, plan file or --framework, or given as ``auto``: the tool's choice, as
    `titan-plan estimate` reads it) under titan-run's fsdp2 state; None (the given one) otherwise."""
    wl = q.workload
    return ("auto", "sharded") if wl.tp_activations == "auto" and wl.state_layout == "fsdp2" else None


def grad_syncs_to_search(q: PlanInputs) -> tuple[str, ...] | None:
    """Both gradient syncs titan-run runs under a pipeline -- ``auto`` (after the last micro-batch) and
    ``every_microbatch`` (each micro-batch reduce-scattered into the shard, no unsharded gradients kept; not on the
    split-backward schedules) -- when the question leaves ``pp_grad_sync`` ``auto`` under titan-run's fsdp2 state;
    None (the given one) otherwise."""
    wl = q.workload
    return ("auto", "every_microbatch") if wl.pp_grad_sync == "auto" and wl.state_layout == "fsdp2" else None


def selective_policies_to_search(q: PlanInputs) -> tuple[str, ...] | None:
    """Both selective-checkpointing policies titan-run runs -- ``auto`` (every matmul output kept) and ``op``
    (TorchTitan's per-op policy: every other matmul recomputed) -- when the question leaves ``selective_ac``
    ``auto`` under titan-run's fsdp2 state; None (the given one) otherwise."""
    wl = q.workload
    return ("auto", "op") if wl.selective_ac == "auto" and wl.state_layout == "fsdp2" else None


def cmd_plan(args) -> int:
    t0 = time.perf_counter()
    d = read_question(args.plan_file, args)[1]
    q = resolve_inputs(args, d, where=str(args.plan_file or "plan file"))
    space = load_space(args.space or default_space(q.model, q.workload))
    splits, tpas, syncs = pp_splits_to_search(args, d, q), tp_activations_to_search(q), grad_syncs_to_search(q)
    pols = selective_policies_to_search(q)
    res = plan_candidates(space, q.model, q.hardware, q.workload, world_size=q.gpus, gpus_per_node=q.gpus_per_node,
                          coeffs=q.coeffs, memory_margin=args.memory_margin, rank_by=args.rank_by, pp_splits=splits,
                          tp_activations=tpas, grad_syncs=syncs, selective_acs=pols)
    elapsed = time.perf_counter() - t0
    if not res.n_feasible and res.n_candidates:     # legal layouts, none fits: say how many devices would do
        # a node shape the question states is kept; else the hardware's own (a small world had fewer per node)
        stated = args.gpus_per_node is not None or d.get("gpus_per_node") is not None
        hw = q.hardware if stated or q.hardware.device == "cpu" else load_hardware(q.hardware_ref)
        found = smallest_fitting_world(space, q.model, hw, q.workload, world_size=q.gpus,
                                       gpus_per_node=q.gpus_per_node if stated else None, coeffs=q.coeffs,
                                       memory_margin=args.memory_margin, rank_by=args.rank_by, pp_splits=splits,
                                       tp_activations=tpas, grad_syncs=syncs, selective_acs=pols)
        if found is not None:
            k, bigger = found
            b = bigger.best()
            raise PlanningError(f"{res.why_nothing_fits()}; the smallest world that fits is {k} x {q.hardware.name} "
                                f"(--gpus {k}: {bigger.table.plan(b).describe()}, "
                                f"{bigger.est.peak_memory_bytes[b] / 2**30:.1f} GiB)")
    best = res.best()  # raises PlanningError with the reason when nothing fits
    inputs = {**q.echo(), "space": space.name, "rank_by": args.rank_by}
    contents = {
        "model": q.model_ref,
        "hardware": q.hardware_ref,
        "workload": res.workload.to_dict(),       # the question's, with the pipeline split and TP regime chosen
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
        pareto_plot(res, args.plot, title=f"{q.model.name} on {q.gpus} x {q.hardware.name}")
    if args.json:
        doc = {"inputs": inputs, "n_candidates": res.n_candidates, "n_feasible": res.n_feasible,
               "rejected": [{"reason": r.reason, "count": r.count, "unit": r.unit} for r in res.rejected],
               "top": report.candidate_rows(res.table, res.est, top),
               "pareto": report.candidate_rows(res.table, res.est, res.pareto),
               "chosen": contents["plan"].to_dict(), "plan_file": None if args.no_write else args.out,
               "elapsed_s": round(elapsed, 4)}
        if res.split_best:
            doc["pp_split"] = {"chosen": res.workload.pp_split, "best_step_s": res.split_best}
        if res.tp_best:
            doc["tp_activations"] = {"chosen": res.workload.tp_activations, "best_step_s": res.tp_best}
        if res.sync_best:
            doc["pp_grad_sync"] = {"chosen": res.workload.pp_grad_sync, "best_step_s": res.sync_best}
        print(json.dumps(doc, indent=2))
        return 0
    _print_ranking(args, q, res, space, top, elapsed)
    _print_outcome(args, res, best, contents, dry_rows, trial_rows)
    return 0


def _print_ranking(args, q: PlanInputs, res, space, top, elapsed: float) -> None:
    """The text report's first half: the question, the top candidates and the rejection counts."""
    print(q.headline())
    implied = implied_framework_note(q)
    if implied:
        print(f"note: {implied}")
    print(f"scored {res.n_candidates:,} candidates from {res.n_layouts:,} degree layouts in {elapsed:.3f} s; "
          f"{res.n_feasible:,} feasible ({space.name} space)")
    if res.split_best and res.n_feasible and res.table.pp[res.best()] > 1:   # the split of the chosen pipeline
        print(split_line(res))
    if res.tp_best and res.n_feasible and res.workload.tp_activations == "sharded":
        print(tp_line(res))
    if res.sync_best and res.n_feasible and res.workload.pp_grad_sync == "every_microbatch":
        print(sync_line(res))
    if res.policy_best and res.n_feasible and res.workload.selective_ac == "op":
        print(policy_line(res))
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


def split_line(res) -> str:
    """The pipeline splits searched, each with its best step (`PlanningResult.split_best`), the chosen first."""
    chosen = res.workload.pp_split
    what = {"layers": "layers only, as even as possible", "weighted": "the embedding and the LM head count as a layer each"}
    unit = "p90 step" if res.rank_by == "p90" else "step"

    def best(s):
        v = res.split_best[s]
        return "nothing fits" if v is None else f"best {unit} {v:.4g} s"
    others = "; ".join(f"{s}: {best(s)}" for s in res.split_best if s != chosen)
    return (f"pipeline split: {chosen} ({what.get(chosen, chosen)}): {best(chosen)}; {others}  "
            f"(set --pp-split to fix one)")


def _best_steps(res, best: dict) -> dict[str, str]:
    """Each searched value's best step (`best`: a `PlanningResult` ``*_best`` dict) as the report shows it."""
    unit = "p90 step" if res.rank_by == "p90" else "step"
    return {k: "nothing fits" if v is None else f"best {unit} {v:.4g} s" for k, v in best.items()}


def tp_line(res) -> str:
    """Why the chosen plan keeps TP sequence shards: each regime's best step (`PlanningResult.tp_best`)."""
    show = _best_steps(res, res.tp_best)
    return (f"TP activations: sharded (each TP block keeps its sequence shard and all-gathers it again in "
            f"backward; spmd_types, eager): {show['sharded']}; gathered: {show['auto']}  "
            f"(set --tp-activations to fix one)")


def sync_line(res) -> str:
    """Why the chosen plan reduce-scatters every micro-batch: each regime's best step (`PlanningResult.sync_best`)."""
    show = _best_steps(res, res.sync_best)
    return (f"pipeline gradient sync: every_microbatch (each micro-batch's gradients reduce-scattered into the "
            f"shard, none kept unsharded): {show['every_microbatch']}; last_microbatch: {show['auto']}  "
            f"(set --pp-grad-sync to fix one)")


def policy_line(res) -> str:
    """Why the chosen plan recomputes every other matmul: each policy's best step (`PlanningResult.policy_best`)."""
    show = _best_steps(res, res.policy_best)
    return (f"selective checkpointing: op (TorchTitan's per-op policy: every other matmul of a block recomputed "
            f"too): {show['op']}; matmul (every matmul output kept): {show['auto']}  (set --selective-ac to fix one)")


def _print_outcome(args, res, best, contents: dict, dry_rows, trial_rows) -> None:
    """The text report's second half: dry-run and trial rows, the chosen plan and the files written."""
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
        fw = contents["inputs"].get("framework", "titan-run")
        unbuilt = model_build_error(res.model)
        if unbuilt:
            print(f"\nwrote {args.out}  (a what-if: titan-run cannot build this model: {unbuilt})")
        elif fw != "titan-run" or contents["workload"].get("state_layout") != "fsdp2":
            print(f"\nwrote {args.out}  (a what-if for {fw if fw != 'titan-run' else 'another framework'}'s regime: "
                  "titan-run refuses workload values it does not run, in one line)")
        else:
            print(f"\nwrote {args.out}  (train with: titan-run --plan {args.out})")
    if args.plot:
        print(f"wrote {args.plot}")


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
