"""`titan-plan estimate`: the figures of one given layout (a what-if), with breakdowns.

The layout comes from flags, or from a plan file with flags over it, and is completed by
`Plan.complete`.  It must be legal for the model and world (`constraints.check_plan`), but
not necessarily runnable by titan-run: a layout another framework ran with fewer pipeline
micro-batches than torch's schedules accept (e.g. 1F1B, PP 12, 2 micro-batches) is
predicted, with one line saying that titan-run cannot run that schedule.  The search
(`titan-plan plan`) keeps that rule.

Activation checkpointing and FSDP's reshard-after-forward are knobs, not part of the layout: when
neither a flag nor the plan file gives ``ac``, the estimate is the layout with the setting the search
would pick for it (:func:`ac_variants`, :func:`choose_ac`: the fastest of none / selective / full that
fits the device, else the smallest peak), said in one line with each setting's peak; likewise
``reshard_after_forward`` when the layout has FSDP shards to regather (``dp_shard`` > 1, the fsdp2 state
layout): both values are in the search space, and the one the search would pick is taken and said.  A
published layout whose recompute or resharding is not stated is then judged by whether some setting fits,
and at the speed of the best one, not by one default alone.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import numpy as np

from cost_models.estimate import GIB, Estimates, estimate
from cost_models.frameworks import FRAMEWORKS
from cost_models.specs import SpecError
from cost_models.moe_traffic import a2a_overlap_blocker
from search_spaces import constraints as C
from search_spaces.plan import (PLAN_KEYS, Plan, PlanError, backend_unrunnable, grad_sync_unrunnable,
                                tp_shards_unrunnable)
from search_spaces.table import CandidateTable

from . import report
from search_spaces.space import load_space

from .inputs import (WORKLOAD_FLAGS, UsageError, implied_framework_note, read_question, resolve_inputs,
                     resolve_workload)
from .plan_command import default_space
from .remedies import format_remedies, framework_regimes, remedies


def estimate_layout(args, given: dict) -> dict:
    """The partial plan of an estimate: the plan file's (`given`) with the flags over it.

    What the file derived from keys a flag changes is dropped, so `Plan.complete` derives it
    again: dp_shard when another degree is given, stages_per_rank with --schedule, and the
    micro-batch count (from the global batch) unless --n-microbatches is given.
    """
    flags = {k: getattr(args, k) for k in PLAN_KEYS if getattr(args, k, None) is not None}
    flags.update(_dp_degree_flags(getattr(args, "dp_degree", None), flags))
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


def _dp_degree_flags(dp, flags: dict) -> dict:
    """--dp N (the data-parallel degree, replicas x shards) as --dp-shard: N / --dp-replicate; refused in one
    line when they disagree."""
    if dp is None:
        return {}
    rep = int(flags.get("dp_replicate", 1))
    if dp < 1 or dp % rep:
        raise UsageError(f"--dp {dp} must be a positive multiple of --dp-replicate {rep}")
    if "dp_shard" in flags and rep * int(flags["dp_shard"]) != dp:
        raise UsageError(f"--dp {dp} is not --dp-replicate {rep} x --dp-shard {flags['dp_shard']}; give one of them")
    return {"dp_shard": dp // rep}


AC_ORDER = ("none", "selective", "full")      # the settings choose_ac compares, in that order
# Interleaved1F1B's stages per rank tried when a question leaves them out: each of 2..8 that leaves every stage a
# layer, beside the search space's (a published run's V is often unstated and deep models run 5-8: Llama 3 405B
# at pp 16 has 126 layers, 7 per rank at V 7)
MAX_UNSTATED_V = 8


def choose_ac(plans: list[Plan], est: Estimates) -> int:
    """Index of the plan the search would pick among `plans` (one layout, different ``ac``): the
    fastest that fits the device, else the one with the smallest peak (ties: the earlier)."""
    fits = np.flatnonzero(est.fits)
    if len(fits):
        return int(fits[np.argmin(est.step_time_s[fits])])
    return int(np.argmin(est.peak_memory_bytes))


def ac_variants(layout: dict, *, world_size: int, global_batch: int, where: str = "plan",
                workload=None, model=None, ac_choices: tuple[str, ...] | None = None,
                free_schedule: bool = False) -> list[Plan]:
    """`layout` completed (a what-if: ``runnable=False``); one plan per setting of :data:`AC_ORDER`
    (those of `ac_choices` only: a framework regime whose code lacks one, ``Framework.ac_choices``)
    when it gives no ``ac``, else just the one; each of them with reshard-after-forward on and off when the
    layout gives no ``reshard_after_forward`` and it matters (FSDP shards, ``dp_shard`` > 1, under the
    fsdp2 state layout of `workload`), and, for Interleaved1F1B without ``stages_per_rank``, with each
    stages-per-rank value of the search space `titan-plan` would take (`plan_command.default_space`) and each of
    2..`MAX_UNSTATED_V` that leaves every stage a layer of `model`.  With `free_schedule` (a regime whose runs take the schedule titan-plan
    picks), a pipeline and no schedule in `layout`: each schedule of that search space too (the default, 1F1B,
    first; Interleaved1F1B with each of those stages-per-rank values)."""
    settings = [{}] if "ac" in layout else [{"ac": ac} for ac in AC_ORDER if ac in (ac_choices or AC_ORDER)]
    first = Plan.complete(dict(layout), world_size=world_size, global_batch=global_batch, runnable=False,
                          where=where)
    fsdp2 = workload is None or workload.state_layout == "fsdp2"
    if "reshard_after_forward" not in layout and fsdp2 and first.dp_shard > 1:
        settings = [{**s, "reshard_after_forward": r} for s in settings for r in (True, False)]
    vs, schedules = [], []      # the space's stages-per-rank values that leave every stage a layer; its schedules
    if "stages_per_rank" not in layout and model is not None and workload is not None:
        space = load_space(default_space(model, workload))
        vs = [v for v in sorted({*space.knobs["stages_per_rank"], *range(2, MAX_UNSTATED_V + 1)})
              if first.pp * v <= model.n_layers]
        schedules = space.knobs["schedule"] if free_schedule else []
    scheds = [{}]
    if first.pp > 1 and "schedule" not in layout and "stages_per_rank" not in layout:
        scheds += [{"schedule": k, **({"stages_per_rank": v} if k == "Interleaved1F1B" else {})}
                   for k in schedules if k != first.schedule for v in (vs if k == "Interleaved1F1B" else [0])]
    elif first.schedule == "Interleaved1F1B" and len(vs) > 1:
        scheds = [{"stages_per_rank": v} for v in vs]
    settings = [{**s, **k} for k in scheds for s in settings]
    return [Plan.complete({**layout, **s}, world_size=world_size, global_batch=global_batch, runnable=False,
                          where=where) for s in settings]


def _pick(rows: list[int], est: Estimates) -> int:
    """Of `rows`, the fastest that fits, else the smallest peak (ties: the earlier)."""
    fits = [j for j in rows if est.fits[j]]
    if fits:
        return min(fits, key=lambda j: est.step_time_s[j])
    return min(rows, key=lambda j: est.peak_memory_bytes[j])


# the knobs besides ac that an estimate may choose: (name, flag, the plan's setting of it, shown)
_FREE = (("reshard_after_forward", "reshard", lambda p: p.reshard_after_forward, lambda v: "yes" if v else "no"),
         ("schedule", "schedule", lambda p: (p.schedule, p.stages_per_rank),
          lambda v: f"{v[0]} V {v[1]}" if v[0] == "Interleaved1F1B" else v[0]),
         ("stages_per_rank", "stages-per-rank", lambda p: p.stages_per_rank, str))


def estimate_choosing_ac(plans: list[Plan], model, hw, workload, coeffs
                         ) -> tuple[Plan, Estimates, int, str | None, list[str]]:
    """Estimate `plans` (from :func:`ac_variants`) at once and keep the one the search would pick: for each
    ``ac``, its best setting of the other free knobs, then :func:`choose_ac`'s rule over those.  Returns
    (plan, the estimate of all `plans`, the picked row, the one-line note on ``ac`` or None when it was
    given, and one note per other knob that was chosen: reshard-after-forward, stages per rank)."""
    est = estimate(CandidateTable.from_plans(plans), model, hw, workload, coeffs)
    groups: dict[str, list[int]] = {}
    for j, p in enumerate(plans):
        groups.setdefault(p.ac, []).append(j)
    reps = [_pick(rows, est) for rows in groups.values()]        # one per ac, in AC_ORDER
    i = _pick(reps, est)
    ac_note = None
    if len(reps) > 1:
        peaks = ", ".join(f"{plans[j].ac} {est.peak_memory_bytes[j] / GIB:.1f} GiB" for j in reps)
        why = "the fastest setting that fits" if est.fits[i] else "no setting fits; the smallest peak"
        ac_note = f"ac not given: '{plans[i].ac}', {why} (peak per device: {peaks})"
    notes = []
    chosen = plans[i]
    # one note on the pipeline: the schedule's (with its stages per rank) where the schedule was chosen, else the
    # stages per rank's
    skip = "stages_per_rank" if len({p.schedule for p in plans}) > 1 else "schedule"
    for key, name, get, show_value in _FREE:
        if key == skip:
            continue
        pair = ("schedule", "stages_per_rank")                 # one knob as far as the other's rows go
        others = [g for k, _, g, _ in _FREE if k != key and not (key in pair and k in pair)]
        rows = [j for j in groups[chosen.ac] if all(g(plans[j]) == g(chosen) for g in others)]
        if len(rows) < 2:
            continue
        why = "the fastest setting that fits" if est.fits[i] else "no setting fits; the smallest peak"
        each = "; ".join(f"{show_value(get(plans[j]))}: step {est.step_time_s[j]:.4g} s, peak "
                         f"{est.peak_memory_bytes[j] / GIB:.1f} GiB" for j in rows)
        notes.append(f"{name} not given: '{show_value(get(chosen))}', {why} ({each})")
    return chosen, est, i, ac_note, notes


def recompute_module_ladder(model) -> list[tuple[str, ...]]:
    """Megatron-core's selective recompute beyond the attention core, in the order its cost grows, as a Megatron
    user reaches for it when the default does not fit: the norms (and, where the model has them, the experts'
    activation and MLA's up projections: the modules Megatron-core's MoE guidance and DeepSeek-V3's report name),
    then the dense FFNs (and shared experts), then whole MoE layers.  Each set holds the one before."""
    cheap = ["core_attn", "layernorm", *(["moe_act"] if model.is_moe else []),
             *(["mla_up_proj"] if model.attention == "mla" else [])]
    ffn = [*cheap, "mlp", *(["shared_experts"] if model.is_moe and model.n_shared_experts else [])]
    return [tuple(cheap), tuple(ffn), *([(*ffn, "moe")] if model.is_moe else [])]


def workload_variants(workload, plans: list[Plan] | None = None, model=None,
                      stated: frozenset = frozenset()) -> tuple[list, str]:
    """The workloads an estimate compares for a workload key the question leaves unstated, in the order
    preferred, and the rule that picks one (:func:`estimate_choosing_workload`):

    * a bf16 run of the megatron layout with ``grad_dtype: auto``: fp32 main gradients (Megatron-LM, which
      forces them for bf16) and bf16 ones (NeMo's and Megatron-Bridge's performance recipes,
      ``grad_reduce_in_fp32=False``); rule ``first_fit``: the layout trained with one of them, and a verdict
      on it should not rest on the heavier one alone;
    * titan-run's fsdp2 state, rule ``fastest`` (as the search does, `planner.rank.plan_candidates`: a variant
      only where it makes a faster setting fit), each of these keys left ``auto`` with the values titan-run runs:
      ``tp_activations`` with a layout with tp > 1 (of `plans`): the gathered inputs and the sequence shards
      (``sharded``, which titan-run runs on spmd_types, eager, ac none or full, no float8); ``pp_grad_sync``
      with a pipeline whose FSDP shards (pp > 1, dp_shard x cp > 1): the gradients reduce-scattered after the last
      micro-batch and after every one (``every_microbatch``: no unsharded gradients accumulated; not on the V
      schedules; estimated on the plans that do not fit with the default sync only); ``selective_ac`` with a
      plan under ``ac: selective``: every matmul output kept and TorchTitan's per-op policy (``op``: every other
      matmul recomputed); every combination, the defaults first.

    * a megatron layout whose selective recompute is Megatron's default (the attention core) and not stated
      (`stated`: the workload keys the question gives), with a plan under ``ac: selective``: that default and each
      module set of :func:`recompute_module_ladder` for `model`, rule ``fastest`` (the ladder only where the
      main gradients' dtype is given: a bf16 run leaves it to the comparison above).

    Both at once (a bf16 megatron run with neither stated): the ladder under each main-gradient dtype, rule
    ``grad_dtype_first``: the fastest that fits under fp32, else under bf16.

    Otherwise just `workload`."""
    ladder = [workload]
    if (workload.state_layout == "megatron" and model is not None and plans and workload.selective_ac == "attention"
            and not {"selective_ac", "recompute_modules"} & stated and any(p.ac == "selective" for p in plans)):
        ladder += [dataclasses.replace(workload, selective_ac="modules", recompute_modules=m)
                   for m in recompute_module_ladder(model)]
    if workload.state_layout == "megatron" and workload.grad_dtype == "auto" and workload.dtype == "bf16":
        return ([dataclasses.replace(w, grad_dtype=g) for g in ("fp32", "bf16") for w in ladder],
                "first_fit" if len(ladder) == 1 else "grad_dtype_first")
    if len(ladder) > 1:
        return ladder, "fastest"
    if workload.state_layout != "fsdp2" or not plans:
        return [workload], "first_fit"
    choices = []
    if workload.tp_activations == "auto" and any(p.tp > 1 for p in plans):
        choices.append([{}, {"tp_activations": "sharded"}])
    if workload.pp_grad_sync == "auto" and any(p.pp > 1 and p.fsdp_size > 1 and not p.is_v_schedule for p in plans):
        choices.append([{}, {"pp_grad_sync": "every_microbatch"}])
    if workload.selective_ac == "auto" and any(p.ac == "selective" for p in plans):
        choices.append([{}, {"selective_ac": "op"}])
    if not choices:
        return [workload], "first_fit"
    variants = [dataclasses.replace(workload, **{k: v for c in combo for k, v in c.items()})
                for combo in itertools.product(*choices)]
    # fewest changes first (a sync per micro-batch after its TP regime's default sync, which it is compared with)
    return sorted(variants, key=lambda w: _changed(workload, w)), "fastest"


# the workload keys an estimate may choose for the question (`workload_variants`): (key, flag, what the chosen
# value does)
_CHOSEN_KEYS = (("tp_activations", "tp-activations",
                 "each TP block keeps its sequence shard and all-gathers it again in backward"),
                ("pp_grad_sync", "pp-grad-sync",
                 "each micro-batch's gradients are reduce-scattered into the shard, none accumulated unsharded"),
                ("selective_ac", "selective-ac",
                 "TorchTitan's per-op policy: ac selective recomputes every other matmul of a block too"),
                ("recompute_modules", "recompute-modules",
                 "Megatron-core's selective recompute of these modules, not the attention core alone"))


def _changed(base, w) -> int:
    """How many of `_CHOSEN_KEYS` `w` sets away from `base`."""
    return sum(getattr(w, k) != getattr(base, k) for k, _, _ in _CHOSEN_KEYS)


def _variant_label(w, keys: list[str]) -> str:
    """`w`'s values of `keys` (those the variants differ in), ``auto`` shown as what it runs."""
    shown = {"tp_activations": lambda v: "gathered" if v == "auto" else v,
             "pp_grad_sync": lambda v: "last_microbatch" if v == "auto" else v,
             "selective_ac": lambda v: "matmul" if v == "auto" else v,
             "recompute_modules": lambda v: "+".join(v)}
    return ", ".join(shown[k](getattr(w, k)) for k in keys)


def pick_variant(rule: str, fits: list[bool], step: list[float], groups: list | None = None) -> int:
    """Index of the variant `rule` keeps (:func:`workload_variants`), given each variant's pick: whether it fits
    and its step time (and under ``grad_dtype_first`` its group, the main gradients' dtype: the fastest that fits
    in the first group where any fits).  When none fits, the first (the default): the remedies name the change."""
    n = len(fits)
    if not any(fits):           # nothing fits: the default, whose remedies `titan-plan estimate` lists
        return 0
    if rule == "grad_dtype_first" and groups is not None:
        first = groups[next(k for k in range(n) if fits[k])]
        return min((k for k in range(n) if fits[k] and groups[k] == first), key=lambda k: (step[k], k))
    if rule in ("fastest", "grad_dtype_first"):
        return min((k for k in range(n) if fits[k]), key=lambda k: (step[k], k))
    return next(k for k in range(n) if fits[k])


def workload_limits(plan: Plan, workload) -> list[tuple[str, str]]:
    """What titan-run runs on some layouts only, that `plan` breaks under `workload` and its backend, as
    `constraints.titan_run_limits` pairs (what is limited, why): a reduce-scatter after every micro-batch
    under a split-backward schedule, TP sequence shards where titan-run keeps none (its own layout only),
    the dtensor backend's refusals."""
    out = []
    if bool(grad_sync_unrunnable(plan, workload.pp_grad_sync)):
        out.append(("schedule", C.R_GRAD_SYNC))
    if (workload.state_layout == "fsdp2" and workload.tp_activations == "sharded"
            and bool(tp_shards_unrunnable(plan))):
        out.append(("layout", C.R_TP_SHARDS))
    if bool(backend_unrunnable(plan)):
        out.append(("layout", C.R_BACKEND))
    return out


def runnable_under(workload, plans: list[Plan]) -> list[Plan]:
    """The plans titan-run runs under `workload`'s TP regime and gradient sync (all of them, except under
    ``sharded`` and ``every_microbatch``)."""
    if workload.state_layout == "fsdp2" and workload.tp_activations == "sharded":
        plans = [p for p in plans if not tp_shards_unrunnable(p)]
    return [p for p in plans if not grad_sync_unrunnable(p, workload.pp_grad_sync)]


def estimate_choosing_workload(plans: list[Plan], model, hw, workload, coeffs, stated: frozenset = frozenset()):
    """:func:`estimate_choosing_ac` for each of :func:`workload_variants` (on the plans it runs) and the one the
    variants' rule keeps (:func:`pick_variant`): ``first_fit``, the first whose pick fits; ``fastest``, the fastest
    pick that fits (the first on a tie); when none fits, the first (the default).  Returns (workload, plan, estimates,
    row, ac note, knob notes): the knob notes say what an unstated workload key was taken as and why, when it
    is not the first variant."""
    variants, rule = workload_variants(workload, plans, model, stated)
    # the question's own workload on every plan (a what-if may be another framework's); an added variant on
    # the plans titan-run runs it on.  A sync per micro-batch only on the plans that do not fit with the question's
    # sync (and the same TP regime): it is taken for the memory it saves, as the search takes it
    # (`planner.rank.plan_candidates`), so a plan that fits keeps the default sync
    fitted: dict[tuple[str, str], set[int]] = {}
    pairs, runs = [], []
    for j, w in enumerate(variants):
        ps = plans if j == 0 else runnable_under(w, plans)
        if w.pp_grad_sync != workload.pp_grad_sync:
            ps = [p for p in ps if id(p) not in fitted.get((w.tp_activations, w.selective_ac), set())]
        if not ps:
            continue
        r = estimate_choosing_ac(ps, model, hw, w, coeffs)
        if w.pp_grad_sync == workload.pp_grad_sync:
            fitted[(w.tp_activations, w.selective_ac)] = {id(p) for p, f in zip(ps, r[1].fits) if f}
        pairs.append((w, ps))
        runs.append(r)
    variants = [w for w, _ in pairs]
    fits = [bool(r[1].fits[r[2]]) for r in runs]
    step = [float(r[1].step_time_s[r[2]]) for r in runs]
    peak = [float(r[1].peak_memory_bytes[r[2]]) for r in runs]
    k = pick_variant(rule, fits, step, [w.grad_dtype for w in variants])
    plan, est, row, ac_note, notes = runs[k]
    keys = [key for key, _, _ in _CHOSEN_KEYS if len({getattr(w, key) for w in variants}) > 1]
    keys = [key for key in keys if not (key == "selective_ac" and "recompute_modules" in keys)]   # modules say it
    if not any(fits) and keys:  # the defaults' figures, but say how close titan-run's own settings come
        flags = ", ".join(flag for key, flag, _ in _CHOSEN_KEYS if key in keys)
        each = "; ".join(f"{_variant_label(w, keys)}: {r[0].knobs_str()}, step {st:.4g} s, peak {pk / GIB:.1f} GiB"
                         for w, r, st, pk in zip(variants, runs, step, peak))
        best = min(range(len(variants)), key=lambda j: peak[j])
        notes = [f"{flags} not given: no setting fits, the figures are the defaults'; the smallest peak is "
                 f"{_variant_label(variants[best], keys)}'s ({each})", *notes]
    held = workload.grad_dtype == "auto" and variants[k].grad_dtype == "fp32"     # auto is held as fp32
    if k > 0:                   # the default is kept: nothing to say
        changed = [key for key in keys if getattr(variants[k], key) != getattr(workload, key)]
        if changed:
            why = "the fastest setting that fits"
            each = "; ".join(f"{_variant_label(w, keys)}: "
                             f"{'' if f else 'does not fit, '}{r[0].knobs_str()}, step {st:.4g} s, "
                             f"peak {pk / GIB:.1f} GiB"
                             for w, r, f, st, pk in zip(variants, runs, fits, step, peak)
                             if w.grad_dtype == variants[k].grad_dtype)
            chosen = "; ".join(f"{flag} not given: '{_variant_label(variants[k], [key])}' ({what})"
                               for key, flag, what in _CHOSEN_KEYS if key in changed)
            notes = [f"{chosen}, {why} ({each})", *notes]
        if not held and variants[k].grad_dtype != workload.grad_dtype:
            why = "fp32 main gradients do not fit, bf16 ones do"
            each = "; ".join(f"{w.grad_dtype}: peak {pk / GIB:.1f} GiB, step {st:.4g} s"
                             for w, pk, st in zip(variants, peak, step)
                             if all(getattr(w, key) == getattr(variants[k], key) for key in keys))
            notes = [f"grad_dtype not given: '{variants[k].grad_dtype}', {why} ({each}; fp32 is Megatron-LM's, bf16 "
                     "NeMo's and Megatron-Bridge's grad_reduce_in_fp32=False)", *notes]
    # the first variant is the question's own (grad_dtype auto is held as fp32): its keys stay as asked
    chosen_w = workload if k == 0 else dataclasses.replace(variants[k], grad_dtype="auto") if held else variants[k]
    return chosen_w, plan, est, row, ac_note, notes


def _framework_workloads(args, d, q) -> dict[str, Any]:
    """The question's workload under each other framework's ``--framework`` (flags and the plan file's
    ``workload:`` still win over the regime, as with the flag); regimes the question contradicts are left out."""
    out = {}
    for name, fw in FRAMEWORKS.items():
        if name in ("titan-run", q.framework):
            continue
        try:
            out[name] = resolve_workload(args, d.get("workload") or {}, model=q.model, hw=q.hardware, gpus=q.gpus,
                                         base=fw.workload)
        except (SpecError, UsageError, ValueError):
            continue
    return out


DUALPIPE_NOTE = ("schedule 'DualPipe' predicted as DualPipeV, its V-shaped variant: the same overlap of each "
                 "micro-batch pair's forward and backward and all-to-alls, one parameter copy per rank where DualPipe "
                 "keeps two")


def implied_schedule(layout: dict) -> str | None:
    """Several stages per rank asked without a schedule ("VP 4" in a published table, 1F1B the default) name the
    interleaved schedule, the one whose stages per rank are free: set it in `layout` and return the note saying
    so (None when the layout gives a schedule or one stage per rank)."""
    v = layout.get("stages_per_rank")
    if "schedule" in layout or v is None or int(v) <= 1:
        return None
    layout["schedule"] = "Interleaved1F1B"
    return (f"schedule not given: 'Interleaved1F1B', the schedule with {int(v)} stages per rank "
            f"(--schedule ZBVZeroBubble or DualPipeV for theirs, 2 per rank)")


def _regime_plan_note(framework: str, key: str, value) -> str:
    """One line for a plan key `key` the question left out and `framework`'s regime set (`Framework.plan_defaults`)."""
    if key == "compile":
        return (f"compile not given: on, for {framework}'s fused kernels (softmax, bias-activation, norm, loss); "
                f"--no-compile predicts eager kernels")
    flag = {"reshard_after_forward": "reshard", "stages_per_rank": "stages-per-rank"}.get(key, key)
    if isinstance(value, bool):
        other = f"--no-{flag}" if value else f"--{flag}"
        return f"{flag} not given: '{'yes' if value else 'no'}', {framework}'s ({other} to ask the other)"
    return f"{flag} not given: '{value}', {framework}'s (--{flag} to ask another)"


def cmd_estimate(args) -> int:
    given, d = read_question(args.plan_file, args)
    where = f"{args.plan_file}: plan" if args.plan_file else "plan"
    q = resolve_inputs(args, d, where=str(args.plan_file or "plan file"))
    model, hw, workload, gpus = q.model, q.hardware, q.workload, q.gpus
    # a what-if: layouts titan-run cannot run (the pipeline runtime's micro-batch rules) are still predicted
    layout, fw = estimate_layout(args, given), FRAMEWORKS[q.framework]
    regime_plan = fw.plan_defaults(layout, model.n_layers)     # what the regime's runs set, the question leaves out
    layout.update(regime_plan)
    regime_notes = [_regime_plan_note(fw.name, k, v) for k, v in regime_plan.items()]
    schedule_note = implied_schedule(layout) or (DUALPIPE_NOTE if getattr(args, "schedule_dualpipe", False) else None)
    regime_notes = [schedule_note, *regime_notes] if schedule_note else regime_notes
    # titan-run's own runs take the schedule titan-plan would: with a pipeline and none asked, each one of the
    # search space that titan-run runs on this layout is estimated too (other stacks: their regime's default)
    plans = ac_variants(layout, world_size=gpus, global_batch=workload.global_batch, where=where, workload=workload,
                        model=model, ac_choices=fw.ac_choices, free_schedule=fw.schedule_free)
    plan = plans[0]
    plan.check_world(gpus)
    target = C.Target.of(model, world_size=gpus, seq_len=workload.seq_len, global_batch=workload.global_batch,
                         gpus_per_node=q.gpus_per_node, float8_supported=hw.supports_float8,
                         pp_weighted=workload.pp_weighted)
    plans = [p for p in plans if p.schedule == plan.schedule or not C.check_plan(p, target, tp_within_node=False)]
    # titan-run's own limits (the pipeline runtime's micro-batch rules, tied embeddings under tp/pp, virtual
    # stages without a layer): other frameworks run such layouts, so they are predicted, with a note
    illegal = [m for _, m in C.check_plan(plan, target, tp_within_node=False, runnable=False)]
    if illegal:
        raise PlanError(f"layout is not legal: {illegal[0]}")
    try:                        # ep over the TP ranks too: Megatron-core's folded expert layout (whole experts)
        workload, fold_note = workload.for_expert_layout(plan.ep, plan.fsdp_size, plan.tp)
    except SpecError as e:
        raise PlanError(str(e)) from None
    stated = frozenset(k for k in WORKLOAD_FLAGS if getattr(args, k, None) is not None) | set(d.get("workload") or {})
    workload, plan, est, row, ac_note, knob_notes = estimate_choosing_workload(plans, model, hw, workload, q.coeffs,
                                                                               stated)
    lacks = [ac for ac in AC_ORDER if ac not in (FRAMEWORKS[q.framework].ac_choices or AC_ORDER)]
    if ac_note and lacks:
        ac_note += f"; {q.framework} has no {' or '.join(lacks)} recompute"
    elif plan.ac in lacks:
        knob_notes = [*knob_notes, f"{q.framework} has no {plan.ac} recompute; predicted as asked (--ac {plan.ac})"]
    knob_notes = [n for n in (implied_framework_note(q), *regime_notes) if n] + knob_notes
    knob_notes = [fold_note, *knob_notes] if fold_note else knob_notes
    not_runnable = C.titan_run_limits(plan, target) + workload_limits(plan, workload)   # of the plan chosen
    note = (f"titan-run cannot run this {not_runnable[0][0]} ({not_runnable[0][1]}); the figures are a what-if"
            if not_runnable else None)
    blocker = a2a_overlap_blocker(plan, workload)
    overlap_note = (f"ep_a2a_overlap 'combined_1f1b' does not apply to this layout ({blocker}); its all-to-alls "
                    "are counted exposed" if blocker else None)
    # what would make it fit: one change each, or several together (planner/remedies.py)
    rem = None if est.fits[row] else remedies(plan, model, hw, workload, q.coeffs, float(est.peak_memory_bytes[row]))
    if rem is not None:         # and under which other stacks' regimes it fits (--framework NAME, the rest as asked)
        rem["frameworks"] = framework_regimes(plan, model, hw, _framework_workloads(args, d, q), q.coeffs)
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "model": model.name, "hardware": hw.name, "gpus": gpus,
                          "workload": workload.to_dict(), "inputs": q.echo(), "titan_run_can_run": note is None,
                          "note": note, "ac_note": ac_note, "knob_notes": knob_notes,
                          "overlap_note": overlap_note,
                          "predicted": report.predicted(est, row), "remedies": rem}, indent=2))
        return 0
    print(f"{model.name} on {gpus} x {hw.name}: {plan.layout_str()}  {plan.knobs_str()}")
    print(q.workload_line())
    for line in (ac_note, *knob_notes, overlap_note, note):
        if line:
            print(f"note: {line}")
    print(report.format_breakdown(est, row))
    if rem is not None:
        print("\n".join(format_remedies(rem, float(est.peak_memory_bytes[row]) / GIB, est.capacity_bytes / GIB)))
    return 0
