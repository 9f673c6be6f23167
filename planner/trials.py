"""Measured trials: short real runs of the best analytic candidates, driven by an Optuna study.

Each trial is `titan-run` in its own process group (a subprocess; the planner
never imports torch) with a hard timeout. It writes ``summary.json`` (status
ok / oom / error, median step time after warm-up, tokens/s, peak memory per
rank, communication time per axis) and ``metrics.jsonl`` (one line per step),
which the study reads while the trial runs so the pruner can stop slow ones.

The study's parameters are a layout (degrees + pipeline schedule, chosen
among the analytic top layouts) and the knobs within it (micro-batch,
activation checkpointing, FSDP reshard, compile). The analytic ranking is
enqueued first; after that the sampler (TPE, with constraints so
that memory-infeasible points are learned as infeasible rather than as mere
failures) proposes. OOM, timeout and crash are recorded as infeasible with
their reason. The storage is a real database (SQLite by default), so a study
killed at any point resumes where it stopped, and optuna-dashboard opens it.
"""
from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cost_models.estimate import estimate
from search_spaces.plan import Plan, PlanError
from search_spaces.planfile import write_plan_file
from search_spaces.space import KNOB_KEYS
from search_spaces.table import CandidateTable

from . import report
from .progress import Progress
from .study_lock import StudyLock, TrialsError, file_name
from .trial_process import run_one
from .rank import PlanningResult

# optuna (the 'trials' extra) is imported only where a study runs: it is optional, and slow to import

LAYOUT_KEYS = ("dp_replicate", "dp_shard", "pp", "tp", "cp", "ep", "schedule", "stages_per_rank")
SAMPLED_KNOBS = ("microbatch", "ac", "reshard_after_forward", "compile")   # the study varies these within a layout
assert set(SAMPLED_KNOBS) <= set(KNOB_KEYS)
STUDY_ATTRS = ("model", "hardware", "gpus", "seq_len", "global_batch", "dtype")


@dataclass
class TrialSettings:
    n_trials: int = 8
    steps: int = 6                    # the first two are warm-up (compile, allocator) and not timed
    timeout_s: float = 300.0
    storage: str = "sqlite:///titan-trials.db"
    study_name: str | None = None
    run_root: str = "runs/trials"
    launcher: str | None = None       # template; placeholders {plan} {run_dir} {steps} {nproc}
    top_layouts: int = 8
    memory_margin: float = 0.1        # trial only candidates predicted to fit with this margin
    seed: int = 0
    extra_set: list[str] = field(default_factory=list)   # --set overrides passed to titan-run


@dataclass
class TrialOutcome:
    number: int
    plan: Plan
    status: str                       # ok | oom | timeout | error | pruned | illegal
    tokens_per_s: float | None
    step_time_s: float | None
    peak_memory_bytes: float | None
    predicted: dict[str, Any]
    reason: str = ""
    run_dir: str = ""


# --------------------------------------------------------------------------- one trial
def launch_command(settings: TrialSettings, plan_file: Path, run_dir: Path, nproc: int) -> list[str]:
    if settings.launcher:
        line = settings.launcher.format(plan=shlex.quote(str(plan_file)), run_dir=shlex.quote(str(run_dir)),
                                        steps=settings.steps, nproc=nproc)
        return shlex.split(line)
    cmd = [sys.executable, "-m", "executor.cli", "--plan", str(plan_file), "--nproc-per-node", str(nproc),
           "--steps", str(settings.steps), "--run-dir", str(run_dir), "--set", "train.tensorboard=false"]
    for s in settings.extra_set:
        cmd += ["--set", s]
    return cmd


# --------------------------------------------------------------------------- the study
def _layout_key(p: Plan) -> str:
    return ",".join(f"{k}={getattr(p, k)}" for k in LAYOUT_KEYS)


def _plan_from(layout: str, knobs: dict[str, Any], global_batch: int, base: Plan) -> Plan:
    """`base` with the layout and knobs of a trial; n_microbatches follows from the global batch."""
    d = {k: v for k, v in base.to_dict().items() if k != "n_microbatches"}
    for kv in layout.split(","):
        k, v = kv.split("=")
        d[k] = v if k == "schedule" else int(v)
    d.update(knobs)
    return Plan.complete(d, world_size=base.world_size, global_batch=global_batch)


def _native_constraints() -> bool:
    """Optuna >= 5 reads constraints stored on the trial (Trial.set_constraint); older ones take a function."""
    from optuna.trial import Trial    # optional package (the 'trials' extra)
    return hasattr(Trial, "set_constraint")


def open_study(settings: TrialSettings, attrs: dict[str, Any]):
    import optuna   # optuna: imported when used (slow to import; titan-plan's cold start)
    from sqlalchemy.exc import ArgumentError, OperationalError  # optuna's RDB storage is SQLAlchemy

    # the default name from the model, hardware (a preset's name, or a spec file's stem) and GPU count
    name = settings.study_name or "titan-" + "-".join(
        Path(v).stem if k != "gpus" and ("/" in v or v.endswith((".yaml", ".yml"))) else v
        for k, v in ((k, str(attrs[k])) for k in ("model", "hardware", "gpus")))
    url = settings.storage
    if url.startswith("sqlite:///"):
        db_dir = Path(url[len("sqlite:///"):]).resolve().parent
        if not db_dir.is_dir():
            raise TrialsError(f"--storage {url}: folder '{db_dir}' does not exist")
    extra = {} if _native_constraints() else {"constraints_func": _constraints}
    sampler = optuna.samplers.TPESampler(seed=settings.seed, n_startup_trials=max(1, settings.n_trials // 3),
                                         **extra)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2)
    try:
        storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 5}}
                                             if url.startswith("sqlite") else {})
        study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner,
                                    direction="maximize", load_if_exists=True)
    except OperationalError as e:
        msg = str(e.orig) if getattr(e, "orig", None) else str(e).splitlines()[0]
        raise TrialsError(f"--storage {url}: {msg} (is another titan-plan using it?)") from None
    except (ValueError, ImportError, ArgumentError) as e:   # ArgumentError: an unknown dialect or a bad URL
        raise TrialsError(f"--storage {url}: {' '.join(str(e).split())[:200]}") from None
    old = {k: study.user_attrs.get(k) for k in STUDY_ATTRS}
    if any(v is not None for v in old.values()):
        for k in STUDY_ATTRS:
            if old[k] != attrs[k]:
                raise TrialsError(f"study '{name}' in {url} was made for {k}={old[k]!r}, not {attrs[k]!r}; "
                                  "use another --study-name or --storage")
    else:
        for k in STUDY_ATTRS:
            study.set_user_attr(k, attrs[k])
    return study


def _set_constraint(trial, value: float) -> None:
    """<= 0 feasible; > 0 infeasible (over memory, oom, timeout, crash, illegal)."""
    trial.set_user_attr("constraint", float(value))
    if _native_constraints():
        trial.set_constraint("feasible", float(value))


def _constraints(trial) -> tuple[float]:
    # <= 0 feasible; > 0 infeasible (oom, timeout, crash, illegal)
    return (float(trial.user_attrs.get("constraint", 1.0)),)


def run_trials(res: PlanningResult, *, plan_inputs: dict[str, Any], settings: TrialSettings,
               space_knobs: dict[str, tuple], log=print) -> list[TrialOutcome]:
    """Run (or resume) the study; returns every finished trial, best first."""
    import optuna   # optuna: imported when used (slow to import; titan-plan's cold start)
    from optuna.distributions import CategoricalDistribution   # optuna: imported when used (slow import)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    est = res.est
    ok = np.flatnonzero(est.peak_memory_bytes <= est.capacity_bytes * (1 - settings.memory_margin))
    ranked = [int(i) for i in res.order if i in set(ok.tolist())]
    if not ranked:
        raise TrialsError(f"no candidate is predicted to fit with a {settings.memory_margin:.0%} memory margin")
    layouts: list[str] = []
    for i in ranked:
        k = _layout_key(res.table.plan(i))
        if k not in layouts:
            layouts.append(k)
        if len(layouts) >= settings.top_layouts:
            break
    base = res.table.plan(ranked[0])
    dists = {"layout": CategoricalDistribution(layouts)}
    for k in SAMPLED_KNOBS:
        dists[k] = CategoricalDistribution(sorted(set(space_knobs[k])) if k == "microbatch" else list(space_knobs[k]))
    attrs = {k: plan_inputs[k] for k in STUDY_ATTRS}
    study = open_study(settings, attrs)
    settings.study_name = study.study_name          # the stored name, for the caller to print
    lock = StudyLock(study, settings.storage)
    try:
        _run_study(study, res, dists, layouts, ranked, base, plan_inputs, settings, log)
    finally:
        lock.release()
    return outcomes(study)


def _measured(t) -> bool:
    """A trial that ran titan-run (ok, pruned, oom, timeout, error): one unit of the --trials budget."""
    return "plan" in t.user_attrs and "duplicate_of" not in t.user_attrs


def _run_study(study, res, dists, layouts, ranked, base, plan_inputs, settings, log) -> None:
    """Ask, answer and measure until `settings.n_trials` points are measured (or the space is exhausted)."""
    from optuna.trial import TrialState   # optuna: imported when used (slow to import; titan-plan's cold start)

    _resume_and_enqueue(study, res, layouts, ranked, settings)
    finished = (TrialState.COMPLETE, TrialState.PRUNED)
    n_points = int(np.prod([len(d.choices) for d in dists.values()]))

    def answered():   # params -> the finished trial that answers them (a measurement, or an illegal point)
        return {tuple(sorted(t.params.items())): t for t in study.get_trials(deepcopy=False, states=finished)
                if "duplicate_of" not in t.user_attrs and ("plan" in t.user_attrs
                                                           or t.user_attrs.get("status") == "illegal")}

    n_done = sum(_measured(t) for t in study.get_trials(deepcopy=False, states=finished))
    if n_done >= settings.n_trials:
        log(f"[trials] study '{study.study_name}' already has {n_done} measured trials; nothing to run")
        return
    with Progress(settings.n_trials, "trials", unit="trial", initial=n_done) as bar:
        log = bar.wrap(log)            # log lines above the bar, not through it
        while n_done < settings.n_trials:
            known = answered()
            if len(known) >= n_points:
                log(f"[trials] every one of the {n_points} points of the space is answered; stopping at "
                    f"{n_done} of {settings.n_trials} measurements")
                break
            trial = study.ask(dists)
            params = trial.params
            twin = known.get(tuple(sorted(params.items())))
            if twin is not None:   # a point already answered: reuse it, spend no budget
                _answer_from(study, trial, twin)
                continue
            try:
                plan = _plan_from(params["layout"], {k: params[k] for k in SAMPLED_KNOBS},
                                  plan_inputs["global_batch"], base)
            except PlanError as e:   # an illegal point: infeasible, pruned, never a measured 0.0
                _refuse_illegal(study, trial, e)
                continue
            status = _measure(study, trial, plan, res, plan_inputs, settings, log,
                              label=f"{n_done + 1}/{settings.n_trials}")
            n_done += 1
            bar.step(f"#{trial.number} {status}")


def _resume_and_enqueue(study, res, layouts, ranked, settings) -> None:
    """Trials left RUNNING by a killed titan-plan (the study lock says none is running now) are marked failed
    and their points enqueued again; a new study gets the analytic ranking's distinct points first."""
    from optuna.trial import TrialState   # optuna: imported when used (slow to import; titan-plan's cold start)

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
        study.enqueue_trial(t.params, skip_if_exists=False)
    if study.user_attrs.get("enqueued"):
        return
    seen = set()
    for i in ranked:
        p = res.table.plan(i)
        params = {"layout": _layout_key(p), **{k: getattr(p, k) for k in SAMPLED_KNOBS}}
        key = tuple(sorted(params.items()))
        if params["layout"] in layouts and key not in seen:
            seen.add(key)
            study.enqueue_trial(params)
        if len(seen) >= max(1, settings.n_trials // 2):
            break
    study.set_user_attr("enqueued", True)


def _answer_from(study, trial, twin) -> None:
    """A duplicate proposal: the answer of the finished trial `twin`, no run, no budget."""
    from optuna.trial import TrialState   # optuna: imported when used (slow to import; titan-plan's cold start)

    for k, v in twin.user_attrs.items():
        trial.set_user_attr(k, v)
    trial.set_user_attr("duplicate_of", twin.number)
    _set_constraint(trial, twin.user_attrs.get("constraint", 0.0))
    if twin.state == TrialState.COMPLETE:
        study.tell(trial, twin.value)
    else:
        study.tell(trial, state=TrialState.PRUNED)


def _refuse_illegal(study, trial, e: PlanError) -> None:
    from optuna.trial import TrialState   # optuna: imported when used (slow to import; titan-plan's cold start)

    trial.set_user_attr("status", "illegal")
    trial.set_user_attr("reason", str(e))
    _set_constraint(trial, 1.0)
    study.tell(trial, state=TrialState.PRUNED)


def _measure(study, trial, plan: Plan, res, plan_inputs, settings, log, *, label: str) -> str:
    """Run titan-run on `plan` (pruned from its per-step times), record the result; returns its status."""
    gb = plan_inputs["global_batch"]
    one = estimate(CandidateTable.from_plans([plan]), res.model, res.hw, res.workload, res.coeffs)
    pred = report.predicted(one, 0)
    run_dir = Path(settings.run_root) / file_name(study.study_name) / f"trial{trial.number:04d}"
    plan_file = run_dir / "plan.yaml"
    write_plan_file(plan_file, {"model": plan_inputs["model"], "hardware": plan_inputs["hardware"],
                                "workload": plan_inputs["workload"], "plan": plan, "predicted": pred})
    trial.set_user_attr("plan", plan.to_dict())
    trial.set_user_attr("predicted", pred)
    log(f"[trials] trial {label} (#{trial.number}): {plan.describe()} "
        f"(predicted {pred['tokens_per_s']:,.0f} tok/s, {pred['peak_memory_gib']:.2f} GiB)")
    step_times: dict[int, float] = {}

    def on_step(step: int, step_time: float) -> bool:
        step_times[step] = step_time
        trial.report(step_time and gb * plan_inputs["seq_len"] / step_time, step)
        return step > 2 and trial.should_prune()

    t0 = time.monotonic()
    s = run_one(launch_command(settings, plan_file, run_dir, plan_inputs["gpus"]), run_dir, settings.timeout_s,
                on_step)
    if s.get("status") == "pruned":
        timed = [v for k, v in sorted(step_times.items()) if k > 2 and v > 0]   # after the 2 warm-up steps
        if timed:
            s["step_time_s"] = float(np.median(timed))
    record_result(study, trial, s, capacity_bytes=res.est.capacity_bytes,
                  wall_s=time.monotonic() - t0, run_dir=run_dir, log=log)
    return s.get("status", "error")


def record_result(study, trial, s: dict[str, Any], *, capacity_bytes: float, wall_s: float, run_dir: Path,
                  log=print) -> None:
    """Store one trial's summary on the Optuna trial and finish it (value = measured tokens/s)."""
    from optuna.trial import TrialState   # optuna: imported when used (slow to import; titan-plan's cold start)

    status = s.get("status", "error")
    trial.set_user_attr("status", status)
    trial.set_user_attr("wall_s", round(wall_s, 2))
    trial.set_user_attr("run_dir", str(run_dir))
    if status == "ok":
        for k in ("step_time_s", "tokens_per_s", "peak_memory_bytes", "peak_memory_bytes_per_rank",
                  "comm_s_per_step", "mfu"):
            if s.get(k) is not None:
                trial.set_user_attr(k, s[k])
        _set_constraint(trial, float((s.get("peak_memory_bytes") or 0) - capacity_bytes) / capacity_bytes)
        study.tell(trial, float(s["tokens_per_s"]))
        log(f"[trials]   ok: {s['tokens_per_s']:,.1f} tok/s measured, step {s['step_time_s']:.3f} s, "
            f"peak {(s.get('peak_memory_bytes') or 0) / 2 ** 30:.3f} GiB")
    elif status == "pruned":
        if s.get("step_time_s"):           # the steps it ran (calibrate uses them)
            trial.set_user_attr("step_time_s", float(s["step_time_s"]))
        _set_constraint(trial, 0.0)
        study.tell(trial, state=TrialState.PRUNED)
        log("[trials]   pruned (slower than the median of earlier trials)")
    else:
        trial.set_user_attr("reason", s.get("reason", ""))
        _set_constraint(trial, 1.0)
        study.tell(trial, 0.0)
        log(f"[trials]   {status}: {s.get('reason', '')[:200]}")


def outcomes(study) -> list[TrialOutcome]:
    from optuna.trial import TrialState   # optuna: imported when used (slow to import; titan-plan's cold start)

    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if "plan" not in t.user_attrs or "duplicate_of" in t.user_attrs:
            continue
        ua = t.user_attrs
        out.append(TrialOutcome(number=t.number, plan=Plan.from_dict(ua["plan"]), status=ua.get("status", "?"),
                                tokens_per_s=ua.get("tokens_per_s"), step_time_s=ua.get("step_time_s"),
                                peak_memory_bytes=ua.get("peak_memory_bytes"), predicted=ua.get("predicted", {}),
                                reason=ua.get("reason", ""), run_dir=ua.get("run_dir", "")))
    out.sort(key=lambda o: -(o.tokens_per_s or 0) if o.status == "ok" else 0)
    return out
