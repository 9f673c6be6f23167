"""`titan-plan estimate`: the figures of one given layout (a what-if), with breakdowns.

The layout comes from flags, or from a plan file with flags over it, and is completed by
`Plan.complete`.  It must be legal for the model and world (`constraints.check_plan`), but
not necessarily runnable by titan-run: a layout another framework ran with fewer pipeline
micro-batches than torch's schedules accept (e.g. 1F1B, PP 12, 2 micro-batches) is
predicted, with one line saying that titan-run cannot run that schedule.  The search
(`titan-plan plan`) keeps that rule.
"""
from __future__ import annotations

import json

from cost_models.estimate import estimate
from search_spaces import constraints as C
from search_spaces.plan import PLAN_KEYS, Plan, PlanError
from search_spaces.table import CandidateTable

from . import report
from .inputs import read_question, resolve_inputs


def estimate_layout(args, given: dict) -> dict:
    """The partial plan of an estimate: the plan file's (`given`) with the flags over it.

    What the file derived from keys a flag changes is dropped, so `Plan.complete` derives it
    again: dp_shard when another degree is given, stages_per_rank with --schedule, and the
    micro-batch count (from the global batch) unless --n-microbatches is given.
    """
    flags = {k: getattr(args, k) for k in PLAN_KEYS if getattr(args, k, None) is not None}
    layout = dict(given)
    layout.pop("n_microbatches", None)
    if "dp_shard" not in flags and any(k in flags for k in ("dp_replicate", "pp", "tp", "cp")):
        layout.pop("dp_shard", None)
    if "schedule" in flags and "stages_per_rank" not in flags:
        layout.pop("stages_per_rank", None)
    if "n_microbatches" in flags and "microbatch" not in flags:
        layout.pop("microbatch", None)
    layout.update(flags)
    return layout


def cmd_estimate(args) -> int:
    given, d = read_question(args.plan_file, args)
    where = f"{args.plan_file}: plan" if args.plan_file else "plan"
    q = resolve_inputs(args, d, where=str(args.plan_file or "plan file"))
    model, hw, workload, gpus = q.model, q.hardware, q.workload, q.gpus
    # a what-if: layouts titan-run cannot run (the pipeline runtime's micro-batch rules) are still predicted
    plan = Plan.complete(estimate_layout(args, given), world_size=gpus,
                         global_batch=workload.global_batch, runnable=False, where=where)
    plan.check_world(gpus)
    target = C.Target.of(model, world_size=gpus, seq_len=workload.seq_len, global_batch=workload.global_batch,
                         gpus_per_node=q.gpus_per_node, float8_supported=hw.supports_float8)
    problems = C.check_plan(plan, target, tp_within_node=False)
    illegal = [m for r, m in problems if r != C.R_MICRO]
    if illegal:
        raise PlanError(f"layout is not legal: {illegal[0]}")
    not_runnable = [m for r, m in problems if r == C.R_MICRO]
    note = (f"titan-run cannot run this schedule ({not_runnable[0]}); the figures are a what-if"
            if not_runnable else None)
    est = estimate(CandidateTable.from_plans([plan]), model, hw, workload, q.coeffs)
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "model": model.name, "hardware": hw.name, "gpus": gpus,
                          "workload": workload.to_dict(), "inputs": q.echo(), "titan_run_can_run": note is None,
                          "note": note, "predicted": report.predicted(est, 0)}, indent=2))
        return 0
    print(f"{model.name} on {gpus} x {hw.name}: {plan.layout_str()}  {plan.knobs_str()}")
    print(q.workload_line())
    if note:
        print(f"note: {note}")
    print(report.format_breakdown(est, 0))
    return 0
