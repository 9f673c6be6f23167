"""`titan-plan profile`: measure this machine and write a hardware spec the planner can use.

The measurements run in a subprocess (`python -m executor.profile` under
torchrun), so the planner itself never imports torch. The fit:

* GEMM: the peak is the best throughput over the shapes; the efficiency the
  median over shapes divided by that peak.
* Collectives: an alpha-beta model per operation, ``t = steps * alpha +
  traffic / bw`` with the ring traffic per rank (all-reduce ``2(g-1)/g``
  bytes, all-gather / reduce-scatter / all-to-all ``(g-1)/g``, point-to-point
  1) and ``steps`` the ring's hops (Thakur, Rabenseifner & Gropp 2005,
  "Optimization of collective communication operations in MPICH", Sec. 4),
  fitted by non-negative least squares over all sizes and group sizes. The
  spec takes the median bandwidth and latency over the operations, and
  efficiency 1.0 for the link (the measured figure already is the achieved
  one).
* Inter-node figures cannot be measured on one node; they are kept from the
  base preset and the spec says so.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cost_models.specs import SpecError, hardware_from_dict, load_hardware, this_host_cores
from search_spaces.yaml_file import write_text

from .progress import Progress

STAGE_PREFIX = "[profile] "   # executor/profile.py prints one such line (rank 0, stderr) per finished stage

RING = {  # op -> (traffic factor of bytes, latency steps) for a group of g ranks
    "all_reduce": (lambda g: 2 * (g - 1) / g, lambda g: 2 * (g - 1)),
    "all_gather": (lambda g: (g - 1) / g, lambda g: g - 1),
    "reduce_scatter": (lambda g: (g - 1) / g, lambda g: g - 1),
    "all_to_all": (lambda g: (g - 1) / g, lambda g: g - 1),
    "p2p": (lambda g: 1.0, lambda g: 1),
}


def fit_alpha_beta(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per op: latency per step (s) and bandwidth (B/s) by non-negative least squares."""
    from scipy.optimize import nnls      # scipy: optional, slow to import for every titan-plan

    out = {}
    for op, (traffic, steps) in RING.items():
        rs = [r for r in rows if r["op"] == op and r["seconds"] > 0]
        if len(rs) < 2:
            continue
        a = np.array([[steps(r["group"]), traffic(r["group"]) * r["bytes"]] for r in rs], dtype=float)
        t = np.array([r["seconds"] for r in rs])
        w = 1.0 / t                      # relative error: small messages count as much as large ones
        coef, _ = nnls(a * w[:, None], t * w)
        alpha, inv_bw = coef
        if inv_bw <= 0:
            # latency hides the bandwidth term at these sizes (e.g. --quick): take the best achieved
            # bandwidth, a lower bound, so the op still gets a figure
            inv_bw = float(np.min(t / a[:, 1]))
            coef = np.array([alpha, inv_bw])
        pred = a @ coef
        out[op] = {"latency_s": float(alpha), "bw_bytes_per_s": float(1.0 / inv_bw),
                   "median_abs_pct_err": float(np.median(np.abs(pred - t) / t) * 100), "points": len(rs)}
    return out


def thread_scalings(m: dict[str, Any]) -> dict[str, float]:
    """`thread_gemm_scaling` and `thread_memory_scaling` from one process's figures at one thread and at all
    of the host's `t` cores: speedup = 1 + (t - 1) x scaling (GEMM: the best shape at each count), clipped to
    (0, 1]; {} when the profile ran without the threaded pass (one core, or an older profile)."""
    th = m.get("threaded")
    if not th or int(th.get("threads", 1)) < 2:
        return {}
    t = int(th["threads"])

    def scaling(speedup: float) -> float:
        return round(min(1.0, max(0.05, (speedup - 1.0) / (t - 1))), 3)
    gemm = max(r["tflops"] for r in th["gemm"]) / max(r["tflops"] for r in m["gemm"])
    return {"thread_gemm_scaling": scaling(gemm),
            "thread_memory_scaling": scaling(th["memory_bw_gbs"] / m["memory_bw_gbs"])}


def spec_from_measurements(m: dict[str, Any], *, base: str, name: str) -> dict[str, Any]:
    b = load_hardware(base).to_dict()
    gemm = m["gemm"]
    peak = max(r["tflops"] for r in gemm)
    eff = statistics.median(r["tflops"] for r in gemm) / peak
    cuda = m["device"] != "cpu"
    spec = dict(b)
    spec["name"] = name
    spec["device"] = "cuda" if cuda else "cpu"
    if cuda:
        spec["peak_tflops_bf16"] = round(peak, 4)
        if m.get("gemm_fp32"):
            spec["peak_tflops_fp32"] = round(max(r["tflops"] for r in m["gemm_fp32"]), 4)
        spec["memory_gib"] = round(m["memory_total_bytes"] / 2 ** 30, 2)
    else:
        spec["peak_tflops_fp32"] = round(peak, 5)
        if m.get("gemm_bf16"):
            spec["peak_tflops_bf16"] = round(max(r["tflops"] for r in m["gemm_bf16"]), 5)
        spec["memory_gib"] = round(m["memory_total_bytes"] / 2 ** 30 / max(1, m["world"]), 2)
        spec["memory_reserved_gib"] = round(m.get("rss_bytes", 0) / 2 ** 30, 3)
        spec["gpus_per_node"] = max(1, m["world"])
        spec["host_cores"] = int(m.get("host_cores") or this_host_cores())   # shared by a host's processes
        spec.update(thread_scalings(m))
    spec["memory_bw_gbs"] = round(m["memory_bw_gbs"], 2)
    effs = dict(spec.get("efficiency") or {})
    effs["gemm"] = round(min(1.0, max(0.05, eff)), 3)
    fits = fit_alpha_beta(m.get("collectives", []))
    if fits:
        spec["intra_node_bw_gbs"] = round(statistics.median(f["bw_bytes_per_s"] for f in fits.values()) / 1e9, 3)
        spec["intra_node_latency_us"] = round(statistics.median(f["latency_s"] for f in fits.values()) * 1e6, 2)
        effs["comm_intra"] = 1.0
    spec["efficiency"] = effs
    spec["source"] = (f"measured by `titan-plan profile` on {m['device']} x{m['world']} (torch {m['torch']}); "
                      f"inter-node figures from the '{base}' preset")
    hardware_from_dict(spec, where="profiled spec")  # validate
    return {"spec": spec, "collective_fits": fits}


def run_profile(*, nproc: int, out: str, base: str, name: str, quick: bool = False,
                 max_bytes: int = 16 * 2 ** 20, raw_out: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        raw = raw_out or os.path.join(tmp, "profile.json")
        # the agent's logs in the same folder (torch would make a torchelastic_* one in the temp dir and leave it)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--log-dir", os.path.join(tmp, "elastic"),
               "-m", "executor.profile", "--out", raw, "--max-bytes", str(max_bytes)] + (["--quick"] if quick else [])
        print(f"[titan-plan profile] running {nproc} process(es): GEMMs, memory bandwidth, collectives ...",
              file=sys.stderr, flush=True)
        rc, output = _run_with_progress(cmd, stages=len(profile_stages(nproc)))
        if rc or not Path(raw).is_file():
            tail = "\n".join(output[-5:])
            raise RuntimeError(f"profiler run failed (exit {rc}): {tail}")
        m = json.loads(Path(raw).read_text())
    res = spec_from_measurements(m, base=base, name=name)
    write_text(out, "# Written by `titan-plan profile`.\n" + yaml.safe_dump(res["spec"], sort_keys=False),
               error=SpecError, what="hardware spec")   # atomic, through a symlink, never over a device
    res["measurements"] = m
    return res


def profile_stages(nproc: int) -> tuple[str, ...]:
    """What `executor.profile` measures, in order: collectives need a second process."""
    return ("gemm + memory bandwidth",) + (("collectives",) if nproc > 1 else ())


def _run_with_progress(cmd: list[str], *, stages: int) -> tuple[int, list[str]]:
    """Run the profiler; each of its ``[profile] STAGE: N s`` lines (rank 0, stderr) is one step of the
    progress. Returns the exit code and every line it printed (stdout and stderr merged)."""
    lines: list[str] = []
    with Progress(stages, "titan-plan profile", unit="stage", eta=False) as bar:   # stages differ in length
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if line.startswith(STAGE_PREFIX) and bar.n < stages:
                bar.step(line[len(STAGE_PREFIX):].strip())
        rc = proc.wait()
    return rc, [ln for ln in lines if ln.strip()]
