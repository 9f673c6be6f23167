"""What would make a layout fit: the memory remedies `titan-plan estimate` lists when the layout does not.

A user who asks about one layout and hears DOES NOT FIT needs to know what to change.  Each remedy is one
change that keeps the layout's degrees and saves memory, stated as the flag that makes it:

* plan knobs titan-run runs: ``--ac selective`` / ``--ac full``, ``--selective-ac op`` (under ``ac: selective``:
  TorchTitan's per-op policy, every other matmul recomputed), ``--reshard``, ``--compile`` (fused kernels;
  at tp 1 its loss compiled too, keeping no fp32 copy of the logits), a smaller ``--microbatch``
  (more micro-batches of the same global batch), ``--pp-grad-sync every_microbatch`` (fsdp2, pp > 1, not
  the V schedules), ``--pp-split weighted`` (pp > 1: the first stage, which keeps the most micro-batches in
  flight, holds the embedding and a layer fewer), ``--tp-activations sharded`` (fsdp2, tp > 1: the TP blocks keep
  their sequence shards; titan-run's where `plan.tp_shards_unrunnable` allows, Megatron's otherwise);
* ``--grad-dtype bf16`` for the megatron layout (NeMo's and Megatron-Bridge's bf16 main gradients);
* other frameworks' regimes, which titan-run does not run (each a workload key the estimate reads):
  ``--pp-sent-tensors freed``, ``--norm-impl fused``, ``--swiglu-impl fused``, ``--gqa-kv native``,
  ``--loss-impl fused``;
* a whole framework's regime, ``--framework NAME`` with the rest of the question as asked
  (:func:`framework_regimes`): a layout that trained on another stack is told under which stacks'
  kernels and state layout it fits, since the verdict without the flag is titan-run's.

:func:`remedies` estimates every applicable single change (one vectorized estimate per workload) and, when
no single one fits, changes together: added largest saving first until the layout fits, or all of them
(which then still do not fit), titan-run's own changes tried first: a set of those that fits is preferred
to one that needs another framework's regime.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from cost_models.estimate import GIB, estimate
from cost_models.specs import SpecError
from search_spaces.plan import AC_MODES, Plan, PlanError, tp_shards_unrunnable
from search_spaces.table import CandidateTable

# workload regimes of other frameworks that save memory: (key, value, applies to the workload)
_REGIMES = (
    ("pp_sent_tensors", "freed", lambda wl, p: p.pp > 1 and wl.pp_keeps_sent),
    ("norm_impl", "fused", lambda wl, p: not wl.norm_fused(bool(p.compile))),
    ("swiglu_impl", "fused", lambda wl, p: not wl.swiglu_fused and not p.compile),
    # (titan-run's own loss is fused already at tp 1: executor tensor_parallel.loss_kind)
    ("loss_impl", "fused", lambda wl, p: not wl.loss_fused_at(p.compile, p.tp)),
)


@dataclasses.dataclass(frozen=True)
class Remedy:
    flags: tuple[str, ...]            # the flags that make the change, e.g. ("--ac", "full")
    titan_run: bool                   # titan-run runs it
    plan: dict[str, Any]              # plan keys it changes
    workload: dict[str, Any]          # workload keys it changes


def _flag(key: str, value) -> tuple[str, ...]:
    if key == "reshard_after_forward":
        return ("--reshard",) if value else ("--no-reshard",)
    if key == "compile":
        return ("--compile",) if value else ("--no-compile",)
    return (f"--{key.replace('_', '-')}", str(value))


def candidates(plan: Plan, workload, model) -> list[Remedy]:
    """Every single memory-saving change applicable to `plan` under `workload`."""
    out: list[Remedy] = []
    for ac in AC_MODES[AC_MODES.index(plan.ac) + 1:]:
        out.append(Remedy(_flag("ac", ac), True, {"ac": ac}, {}))
    if not plan.reshard_after_forward and plan.dp_shard > 1:
        out.append(Remedy(_flag("reshard_after_forward", True), True, {"reshard_after_forward": True}, {}))
    if not plan.compile:         # fused kernels, and titan-run's loss compiled at tp 1 (no fp32 copies of the logits)
        out.append(Remedy(_flag("compile", True), True, {"compile": True}, {}))
    mb = plan.microbatch
    for k in sorted({d for d in (mb // 2, 1) if 1 <= d < mb and mb % d == 0}, reverse=True):
        out.append(Remedy(_flag("microbatch", k), True,
                          {"microbatch": k, "n_microbatches": plan.n_microbatches * mb // k}, {}))
    if plan.pp > 1 and workload.state_layout == "fsdp2" and workload.pp_defers_grad_sync:
        out.append(Remedy(_flag("pp_grad_sync", "every_microbatch"), not plan.is_v_schedule, {},
                          {"pp_grad_sync": "every_microbatch"}))
    if plan.pp > 1 and not workload.pp_weighted:
        out.append(Remedy(_flag("pp_split", "weighted"), True, {}, {"pp_split": "weighted"}))
    if plan.ac == "selective" and workload.selective_policy == "matmul":   # TorchTitan's per-op policy, titan-run's too
        out.append(Remedy(_flag("selective_ac", "op"), True, {}, {"selective_ac": "op"}))
    if plan.tp > 1 and workload.state_layout == "fsdp2" and workload.tp_keeps_gathered:   # keep the sequence shards
        out.append(Remedy(_flag("tp_activations", "sharded"), not tp_shards_unrunnable(plan), {},
                          {"tp_activations": "sharded"}))
    if workload.state_layout == "megatron" and workload.grad_elem_bytes > 2 and workload.dtype == "bf16":
        out.append(Remedy(_flag("grad_dtype", "bf16"), False, {}, {"grad_dtype": "bf16"}))
    if workload.gqa_kv_expanded and model.n_kv_heads < model.n_heads:     # titan-run's own: K/V unexpanded
        out.append(Remedy(_flag("gqa_kv", "native"), True, {}, {"gqa_kv": "native"}))
    for key, value, applies in _REGIMES:
        if applies(workload, plan):
            out.append(Remedy(_flag(key, value), False, {}, {key: value}))
    return out


def _apply(plan: Plan, workload, changes: list[Remedy]):
    p = dict(plan.to_dict())
    w: dict[str, Any] = {}
    for r in changes:
        p.update(r.plan)
        w.update(r.workload)
    return Plan.from_dict(p, runnable=False), dataclasses.replace(workload, **w)


def _estimate(pairs, model, hw, coeffs):
    """[(plan, workload)] -> [(peak bytes, step s, fits)], one estimate per distinct workload; a pair whose
    workload cannot hold the plan's expert layout (ep folded over TP outside Megatron's, `for_expert_layout`)
    gets (inf, inf, False)."""
    out: list[Any] = [None] * len(pairs)
    by_wl: dict[Any, list[int]] = {}
    for i, (plan, wl) in enumerate(pairs):
        try:
            wl, _ = wl.for_expert_layout(plan.ep, plan.fsdp_size, plan.tp)
        except SpecError:
            out[i] = (float("inf"), float("inf"), False)
            continue
        by_wl.setdefault(wl, []).append(i)
    for wl, idx in by_wl.items():
        est = estimate(CandidateTable.from_plans([pairs[i][0] for i in idx]), model, hw, wl, coeffs)
        for j, i in enumerate(idx):
            out[i] = (float(est.peak_memory_bytes[j]), float(est.step_time_s[j]), bool(est.fits[j]))
    return out


def remedies(plan: Plan, model, hw, workload, coeffs, peak_bytes: float) -> dict[str, Any]:
    """The remedies for `plan` (whose estimated peak is `peak_bytes`): ``single`` (each change that fits,
    fastest first), and when none does, ``combined`` (changes added largest saving first until the layout
    fits, or all of them) -- each ``{"flags", "titan_run", "peak_memory_gib", "step_time_s", "fits"}``."""
    cands = []
    for r in candidates(plan, workload, model):
        try:
            cands.append((r, _apply(plan, workload, [r])))
        except (PlanError, ValueError):   # e.g. a micro-batch count the schedule cannot split
            continue
    got = _estimate([pw for _, pw in cands], model, hw, coeffs)

    def row(changes, fig):
        flags = tuple(f for r in changes for f in r.flags)
        return {"flags": " ".join(flags), "titan_run": all(r.titan_run for r in changes),
                "peak_memory_gib": round(fig[0] / GIB, 3), "step_time_s": round(fig[1], 6), "fits": fig[2]}

    single = sorted((row([r], g) for (r, _), g in zip(cands, got) if g[2]), key=lambda d: d["step_time_s"])
    out: dict[str, Any] = {"single": single, "combined": None}
    if single or not cands:
        return out
    saving = {id(r): peak_bytes - g[0] for (r, _), g in zip(cands, got)}
    titan = _greedy([r for r, _ in cands if r.titan_run], saving, plan, model, hw, workload, coeffs)
    out["combined"] = (titan if titan is not None and titan[1][2]
                       else _greedy([r for r, _ in cands], saving, plan, model, hw, workload, coeffs) or titan)
    if out["combined"] is not None:
        out["combined"] = row(*out["combined"])
    return out


def _greedy(cands: list[Remedy], saving: dict, plan, model, hw, workload, coeffs):
    """Changes of `cands` added largest saving first (one per key: the larger of two micro-batch or ac
    settings), estimated after each addition: (the first set that fits, or all of them, its figures), or
    None when fewer than two changes save anything."""
    chosen, keys = [], set()
    for r in sorted(cands, key=lambda r: -saving[id(r)]):
        key = tuple(sorted(r.plan)) + tuple(sorted(r.workload))
        if saving[id(r)] > 0 and key not in keys:
            keys.add(key)
            chosen.append(r)
    pairs = []
    for n in range(2, len(chosen) + 1):
        try:
            pairs.append((chosen[:n], _apply(plan, workload, chosen[:n])))
        except (PlanError, ValueError):
            continue
    if not pairs:
        return None
    figs = _estimate([pw for _, pw in pairs], model, hw, coeffs)
    k = next((k for k, f in enumerate(figs) if f[2]), len(figs) - 1)
    return pairs[k][0], figs[k]


def framework_regimes(plan: Plan, model, hw, workloads: dict[str, Any], coeffs) -> list[dict[str, Any]]:
    """The frameworks of `workloads` (name -> the question's workload under ``--framework name``) under whose
    regime `plan` fits, fastest first: ``{"framework", "flags", "peak_memory_gib", "step_time_s"}``."""
    names = list(workloads)
    figs = _estimate([(plan, workloads[n]) for n in names], model, hw, coeffs)
    return sorted(({"framework": n, "flags": f"--framework {n}", "peak_memory_gib": round(f[0] / GIB, 3),
                    "step_time_s": round(f[1], 6)} for n, f in zip(names, figs) if f[2]),
                  key=lambda d: d["step_time_s"])


def format_remedies(rem: dict[str, Any], peak_gib: float, usable_gib: float, *, shown: int = 3) -> list[str]:
    """Lines for the text report."""
    lines = [f"does not fit by {peak_gib - usable_gib:.1f} GiB (peak {peak_gib:.1f} of {usable_gib:.1f} usable); "
             + ("what would fit, one change each:" if rem["single"] else "no single change fits")]

    def one(d):
        who = "" if d["titan_run"] else "  (other frameworks' regime: titan-run does not run it)"
        return f"  {d['flags']}: peak {d['peak_memory_gib']:.1f} GiB, step {d['step_time_s']:.4g} s{who}"
    lines += [one(d) for d in rem["single"][:shown]]
    c = rem["combined"]
    if c is not None:
        lines.append(("  together: " if c["fits"] else "  even together, still DOES NOT FIT: ") + one(c).strip())
    if not rem["single"] and (c is None or not c["fits"]):
        lines.append("  the degrees must change: titan-plan (the search) ranks every layout that fits")
    fws = rem.get("frameworks") or []
    if fws:
        lines.append("  it fits under another framework's regime (titan-run does not run it): " + "; ".join(
            f"{d['flags']} peak {d['peak_memory_gib']:.1f} GiB, step {d['step_time_s']:.4g} s" for d in fws[:shown]))
    return lines
