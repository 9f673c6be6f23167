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
    }


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
