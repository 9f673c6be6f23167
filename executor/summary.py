"""The figures of a whole run: ``summary.json`` (rank 0) and ``ranks/rank<N>.json`` (each rank's losses).

Made by ``train.train`` from the per-step records of ``train.run_one_step``.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch.distributed as dist


def summarize(tr, records: list[dict], hw) -> dict:
    """Whole-run figures of `tr` (a ``train.Trainer``); throughput is the median over steps after the first two
    (compile, warm-up)."""
    cfg = tr.cfg
    steady = [r for r in records[2:] if not r["profiled"]] or [r for r in records if not r["profiled"]] or records
    med = lambda key: statistics.median(r[key] for r in steady)          # noqa: E731
    peaks = [r["peak_memory_bytes"] for r in records if r["peak_memory_bytes"]]
    per_rank_peak = [max((p[i] or 0) for p in peaks) for i in range(len(peaks[0]))] if peaks else None
    axes = sorted({a for r in steady for a in r["comm_s"]})
    return {
        "status": "ok", "model": cfg.spec.name, "plan": cfg.plan.to_dict(), "world_size": dist.get_world_size(),
        "device": tr.device.type, "backend": tr.backend, "dtype": str(tr.precision.param_dtype).replace("torch.", ""),
        "hardware": None if hw is None else hw.name, "seq_len": cfg.seq_len, "global_batch": cfg.global_batch,
        "steps": len(records), "first_loss": records[0]["loss"] if records else None,
        "final_loss": records[-1]["loss"] if records else None,
        "step_time_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"),
        "tokens_per_s_per_device": med("tokens_per_s_per_device"),
        "mfu": None if steady[0]["mfu"] is None else med("mfu"),
        "data_time_s": med("data_time_s"),
        "peak_memory_bytes_per_rank": per_rank_peak,
        "peak_memory_bytes": max(per_rank_peak) if per_rank_peak else None,
        "comm_s_per_step": {a: statistics.median(r["comm_s"].get(a, 0.0) for r in steady) for a in axes},
        "comm_method": "exposed time in c10d/functional collectives per process group (executor/comm_timer.py)",
        **summarize_moe(steady),
    } | versus_prediction(cfg.prediction if prediction_applies(cfg, hw, tr.device.type) else None,
                          med("step_time_s"), max(per_rank_peak) if per_rank_peak else None)


def prediction_applies(cfg, hw, device_type: str) -> bool:
    """True when the plan file's prediction was made for the hardware this run measures on: the spec the run
    loaded (the plan's ``hardware`` key, else the device's preset) is the one titan-plan was given (its
    ``inputs.hardware``, a preset name or a file path) and is of the run's device kind (a GPU plan run on
    the CPU is not its prediction)."""
    if hw is None or (hw.device == "cpu") != (device_type == "cpu"):
        return False
    inputs = cfg.resolved.get("inputs")
    planned = inputs.get("hardware") if isinstance(inputs, dict) else None
    return planned is None or planned == (cfg.hardware if cfg.hardware is not None else hw.name)


def versus_prediction(pred: dict | None, step_s: float, peak_bytes: int | None) -> dict:
    """``{"vs_plan": ...}``: the run's median step time and peak memory against titan-plan's prediction in the
    plan file (``RunConfig.prediction``), with its p90 bounds; empty when there is none."""
    if not isinstance(pred, dict) or not isinstance(pred.get("step_time_s"), (int, float)):
        return {}
    num = lambda key: float(pred[key]) if isinstance(pred.get(key), (int, float)) else None  # noqa: E731
    out = {"step_time_s": step_s, "predicted_step_time_s": num("step_time_s"),
           "predicted_step_time_p90_s": num("step_time_p90_s"),
           "step_time_error": step_s / float(pred["step_time_s"]) - 1.0}
    if peak_bytes and num("peak_memory_gib"):
        out |= {"peak_memory_gib": peak_bytes / 2**30, "predicted_peak_memory_gib": num("peak_memory_gib"),
                "predicted_peak_memory_p90_gib": num("peak_memory_p90_gib"),
                "peak_memory_error": peak_bytes / 2**30 / num("peak_memory_gib") - 1.0}
    return {"vs_plan": out}


def prediction_line(s: dict) -> str | None:
    """One line: measured against the plan's prediction (step time, peak memory), with the p90 bound each
    falls inside or beyond, and what to do when the step is beyond it."""
    v = s.get("vs_plan")
    if not v:
        return None

    def part(name, got, want, p90, err, fmt):
        bound = "" if p90 is None else (f", beyond the p90 bound {fmt(p90)}" if got > p90
                                        else f", within the p90 bound {fmt(p90)}")
        return f"{name} {fmt(got)} measured / {fmt(want)} predicted ({100 * err:+.1f}%{bound})"
    secs = lambda x: f"{x:.3f} s"                                          # noqa: E731
    mib = lambda x: f"{x * 1024:,.0f} MiB" if x < 1 else f"{x:.2f} GiB"    # noqa: E731
    parts = [part("step", v["step_time_s"], v["predicted_step_time_s"], v["predicted_step_time_p90_s"],
                  v["step_time_error"], secs)]
    if "peak_memory_gib" in v:
        parts.append(part("peak memory", v["peak_memory_gib"], v["predicted_peak_memory_gib"],
                          v["predicted_peak_memory_p90_gib"], v["peak_memory_error"], mib))
    line = "titan-run: vs the plan: " + "; ".join(parts)
    p90 = v["predicted_step_time_p90_s"]
    if p90 is not None and v["step_time_s"] > p90:
        line += (" (to fit the cost model to this machine: titan-plan profile measures its hardware figures, "
                 "titan-plan --trials N and titan-plan calibrate the rest)")
    return line


def summary_line(s: dict, run_dir, last_checkpoint: str | None) -> str:
    """The run's one closing line: steps, loss, throughput, MFU, peak memory, where things are."""
    mfu = "-" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
    peak = "-" if not s["peak_memory_bytes"] else f"{s['peak_memory_bytes'] / 2**20:,.0f} MiB"
    loss = "-" if s["final_loss"] is None else f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}"
    return (f"titan-run: done: {s['steps']} steps, loss {loss}, {s['tokens_per_s']:,.0f} tok/s "
            f"({s['tokens_per_s_per_device']:,.0f}/dev), mfu {mfu}, peak memory {peak}, run dir {run_dir}, "
            f"last checkpoint {last_checkpoint or 'none'}")


def summarize_moe(steady: list[dict]) -> dict:
    """Medians over the steady steps of the MoE figures, plus the routed tokens of all steps summed."""
    recs = [r["moe"] for r in steady if r.get("moe")]
    if not recs:
        return {}
    med = lambda key: None if recs[0][key] is None else statistics.median(m[key] for m in recs)  # noqa: E731
    total = {lid: [sum(m["tokens_per_expert"][lid][e] for m in recs) for e in range(len(c))]
             for lid, c in recs[0]["tokens_per_expert"].items()}
    return {"moe": {
        "router_imbalance": med("router_imbalance"), "router_imbalance_mean": med("router_imbalance_mean"),
        "ep_rank_imbalance": med("ep_rank_imbalance"),
        "all_to_all_s_per_step": med("all_to_all_s"), "all_to_all_bytes_per_step": med("all_to_all_bytes"),
        "all_to_all_bytes_per_step_max": med("all_to_all_bytes_max"), "aux_loss_term": med("aux_loss_term"),
        "tokens_per_expert_steady_steps": total,
        "method": "tokens routed per expert summed over all ranks; imbalance = max/mean tokens per expert "
                  "(worst MoE layer), per EP rank; all-to-all seconds = forward dispatch+combine, max over "
                  "ranks; bytes = sent per rank in dispatch+combine, forward and backward (mean over ranks "
                  "holding MoE layers)"}}


def write_rank_file(run_dir: Path, rank: int, tr, records: list[dict]) -> None:
    d = run_dir / "ranks"
    d.mkdir(exist_ok=True)
    first = records[0]["step"] if records else None
    (d / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "losses": tr.losses, "first_step": first}))
