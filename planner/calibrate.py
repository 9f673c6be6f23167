"""`titan-plan calibrate`: fit the cost model's coefficients to measured trials.

Time: the coefficients in `TIME_PARAMS` are fitted with
``scipy.optimize.least_squares`` (bounded, robust ``soft_l1`` loss) to the
log-ratio of predicted and measured step time, so a 10% miss weighs the same
on a 0.1 s and a 10 s step. Memory: `activation_memory_scale` and
`memory_overhead_bytes` are fitted to the log-ratio of measured and predicted
peak; then `memory_scale` multiplies the prediction just enough that every
measured peak is at or below it (the planner's "fits" must be a promise) while
keeping the spread of the ratios. The honest error figure is leave-one-out:
each trial predicted by coefficients fitted without it.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cost_models.coefficients import Coefficients
from cost_models.estimate import estimate, memory_by_key, time_breakdown
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable

from .local import on_this_host
from .rank import PlanningError

# (name, lower, upper) -- bounds keep the fit physical
TIME_PARAMS = (("gemm_efficiency_scale", 0.05, 4.0), ("attention_efficiency_scale", 0.05, 4.0),
               ("memory_bound_efficiency_scale", 0.05, 4.0), ("intra_bw_scale", 0.02, 20.0),
               ("intra_latency_scale", 0.05, 50.0), ("dp_overlap", 0.0, 1.0), ("cp_overlap", 0.0, 1.0),
               ("step_overhead_s", 0.0, 10.0), ("microbatch_overhead_s", 0.0, 1.0))
MEMORY_PARAMS = (("activation_memory_scale", 0.2, 5.0), ("memory_overhead_bytes", 0.0, 64 * 2 ** 30),
                 ("pipeline_buffer_memory_scale", 0.05, 5.0))


@dataclass
class Measurements:
    plans: list[Plan]
    step_time_s: np.ndarray
    peak_memory_bytes: np.ndarray
    model: Any
    hw: Any
    workload: Workload
    source: str


def load_measurements(storage: str, study_name: str | None, hardware: str | None = None) -> Measurements:
    import optuna                        # optional ('trials' extra), slow to import
    from optuna.trial import TrialState   # optuna: imported when used (slow to import; titan-plan's cold start)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if storage.startswith("sqlite:///") and not Path(storage[len("sqlite:///"):]).is_file():
        # optuna would create an empty database at a mistyped path
        raise PlanningError(f"--storage {storage}: no database file '{storage[len('sqlite:///'):]}'")
    try:
        names = [s.study_name for s in optuna.study.get_all_study_summaries(storage)]
    except Exception as e:  # noqa: BLE001 - storage errors come in many types
        raise PlanningError(f"--storage {storage}: {str(e).splitlines()[0]}") from None
    if not names:
        raise PlanningError(f"--storage {storage}: no study in it")
    if study_name is None:
        if len(names) > 1:
            raise PlanningError(f"--storage {storage} holds {len(names)} studies ({', '.join(names)}); "
                                "pick one with --study-name")
        study_name = names[0]
    if study_name not in names:
        raise PlanningError(f"no study '{study_name}' in {storage} (there: {', '.join(names)})")
    study = optuna.load_study(study_name=study_name, storage=storage)
    ua = study.user_attrs
    # repeated runs of one plan count as one measurement (median step time, largest peak), so
    # leave-one-out never keeps a twin of the held-out plan in the fit
    runs: dict[Plan, tuple[list[float], list[float]]] = {}
    # a pruned trial ran its first steps: its median step time counts; its peak memory is unknown (NaN)
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        a = t.user_attrs
        if a.get("status") not in ("ok", "pruned") or "duplicate_of" in a or not a.get("step_time_s"):
            continue
        t_runs, m_runs = runs.setdefault(Plan.from_dict(a["plan"]), ([], []))   # Plan is hashable
        t_runs.append(float(a["step_time_s"]))
        m_runs.append(float(a.get("peak_memory_bytes") or np.nan) if a["status"] == "ok" else np.nan)
    plans = list(runs)
    times = [float(np.median(t)) for t, _ in runs.values()]
    mems = [float(np.nanmax(m)) if np.isfinite(m).any() else np.nan for _, m in runs.values()]
    if len(plans) < 3:
        raise PlanningError(f"study '{study_name}' has {len(plans)} measured plans (ok or pruned with step times); "
                            "calibration needs >= 3")
    wl = Workload(seq_len=int(ua["seq_len"]), global_batch=int(ua["global_batch"]), dtype=ua.get("dtype", "bf16"))
    hw = on_this_host(load_hardware(hardware or ua["hardware"]), hardware or ua["hardware"])
    if hw.device == "cpu" and ua.get("gpus"):   # CPU trials run on one host (titan-plan's default topology)
        hw = dataclasses.replace(hw, gpus_per_node=int(ua["gpus"]))
    return Measurements(plans=plans, step_time_s=np.array(times), peak_memory_bytes=np.array(mems),
                        model=load_model(ua["model"]), hw=hw, workload=wl, source=f"{storage} study '{study_name}'")


def _table(m: Measurements, idx=None) -> CandidateTable:
    return CandidateTable.from_plans(m.plans if idx is None else [m.plans[i] for i in idx])


def predict(m: Measurements, coeffs: Coefficients, idx=None):
    est = estimate(_table(m, idx), m.model, m.hw, m.workload, coeffs)
    return est.step_time_s, est.peak_memory_bytes


def _step_times(m: Measurements, table: CandidateTable, coeffs: Coefficients) -> np.ndarray:
    """The predicted step times alone (what the time fit evaluates, thousands of times)."""
    return sum(time_breakdown(table, m.model, m.hw, m.workload, coeffs).values())


def _peaks(m: Measurements, table: CandidateTable, coeffs: Coefficients) -> np.ndarray:
    """The predicted peaks alone (what the memory fit evaluates)."""
    return sum(memory_by_key(table, m.model, m.hw, m.workload, coeffs).values())


def _with(base: Coefficients, names, x) -> Coefficients:
    return dataclasses.replace(base, **{n: float(v) for n, v in zip(names, x)})


def fit(m: Measurements, idx: np.ndarray, base: Coefficients | None = None) -> Coefficients:
    from scipy.optimize import least_squares   # scipy: optional, and slow to import for every titan-plan

    base = base or Coefficients()
    tn = [p[0] for p in TIME_PARAMS]
    lo = np.array([p[1] for p in TIME_PARAMS])
    hi = np.array([p[2] for p in TIME_PARAMS])
    x0 = np.clip([getattr(base, n) for n in tn], lo, hi)
    meas_t = m.step_time_s[idx]
    table = _table(m, idx)

    def res_t(x):
        return np.log(_step_times(m, table, _with(base, tn, x)) / meas_t)

    x = least_squares(res_t, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, x_scale="jac").x
    c = _with(base, tn, x)
    mem_ok = idx[np.isfinite(m.peak_memory_bytes[idx])]
    if len(mem_ok) >= 2:
        c = fit_memory(m, mem_ok, c)
    return c


def fit_memory(m: Measurements, idx: np.ndarray, c: Coefficients) -> Coefficients:
    """Memory coefficients: shape first, then the promise.

    `MEMORY_PARAMS` are fitted to log(measured / predicted) -- robust least squares,
    then refined to the smallest spread max - min of those log-ratios (the band is what
    the promise costs); then `memory_scale` multiplies the whole prediction by the
    largest remaining ratio, so every measured peak is at or under its prediction while
    the spread is kept -- an additive overhead raised to cover the worst trial would
    push small plans far below their predictions.
    """
    from scipy.optimize import least_squares, minimize   # scipy: optional, slow to import

    mn = [p[0] for p in MEMORY_PARAMS]
    lo_m = np.array([p[1] for p in MEMORY_PARAMS])
    hi_m = np.array([p[2] for p in MEMORY_PARAMS])
    meas_m = m.peak_memory_bytes[idx]
    scale = np.array([1.0, float(np.median(meas_m)), 1.0])   # make the unknowns O(1)
    c = dataclasses.replace(c, memory_scale=1.0)
    table = _table(m, idx)

    def res_m(z):
        return np.log(meas_m / _peaks(m, table, _with(c, mn, z * scale)))

    z0 = np.clip([getattr(c, n) for n in mn], lo_m, hi_m) / scale
    lo_z, hi_z = lo_m / scale, hi_m / scale
    z = least_squares(res_m, z0, bounds=(lo_z, hi_z), loss="soft_l1", f_scale=0.02).x

    def spread(zz):
        lr = res_m(np.clip(zz, lo_z, hi_z))
        return float(lr.max() - lr.min())

    zs = minimize(spread, z, method="Nelder-Mead", options={"xatol": 1e-4, "fatol": 1e-6, "maxiter": 2000}).x
    if spread(zs) < spread(z):
        z = np.clip(zs, lo_z, hi_z)
    c = _with(c, mn, z * scale)
    mem = _peaks(m, table, c)
    worst = float(np.max(meas_m / mem))     # the promise: predicted >= measured for every trial
    return dataclasses.replace(c, memory_scale=max(worst, 1e-3) * 1.001)


def errors(pred: np.ndarray, meas: np.ndarray) -> dict[str, float]:
    from scipy.stats import spearmanr    # scipy: optional, slow to import

    ok = np.isfinite(meas) & np.isfinite(pred)
    ape = np.abs(pred[ok] - meas[ok]) / meas[ok] * 100
    rho = float(spearmanr(pred[ok], meas[ok]).statistic) if ok.sum() >= 3 else float("nan")
    return {"median_ape_pct": float(np.median(ape)), "worst_ape_pct": float(np.max(ape)), "spearman": rho}


def calibrate(m: Measurements, *, loo: bool = True) -> dict[str, Any]:
    n = len(m.plans)
    idx = np.arange(n)
    base = Coefficients()
    t0, mem0 = predict(m, base)
    fitted = fit(m, idx, base)
    t1, mem1 = predict(m, fitted)
    out: dict[str, Any] = {
        "trials": n,
        "time_before": errors(t0, m.step_time_s), "time_after_in_sample": errors(t1, m.step_time_s),
        "memory_before": errors(mem0, m.peak_memory_bytes),
        "memory_after_in_sample": errors(mem1, m.peak_memory_bytes),
        "memory_band_after": _band(m.peak_memory_bytes, mem1),
        "coefficients": fitted, "pred_before": (t0, mem0), "pred_after": (t1, mem1),
    }
    if loo and n >= 4:
        t_loo, mem_loo = np.empty(n), np.empty(n)
        for i in range(n):
            c = fit(m, np.delete(idx, i), fitted)   # warm start: the same optimum, fewer iterations
            t, mm = predict(m, c, [i])
            t_loo[i], mem_loo[i] = t[0], mm[0]
        out["time_after_loo"] = errors(t_loo, m.step_time_s)
        out["memory_after_loo"] = errors(mem_loo, m.peak_memory_bytes)
        out["memory_band_loo"] = _band(m.peak_memory_bytes, mem_loo)
    return out


def _band(meas: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    ok = np.isfinite(meas)
    r = meas[ok] / pred[ok]
    return {"min_measured_over_predicted": float(r.min()), "max_measured_over_predicted": float(r.max())}


def save(result: dict[str, Any], m: Measurements, path: str) -> None:
    meta = {"fitted_from": m.source, "model": m.model.name, "hardware": m.hw.name,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "errors": {k: v for k, v in result.items() if k.startswith(("time_", "memory_", "trials"))}}
    result["coefficients"].save(path, meta=meta)


def plot(result: dict[str, Any], m: Measurements, path: str) -> None:
    try:
        import matplotlib                # optional ('plot' extra)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt   # matplotlib: optional ('plot' extra)
    except ImportError:
        raise PlanningError("--plot needs matplotlib: pip install 'titan-autoplan[plot]'") from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), dpi=110)
    for ax, k, meas, unit, scale in ((axes[0], 0, m.step_time_s, "step time (s)", 1.0),
                                     (axes[1], 1, m.peak_memory_bytes, "peak memory (GiB)", 2.0 ** -30)):
        for label, pred, c in (("before", result["pred_before"][k], "#999999"),
                               ("after", result["pred_after"][k], "#c44e52")):
            ax.scatter(meas * scale, pred * scale, s=18, c=c, label=f"{label} calibration")
        lim = [np.nanmin(meas) * scale * 0.8, np.nanmax(meas) * scale * 1.25]
        ax.plot(lim, lim, "k--", lw=0.8)
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{m.model.name} on {m.hw.name}: {len(m.plans)} trials")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
