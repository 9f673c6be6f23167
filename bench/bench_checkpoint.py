"""Checkpoint costs on CPU/gloo: async-save overlap and resume vs save time (llama3-debug, world 4).

    python bench/bench_checkpoint.py [--steps 16] [--every 4] [--seq-len 256]

1. One run with ``train.async_checkpoint`` every K steps: a step "during a save" is the
   blocking part of the save (DCP staging a CPU copy, between steps) plus the next
   step, which trains while the background thread writes; the ratio is its mean over
   the saves divided by the median of the steps that do not touch a save (same run).
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


def run(tmp: Path, name: str, steps: int, seq_len: int, train: dict, args=()) -> Path:
    run_dir = tmp / name
    plan = tmp / f"{name}.yaml"
    plan.write_text(yaml.safe_dump({"model": "llama3-debug", "workload": {"seq_len": seq_len, "global_batch": 8},
                                    "plan": {"dp_shard": 4, "microbatch": 2},
                                    "train": {"steps": steps, "warmup": 2, "profile_step": 0, "tensorboard": False,
                                              "max_corpus_bytes": 2_000_000, **train}}))
    t0 = time.perf_counter()
    p = subprocess.run(titan_run_cmd("--plan", str(plan), "--run-dir", str(run_dir), *args), cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"run {name} failed:\n{p.stderr[-4000:]}")
    print(f"  {name}: {time.perf_counter() - t0:.1f} s wall", flush=True)
    return run_dir


def read(run_dir: Path):
    recs = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    events = [json.loads(line) for line in (run_dir / "checkpoint_events.jsonl").read_text().splitlines()]
    return recs, events


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        tmp = Path(tmp)
        print(f"llama3-debug, world 4 (dp_shard 4), seq {a.seq_len}, global batch 8, {a.steps} steps, "
              f"checkpoint every {a.every}")
        d = run(tmp, "async", a.steps, a.seq_len, {"checkpoint_every": a.every, "async_checkpoint": True})
        recs, events = read(d)
        saves = {e["step"]: e for e in events if e["event"] == "save" and e["step"] < a.steps}
        during = [saves[s]["blocking_seconds"] + recs[s + 1]["step_time_s"] for s in saves if s + 1 in recs]
        touched = set(saves) | {s + 1 for s in saves}
        plain = [r["step_time_s"] for s, r in recs.items() if s > 2 and s not in touched]
        base = statistics.median(plain)
        ratio = statistics.mean(during) / base
        blocking = statistics.mean(saves[s]["blocking_seconds"] for s in saves)
        print(f"async: step without a save {base * 1e3:.0f} ms (median of {len(plain)}); during a save "
              f"{statistics.mean(during) * 1e3:.0f} ms (blocking staging {blocking * 1e3:.0f} ms + the next step, "
              f"mean of {len(during)}); ratio {ratio:.3f}")

        d = run(tmp, "sync", a.steps, a.seq_len, {"checkpoint_every": a.every, "keep_checkpoints": 0})
        _, events = read(d)
        save_s = statistics.mean(e["blocking_seconds"] for e in events if e["event"] == "save")
        size = sum(f.stat().st_size for f in (d / "checkpoints" / f"step-{a.every:06d}").iterdir())
        r = run(tmp, "resume", a.steps, a.seq_len, {},
                args=("--resume", str(d / "checkpoints" / f"step-{a.every:06d}")))
        _, events = read(r)
        load_s = [e["seconds"] for e in events if e["event"] == "load"][0]
        print(f"sync save {save_s:.3f} s (mean of {a.steps // a.every}, {size / 1e6:.1f} MB on disk); "
              f"resume (load) {load_s:.3f} s; resume/save {load_s / save_s:.2f}")
        print(f"HEADLINE: async save step-time ratio {ratio:.3f} (target <= 1.10); resume {load_s:.2f} s vs save "
              f"{save_s:.2f} s (world 4, llama3-debug)")


if __name__ == "__main__":
    main()
