"""The experiment of issue 6: does measuring and calibrating make the planner pick well?

On this machine (CPU, gloo) it measures EVERY feasible layout of the debug
model at world N (default 4) as a real `titan-run` trial, then reports

1. Spearman rho between predicted and measured step time, before calibration
   (default coefficients) and after (leave-one-out: each layout predicted by a
   fit that did not see it; in-sample too)                    target after >= 0.85
2. measured throughput of the calibrated model's top pick vs the measured best
                                                              target >= 0.90
3. how many trials a real Optuna study (`titan-plan --trials`, the analytic
   ranking enqueued first, then TPE) ran before it measured a layout within 5%
   of the best                                                target <= 1/3 of all
4. measured throughput of the calibrated planner's pick vs the practitioners'
   rule of thumb (TP inside a node, PP only to fit memory, the rest DP), run
   side by side, alternating, median of `--repeats` runs each  target >= 1.10x
5. the memory band: measured peak / predicted peak of every trial after
   calibration                                                target [0.91, 1.0]

Layout = the degrees (dp_replicate, dp_shard, pp, tp, cp) plus the pipeline
schedule; within a layout the micro-batch is the analytic model's choice and the
other knobs are fixed (no activation checkpointing, reshard after forward, no
compile: an Inductor build per trial would dominate the wall time on 2 cores).
Everything measured is stored in an Optuna SQLite study (`--out/trials.db`), so
`titan-plan calibrate --storage sqlite:///.../trials.db --study-name ...-sweep`
reproduces the fit, and a rerun skips layouts already measured.

Each trial takes the lock /tmp/titan_heavy.lock while it runs (other heavy jobs
on the box wait for it), so timings are not measured against another
multi-process job.

    python bench/prove_trials.py [--world 4] [--steps 12] [--out runs/prove]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models.coefficients import Coefficients  # noqa: E402
from cost_models.estimate import estimate  # noqa: E402
from cost_models.specs import load_hardware, load_model  # noqa: E402
from cost_models.workload import Workload  # noqa: E402
from planner import calibrate as cal  # noqa: E402
from planner import report  # noqa: E402
from planner.rank import plan_candidates  # noqa: E402
from planner.trials import (TrialSettings, _layout_key, launch_command, open_study, record_result,  # noqa: E402
                            run_one, run_trials)
from search_spaces.plan import Plan  # noqa: E402
from search_spaces.planfile import write_plan_file  # noqa: E402
from search_spaces.space import space_from_dict  # noqa: E402
from search_spaces.table import CandidateTable  # noqa: E402

LOCK = "/tmp/titan_heavy.lock"
KNOBS = {"microbatch": [1, 2, 4, 8],
         "schedule": ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"],
         "stages_per_rank": [2], "ac": ["none"], "reshard_after_forward": [True], "compile": [False],
         "float8": [False]}
SPACE = {"name": "prove", "degrees": {"dp_replicate": "all", "pp": "all", "tp": "all", "cp": "all", "ep": [1]},
         "knobs": KNOBS}


@contextlib.contextmanager
def heavy_lock():
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.model = load_model(args.model)
        # one host runs all `world` processes (as titan-plan takes a CPU host by default)
        self.hw = dataclasses.replace(load_hardware(args.hardware), gpus_per_node=args.world)
        self.wl = Workload(seq_len=args.seq_len, global_batch=args.global_batch or 8 * args.world, dtype="fp32")
        self.space = space_from_dict(SPACE)
        self.storage = f"sqlite:///{self.out / 'trials.db'}"
        self.inputs = {"model": args.model, "hardware": args.hardware, "gpus": args.world,
                       "seq_len": self.wl.seq_len, "global_batch": self.wl.global_batch, "dtype": self.wl.dtype,
                       "workload": self.wl.to_dict()}

    def settings(self, study: str, **kw) -> TrialSettings:
        return TrialSettings(steps=self.args.steps, timeout_s=self.args.timeout, storage=self.storage,
                             study_name=study, run_root=str(self.out / "runs"), **kw)

    def rank(self, coeffs: Coefficients | None = None):
        return plan_candidates(self.space, self.model, self.hw, self.wl, world_size=self.args.world,
                               gpus_per_node=self.args.world, coeffs=coeffs)

    # ---------------------------------------------------------------- measuring
    def measure(self, study_name: str, plans: list[Plan], label: str, passes: int = 1) -> dict[Plan, dict]:
        """Run each plan `passes` times (even passes in reverse order) as trials stored in `study_name`;
        runs already there are not repeated. Returns per plan: median step time and tokens/s over the
        passes, the largest peak memory, and the status (ok only if every pass was ok)."""
        from optuna.trial import TrialState
        st = self.settings(study_name)
        study = open_study(st, {k: self.inputs[k] for k in ("model", "hardware", "gpus", "seq_len",
                                                            "global_batch", "dtype")})
        runs: dict[tuple[Plan, int], dict] = {}
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if "plan" in t.user_attrs:
                key = (Plan.from_dict(t.user_attrs["plan"]), int(t.user_attrs.get("pass", 1)))
                runs[key] = dict(t.user_attrs)
        for pass_no in range(1, passes + 1):
            order = plans if pass_no % 2 else plans[::-1]
            for n, p in enumerate(order):
                if (p, pass_no) in runs:
                    continue
                trial = study.ask()
                est = estimate(CandidateTable.from_plans([p]), self.model, self.hw, self.wl)
                pred = report.predicted(est, 0)
                run_dir = self.out / "runs" / study_name / f"trial{trial.number:04d}"
                plan_file = run_dir / "plan.yaml"
                write_plan_file(plan_file, {"model": self.args.model, "hardware": self.args.hardware,
                                            "workload": self.wl.to_dict(), "plan": p, "predicted": pred})
                trial.set_user_attr("plan", p.to_dict())
                trial.set_user_attr("predicted", pred)
                trial.set_user_attr("pass", pass_no)
                print(f"[{label} pass {pass_no}/{passes} {n + 1}/{len(plans)}] {report.layout_str(p)} "
                      f"{report.knobs_str(p)}", flush=True)
                with heavy_lock():
                    t0 = time.monotonic()
                    s = run_one(launch_command(st, plan_file, run_dir, self.args.world), run_dir, st.timeout_s)
                record_result(study, trial, s, capacity_bytes=est.capacity_bytes, wall_s=time.monotonic() - t0,
                              run_dir=run_dir, log=lambda m: print(m, flush=True))
                runs[(p, pass_no)] = dict(study.trials[trial.number].user_attrs)
        out: dict[Plan, dict] = {}
        for p in plans:
            got = [runs[(p, i)] for i in range(1, passes + 1) if (p, i) in runs]
            ok = [g for g in got if g.get("status") == "ok"]
            if len(ok) < len(got) or not ok:
                bad = next(g for g in got if g.get("status") != "ok")
                out[p] = {"status": bad.get("status"), "reason": bad.get("reason", "")}
                continue
            out[p] = {"status": "ok", "plan": p.to_dict(), "passes": len(ok),
                      "step_time_s": statistics.median(g["step_time_s"] for g in ok),
                      "tokens_per_s": statistics.median(g["tokens_per_s"] for g in ok),
                      "peak_memory_bytes": max(g.get("peak_memory_bytes") or 0 for g in ok) or None,
                      "spread": (max(g["step_time_s"] for g in ok) / min(g["step_time_s"] for g in ok))}
        return out

    # ---------------------------------------------------------------- phases
    def layouts(self):
        """Every feasible layout with the analytic model's best micro-batch for it."""
        res = self.rank()
        best: dict[str, int] = {}
        for i in res.order:
            best.setdefault(_layout_key(res.table.plan(int(i))), int(i))
        return res, [res.table.plan(i) for i in best.values()]

    def rule_of_thumb(self) -> Plan:
        """TP inside a node as far as the heads allow, PP only if nothing fits without it, the rest FSDP."""
        res = self.rank()
        m = self.model
        world, node = self.args.world, self.args.world      # one node of `world` devices here
        tp = max(t for t in range(1, node + 1) if node % t == 0 and world % t == 0
                 and m.n_heads % t == 0 and m.n_kv_heads % t == 0)
        for pp in [d for d in range(1, world // tp + 1) if (world // tp) % d == 0]:
            for i in res.order:       # feasible, best first: the analytic micro-batch for this layout
                p = res.table.plan(int(i))
                if (p.tp, p.pp, p.cp, p.dp_replicate) == (tp, pp, 1, 1) and (pp == 1 or p.schedule == "1F1B"):
                    return p
        raise SystemExit("rule of thumb: no layout fits")

    def run(self) -> None:
        a = self.args
        res, plans = self.layouts()
        print(f"[prove] {self.model.name} on {a.world} x {self.hw.name}: {res.n_candidates} candidates, "
              f"{len(plans)} feasible layouts; {a.steps} steps per trial (first 2 not timed)", flush=True)
        sweep_name = f"prove-{self.model.name}-w{a.world}-sweep"
        sweep = self.measure(sweep_name, plans, "sweep", passes=a.passes)
        ok = {k: v for k, v in sweep.items() if v.get("status") == "ok"}
        failed = {k: v for k, v in sweep.items() if v.get("status") != "ok"}
        for k, v in failed.items():
            print(f"[prove] trial failed ({v.get('status')}): {v.get('reason', '')[:200]}")
        best = max(ok, key=lambda p: ok[p]["tokens_per_s"])
        best_tps = ok[best]["tokens_per_s"]
        print(f"[prove] measured best: {report.layout_str(best)} {report.knobs_str(best)} {best_tps:,.0f} tok/s",
              flush=True)

        # -- calibration on the sweep
        m = cal.load_measurements(self.storage, sweep_name, self.args.hardware)
        r = cal.calibrate(m, loo=True)
        coeffs = r["coefficients"]
        cal.save(r, m, str(self.out / "calibration.yaml"))
        with contextlib.suppress(Exception):
            cal.plot(r, m, str(self.out / "calibration.png"))
        rho_before = r["time_before"]["spearman"]
        rho_loo = r["time_after_loo"]["spearman"]
        rho_in = r["time_after_in_sample"]["spearman"]
        band = r["memory_band_after"]
        band_loo = r.get("memory_band_loo", {})
        print(f"[prove] step time: before median APE {r['time_before']['median_ape_pct']:.1f}% rho {rho_before:.3f}; "
              f"after (LOO) median APE {r['time_after_loo']['median_ape_pct']:.1f}% rho {rho_loo:.3f}; "
              f"in-sample rho {rho_in:.3f}", flush=True)

        # -- the calibrated planner's pick over the same space; measured if the sweep did not have it
        res_c = self.rank(coeffs)
        pick = res_c.table.plan(res_c.best())
        extra_name = f"prove-{self.model.name}-w{a.world}-extra"
        pick_meas = ok.get(pick) or self.measure(extra_name, [pick], "pick")[pick]
        pick_ratio = pick_meas["tokens_per_s"] / best_tps
        print(f"[prove] calibrated pick: {report.layout_str(pick)} {report.knobs_str(pick)} "
              f"{pick_meas['tokens_per_s']:,.0f} tok/s = {pick_ratio:.3f} of the measured best", flush=True)

        # -- a real Optuna study (uncalibrated analytic ranking first, then TPE), 1/3 of the layouts
        n_opt = max(1, math.ceil(len(plans) / 3))
        opt_name = f"prove-{self.model.name}-w{a.world}-optuna"
        st = self.settings(opt_name, n_trials=n_opt, top_layouts=len(plans), seed=a.seed)
        with heavy_lock():
            rows = run_trials(res, plan_inputs=self.inputs, settings=st, space_knobs=dict(self.space.knobs),
                              log=lambda msg: print(msg, flush=True))
        first_within = None
        for n_run, o in enumerate(sorted(rows, key=lambda o: o.number), start=1):   # real runs only
            tps = o.tokens_per_s if o.status == "ok" else None
            swept = ok.get(o.plan)
            if tps and tps >= 0.95 * best_tps or (swept and swept["tokens_per_s"] >= 0.95 * best_tps):
                first_within = n_run
                break
        print(f"[prove] Optuna: {len(rows)} trials run; first within 5% of the best at trial "
              f"{first_within if first_within else 'never'} (budget {n_opt} = 1/3 of {len(plans)})", flush=True)

        # -- planner pick vs rule of thumb, side by side, alternating
        rule = self.rule_of_thumb()
        side = f"prove-{self.model.name}-w{a.world}-side"
        both = self.measure(side, [pick, rule], "side by side", passes=a.repeats)   # alternating order
        for p in (pick, rule):
            if both[p]["status"] != "ok":
                raise SystemExit(f"side-by-side run of {report.layout_str(p)} failed: {both[p]}")
        pick_tps, rule_tps = both[pick]["tokens_per_s"], both[rule]["tokens_per_s"]
        vs_rule = pick_tps / rule_tps
        print(f"[prove] side by side ({a.repeats} runs each): pick {report.layout_str(pick)} median "
              f"{pick_tps:,.0f} tok/s, rule of thumb {report.layout_str(rule)} "
              f"{report.knobs_str(rule)} median {rule_tps:,.0f} tok/s", flush=True)

        summary = {
            "layouts": len(plans), "measured_ok": len(ok), "failed": len(failed),
            "spearman_before": rho_before, "spearman_after_loo": rho_loo, "spearman_after_in_sample": rho_in,
            "time_median_ape_before": r["time_before"]["median_ape_pct"],
            "time_median_ape_after_loo": r["time_after_loo"]["median_ape_pct"],
            "pick": report.layout_str(pick) + " " + report.knobs_str(pick), "pick_vs_best": pick_ratio,
            "optuna_trials_to_within_5pct": first_within, "optuna_budget": n_opt,
            "pick_vs_rule_of_thumb": vs_rule, "rule_of_thumb": report.layout_str(rule),
            "memory_band_in_sample": band, "memory_band_loo": band_loo,
            "coefficients": {k: v for k, v in coeffs.to_dict().items()
                             if v != Coefficients().to_dict()[k]},
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
        print(json.dumps(summary, indent=1, default=float))
        first = first_within if first_within is not None else float("inf")
        print(f"RESULT prove_trials_w{a.world}: {len(ok)}/{len(plans)} layouts measured; "
              f"rho before {rho_before:.3f} after {rho_loo:.3f} LOO ({rho_in:.3f} in-sample) (target >= 0.85); "
              f"calibrated pick = {pick_ratio:.3f} of best (target >= 0.90); "
              f"Optuna within 5% at trial {first_within} of {len(plans)} (target <= {n_opt}); "
              f"pick vs rule of thumb {vs_rule:.2f}x (target >= 1.10); "
              f"memory measured/predicted after calibration {band['min_measured_over_predicted']:.3f}"
              f"-{band['max_measured_over_predicted']:.3f} in-sample, "
              f"{band_loo.get('min_measured_over_predicted', float('nan')):.3f}"
              f"-{band_loo.get('max_measured_over_predicted', float('nan')):.3f} LOO (target 0.91-1.00)"
              + ("" if first <= n_opt else " [Optuna target missed]"))

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-debug")
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, help="sequences per step (default 8 x world)")
    ap.add_argument("--steps", type=int, default=12, help="steps per trial; the first two are not timed")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per trial")
    ap.add_argument("--passes", type=int, default=2, help="runs of every layout (median); even passes in "
                    "reverse order")
    ap.add_argument("--repeats", type=int, default=3, help="side-by-side runs of pick and rule of thumb")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/prove")
    Bench(ap.parse_args()).run()


if __name__ == "__main__":
    main()
