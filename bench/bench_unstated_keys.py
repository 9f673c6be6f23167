"""How much of the validation rests on workload keys a user may not state: the published rows scored with
each row's workload cut down to a few keys, every other key at its default (``auto``).

`bench/validate_reference.py` maps every row through its framework's regime (`cost_models/frameworks.py`) and
what the row states, so it scores what `titan-plan estimate --framework NAME ...` gives.  A user who gives the
layout and only the basic workload flags -- the sequence, the batch, the dtype, the state layout and ZeRO stage,
sequence parallelism, the attention kernel, dropout and the recompute policy, the keys of issue 12's first
list -- gets the defaults for the rest (kernels, overlaps, gradient dtype, pipeline memory keys), each
unstated key taken as `titan-plan estimate` takes it (`planner.whatif.workload_variants`).  This prints
the throughput median / worst APE and the fit verdicts of both ways on both sets, the rows that move most, and
which keys differ from their defaults, so a default that is wrong for many published runs shows up here.

Usage: python bench/bench_unstated_keys.py [--keys K1,K2,...] [--top N] ; the headline line is printed last.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import validate_reference as vr  # noqa: E402
from cost_models.workload import Workload  # noqa: E402
from planner.whatif import pick_variant, runnable_under, workload_variants  # noqa: E402

BASIC = ("seq_len", "global_batch", "dtype", "state_layout", "zero", "sequence_parallel", "attention_impl",
         "dropout", "selective_ac", "recompute_modules")


def score(set_name: str, keys: tuple[str, ...]) -> dict:
    cases, _ = vr.build_cases(vr.load_set(set_name))
    full, cut, moved = [], [], []
    fit_full = fit_cut = trained = 0
    ref_full = ref_cut = oom = 0
    differ = collections.Counter()
    unfit = []
    for c in cases:
        w = Workload(**{k: getattr(c.workload, k) for k in keys})
        for f in dataclasses.fields(Workload):
            if getattr(w, f.name) != getattr(c.workload, f.name):
                differ[f.name] += 1
        a = vr.predict(c)
        # what `titan-plan estimate` takes for the keys left unstated (`planner.whatif.workload_variants`, each
        # variant on the row's layout if titan-run runs it there, kept by the variants' rule)
        variants, rule = workload_variants(w, [c.plan], c.model, frozenset(keys))
        preds, fitted, groups = [], {}, []
        for j, v in enumerate(variants):
            if j and not runnable_under(v, [c.plan]):
                continue
            if v.pp_grad_sync != w.pp_grad_sync and fitted.get((v.tp_activations, v.selective_ac)):
                continue            # a sync per micro-batch only where the default sync does not fit (as the estimate)
            preds.append(vr.predict(dataclasses.replace(c, workload=v)))
            groups.append(v.grad_dtype)
            if v.pp_grad_sync == w.pp_grad_sync:
                fitted[(v.tp_activations, v.selective_ac)] = preds[-1]["fits"]
        b = preds[pick_variant(rule, [p["fits"] for p in preds], [-p["tokens_per_s_per_gpu"] for p in preds], groups)]
        if c.trained and not b["fits"]:
            unfit.append(f"{c.id} ({b['device_peak_gib']:.1f} GiB)")
        if c.trained:
            trained += 1
            fit_full += a["fits"]
            fit_cut += b["fits"]
        else:                   # a layout that ran out of memory: refused?
            oom += 1
            ref_full += not a["fits"]
            ref_cut += not b["fits"]
        m = c.measured.get("tokens_per_s_per_gpu")
        if m and "tokens_per_s_per_gpu" not in c.not_counted:
            ea, eb = abs(a["tokens_per_s_per_gpu"] / m - 1), abs(b["tokens_per_s_per_gpu"] / m - 1)
            full.append(ea)
            cut.append(eb)
            moved.append((eb - ea, c.id, ea, eb))
    return dict(n=len(full), full=(statistics.median(full), max(full)), cut=(statistics.median(cut), max(cut)),
                fit=(fit_full, fit_cut, trained), refused=(ref_full, ref_cut, oom), moved=sorted(moved, reverse=True),
                differ=differ, unfit=unfit)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default=",".join(BASIC), help="the workload keys kept from each row (default: %(default)s)")
    ap.add_argument("--top", type=int, default=8, help="rows shown that move most (default: %(default)s)")
    args = ap.parse_args(argv)
    keys = tuple(k for k in args.keys.split(",") if k)
    unknown = [k for k in keys if k not in Workload.__dataclass_fields__]
    if unknown:
        ap.error(f"--keys: unknown workload key {unknown[0]!r} (allowed: {', '.join(Workload.__dataclass_fields__)})")
    head = []
    for set_name in ("shared", "extra"):
        r = score(set_name, keys)
        print(f"set {set_name!r}: throughput n={r['n']}: full workload median {100 * r['full'][0]:.1f}% worst "
              f"{100 * r['full'][1]:.1f}%; basic keys only median {100 * r['cut'][0]:.1f}% worst {100 * r['cut'][1]:.1f}%; "
              f"trained runs predicted to fit {r['fit'][0]} -> {r['fit'][1]} of {r['fit'][2]}; layouts that ran out "
              f"of memory refused {r['refused'][0]} -> {r['refused'][1]} of {r['refused'][2]}")
        if r["unfit"]:
            print("   trained, predicted not to fit with the basic keys:", ", ".join(r["unfit"]))
        for d, rid, ea, eb in r["moved"][:args.top]:
            print(f"   {100 * d:+6.1f} pts  {rid}: {100 * ea:.1f}% -> {100 * eb:.1f}%")
        print("   keys the rows set away from their defaults:", ", ".join(f"{k} {n}" for k, n in r["differ"].most_common()))
        head.append(f"{set_name}: median {100 * r['full'][0]:.1f}% -> {100 * r['cut'][0]:.1f}%, fit {r['fit'][0]} -> "
                    f"{r['fit'][1]}/{r['fit'][2]}, OOM refused {r['refused'][0]} -> {r['refused'][1]}/{r['refused'][2]}")
    print("HEADLINE unstated keys (full workload -> basic keys only): " + " | ".join(head))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
