"""Mixture-of-experts on CPU/gloo: all-to-all bytes measured vs the cost model, EP 2 vs EP 1, imbalance.

    python bench/bench_moe.py [--steps 8] [--seq-len 128] [--global-batch 4]

Two real `titan-run` runs of moe-debug on the same 2 processes (fp32):
EP 1 (dp_shard 2, experts FSDP-sharded like dense weights) and EP 2 (dp_shard 2, ep 2).

(a) all-to-all bytes per step: measured = ``summary.json`` ``moe.all_to_all_bytes_per_step``
    (bytes one rank sends in dispatch + combine, forward and backward, median over the
    steady steps) vs ``cost_models.moe_traffic.ep_all_to_all_bytes`` for the same plan
    (the volume `step_time.py` charges); target within 10%.
(b) tokens/s at EP 2 over EP 1 (reported, not asserted: on 2 CPU cores EP mostly adds
    all-to-all latency; it pays off when experts do not fit or dominate the FLOPs).
(c) the measured router imbalance (max/mean tokens per EP rank, worst MoE layer) fed to
    ``Coefficients.ep_imbalance``: the prediction of the busiest rank's bytes (vs the measured
    max over ranks, target within 10%) and of the step's EP communication time before and
    after (cpu hardware preset).
Headline printed last.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cost_models.coefficients import Coefficients  # noqa: E402
from cost_models.estimate import estimate  # noqa: E402
from cost_models.moe_traffic import ep_all_to_all_bytes  # noqa: E402
from cost_models.specs import load_hardware, load_model  # noqa: E402
from cost_models.workload import Workload  # noqa: E402
from search_spaces.plan import Plan  # noqa: E402
from search_spaces.table import CandidateTable  # noqa: E402
from tests.distributed.harness import env, titan_run_cmd  # noqa: E402

MODEL = "moe-debug"


def run(tmp: Path, name: str, plan: Plan, args) -> dict:
    run_dir = tmp / name
    f = tmp / f"{name}.yaml"
    f.write_text(yaml.safe_dump({
        "model": MODEL, "workload": {"seq_len": args.seq_len, "global_batch": args.global_batch},
        "plan": plan.to_dict(),
        "train": {"steps": args.steps, "warmup": 2, "profile_step": 0, "tensorboard": False,
                  "max_corpus_bytes": 2_000_000}}))
    p = subprocess.run(titan_run_cmd("--plan", str(f), "--nproc-per-node", str(plan.world_size), "--run-dir",
                                     str(run_dir)), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        sys.exit(f"bench_moe: run {name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=4)
    args = ap.parse_args()
    model = load_model(MODEL)
    hw = load_hardware("cpu")
    workload = Workload(seq_len=args.seq_len, global_batch=args.global_batch, dtype="fp32")
    mb = args.global_batch // 2
    plans = {"ep1": Plan(dp_shard=2, microbatch=mb, backend="dtensor"),
             "ep2": Plan(dp_shard=2, ep=2, microbatch=mb, backend="dtensor")}
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        s = {k: run(Path(tmp), k, p, args) for k, p in plans.items()}

    table = CandidateTable.from_plans([plans["ep2"]])
    m = s["ep2"]["moe"]
    measured = m["all_to_all_bytes_per_step"]
    predicted = float(ep_all_to_all_bytes(table, model, workload, Coefficients())[0])
    err = (measured - predicted) / predicted
    print(f"moe-debug seq_len {args.seq_len} global batch {args.global_batch}, {args.steps} steps, 2 processes, fp32")
    print(f"(a) all-to-all bytes per step per rank (dispatch+combine, fwd+bwd): measured {measured / 2**20:.3f} MiB, "
          f"cost model {predicted / 2**20:.3f} MiB -> error {100 * err:+.2f}% "
          f"({'within' if abs(err) <= 0.10 else 'OUTSIDE'} 10%)")

    t1, t2 = s["ep1"]["tokens_per_s"], s["ep2"]["tokens_per_s"]
    print(f"(b) tokens/s: EP 1 {t1:,.0f}, EP 2 {t2:,.0f} -> EP2/EP1 = {t2 / t1:.2f} "
          f"(step {1000 * s['ep1']['step_time_s']:.0f} ms vs {1000 * s['ep2']['step_time_s']:.0f} ms; "
          f"all-to-all {1000 * (m['all_to_all_s_per_step'] or 0):.0f} ms/step forward)")

    imb = max(1.0, m["ep_rank_imbalance"] or 1.0)
    base, fed = Coefficients(), Coefficients(ep_imbalance=imb)
    e0, e1 = estimate(table, model, hw, workload, base), estimate(table, model, hw, workload, fed)
    b1 = float(ep_all_to_all_bytes(table, model, workload, fed)[0])
    print(f"(c) router imbalance: max/mean tokens per expert {m['router_imbalance']:.2f} (worst layer; mean over "
          f"layers {m['router_imbalance_mean']:.2f}), per EP rank {imb:.3f}")
    busiest = m["all_to_all_bytes_per_step_max"]
    print(f"    busiest rank's all-to-all bytes: measured max {busiest / 2**20:.3f} MiB; predicted "
          f"{predicted / 2**20:.3f} MiB at ep_imbalance 1.0 -> {b1 / 2**20:.3f} MiB at {imb:.3f} -> error "
          f"{100 * (busiest - b1) / b1:+.2f}% ({'within' if abs(busiest - b1) <= 0.10 * b1 else 'OUTSIDE'} 10%; "
          "the busiest rank sends its own tokens in dispatch, imbalance x the mean in combine)")
    ep0, ep1 = 1000 * e0.time["ep_comm"][0], 1000 * e1.time["ep_comm"][0]
    print(f"    predicted ep_comm per step {ep0:.2f} ms -> {ep1:.2f} ms, step time {1000 * e0.step_time_s[0]:.1f} ms "
          f"-> {1000 * e1.step_time_s[0]:.1f} ms (measured {1000 * s['ep2']['step_time_s']:.1f} ms)")
    print(f"HEADLINE: EP2 all-to-all bytes measured vs cost model {100 * err:+.2f}% "
          f"({'PASS' if abs(err) <= 0.10 else 'FAIL'} <=10%); busiest rank's bytes vs imbalanced cost model "
          f"{100 * (busiest - b1) / b1:+.2f}% ({'PASS' if abs(busiest - b1) <= 0.10 * b1 else 'FAIL'} <=10%); "
          f"EP2/EP1 tokens/s {t2 / t1:.2f}; "
          f"EP-rank imbalance {imb:.3f} -> predicted ep_comm x{e1.time['ep_comm'][0] / max(e0.time['ep_comm'][0], 1e-30):.2f}")


if __name__ == "__main__":
    main()
