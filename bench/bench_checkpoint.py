"""Checkpoint costs on CPU/gloo: async-save overlap and resume vs save time (llama3-debug).

    python bench/bench_checkpoint.py [--world 4] [--steps 48] [--every 8] [--runs 3] [--cpu-share F] [--skip-resume]

1. One run with ``train.async_checkpoint``, a save every K steps (the final one excluded).
   A save's window runs from the moment the trainer starts it (between two steps) to the
   moment its background writer finished (rank 0, checkpoint renamed into place).  Steps
   overlapping a save: every step that starts inside that window; the blocking part of the
   save (waiting for the previous one + staging the CPU copy) is added to the first of them.
   Per save: the mean of its overlapping steps; the ratio is the median of these over the
   saves divided by the median of the steps that overlap no save (same run; the first two
   steps, warm-up, are left out of both).  Also printed: the training time a save costs in all
   (its overlapping steps' excess over a clean step, summed).  ``--runs`` such runs; the
   headline ratio is their median.
2. One run with synchronous saves: the save time (all of it blocking), then a resumed run:
   the load time (DCP load + set_state_dict + scheduler/data), both as measured in-process.
Headline printed last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.distributed.harness import env, titan_run_cmd  # noqa: E402

GLOBAL_BATCH = 8


def run(tmp: Path, name: str, world: int, steps: int, seq_len: int, train: dict, args=()) -> Path:
    run_dir = tmp / name
    plan = tmp / f"{name}.yaml"
    plan.write_text(yaml.safe_dump({
        "model": "llama3-debug", "workload": {"seq_len": seq_len, "global_batch": GLOBAL_BATCH},
        "plan": {"dp_shard": world, "microbatch": GLOBAL_BATCH // world},
        "train": {"steps": steps, "warmup": 2, "profile_step": 0, "tensorboard": False, "log_every": 1,
                  "max_corpus_bytes": 2_000_000, **train}}))
    t0 = time.perf_counter()
    p = subprocess.run(titan_run_cmd("--plan", str(plan), "--run-dir", str(run_dir), *args), cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"run {name} failed:\n{p.stderr[-4000:]}")
    print(f"  {name}: {time.perf_counter() - t0:.1f} s wall", flush=True)
    return run_dir


def read(run_dir: Path):
    recs = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    events = [json.loads(line) for line in (run_dir / "checkpoint_events.jsonl").read_text().splitlines()]
    return recs, events


def overlap_ratio(recs: dict, events: list, steps: int) -> tuple[float, list[float], list[float], list[dict]]:
    """(ratio, per-save step times, clean step times, per-save details); see the module docstring."""
    done = {e["step"]: e for e in events if e["event"] == "save_done"}
    saves = [e for e in events if e["event"] == "save" and e["step"] < steps]
    touched: set[int] = set()
    per_save, details = [], []
    for e in saves:
        end = done[e["step"]]["finished_at"]
        over = [k for k in sorted(recs) if k > e["step"] and recs[k]["time"] - recs[k]["step_time_s"] < end]
        over = over or [e["step"] + 1]
        touched.update(over)
        times = [recs[k]["step_time_s"] + (e["blocking_seconds"] if k == e["step"] + 1 else 0.0) for k in over]
        per_save.append(statistics.mean(times))
        details.append({"step": e["step"], "blocking_ms": 1e3 * e["blocking_seconds"], "steps": len(over),
                        "write_s": done[e["step"]]["write_seconds"], "mean_ms": 1e3 * per_save[-1],
                        "cpu_s": done[e["step"]].get("writer_cpu_seconds") or 0.0})
    clean = [r["step_time_s"] for k, r in recs.items() if k > 2 and k not in touched]
    return statistics.median(per_save) / statistics.median(clean), per_save, clean, details


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3, help="async runs (the ratio printed last is their median)")
    ap.add_argument("--skip-resume", action="store_true", help="only the async overlap run")
    ap.add_argument("--cpu-share", type=float, default=None,
                    help="train.async_checkpoint_cpu_share (the writer's duty cycle; default: the executor's)")
    ap.add_argument("--checkpoint-dir", default="", help="where the async run writes (default: its run dir)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        tmp = Path(tmp)
        print(f"llama3-debug, world {a.world} (dp_shard {a.world}), seq {a.seq_len}, global batch {GLOBAL_BATCH}, "
              f"{a.steps} steps, checkpoint every {a.every}")
        extra = {} if a.cpu_share is None else {"async_checkpoint_cpu_share": a.cpu_share}
        ratios, losses = [], []
        for i in range(a.runs):
            d = run(tmp, f"async{i}", a.world, a.steps, a.seq_len, {"checkpoint_every": a.every,
                                                                     "async_checkpoint": True,
                                                                     "checkpoint_dir": a.checkpoint_dir, **extra})
            recs, events = read(d)
            ratio, per_save, clean, details = overlap_ratio(recs, events, a.steps)
            for x in details:
                print(f"    save at step {x['step']:>3}: blocking {x['blocking_ms']:.0f} ms, overlaps {x['steps']} "
                      f"step(s), background write {x['write_s']:.2f} s (rank-0 writer CPU {x['cpu_s']:.2f} s), mean "
                      f"overlapping step {x['mean_ms']:.0f} ms")
            base = statistics.median(clean)
            lost = statistics.median(x["steps"] * (x["mean_ms"] / 1e3 - base) for x in details)
            print(f"    training time lost per save (the overlapping steps' excess over a clean step, summed; median "
                  f"over saves): {lost * 1e3:.0f} ms = {lost / base:.2f} steps")
            print(f"  async run {i + 1}: step without a save {base * 1e3:.0f} ms (median of {len(clean)}); steps "
                  f"overlapping a save {statistics.median(per_save) * 1e3:.0f} ms (median over {len(per_save)} "
                  f"saves); ratio {ratio:.3f}", flush=True)
            ratios.append(ratio)
            losses.append(lost / base)
        ratio = statistics.median(ratios)
        print(f"async: ratio per run {', '.join(f'{r:.3f}' for r in ratios)} -> median {ratio:.3f}; training time "
              f"lost per save median {statistics.median(losses):.2f} steps")
        head = (f"HEADLINE: async save step-time ratio {ratio:.3f} (median of {a.runs} runs; target <= 1.10; "
                f"world {a.world}, llama3-debug)")
        if not a.skip_resume:
            d = run(tmp, "sync", a.world, a.steps, a.seq_len, {"checkpoint_every": a.every, "keep_checkpoints": 0})
            _, events = read(d)
            save_s = statistics.mean(e["blocking_seconds"] for e in events if e["event"] == "save")
            size = sum(f.stat().st_size for f in (d / "checkpoints" / f"step-{a.every:06d}").iterdir())
            r = run(tmp, "resume", a.world, a.steps, a.seq_len, {},
                    args=("--resume", str(d / "checkpoints" / f"step-{a.every:06d}")))
            _, events = read(r)
            load_s = [e["seconds"] for e in events if e["event"] == "load"][0]
            print(f"sync save {save_s:.3f} s (mean of {a.steps // a.every}, {size / 1e6:.1f} MB on disk); "
                  f"resume (load) {load_s:.3f} s; resume/save {load_s / save_s:.2f}")
            head = (f"HEADLINE: async save step-time ratio {ratio:.3f} (median of {a.runs} runs; target <= 1.10); "
                    f"resume {load_s:.2f} s vs save {save_s:.2f} s (world {a.world}, llama3-debug)")
        print(head)


if __name__ == "__main__":
    main()
