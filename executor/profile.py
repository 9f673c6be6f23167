"""Microbenchmarks of this machine, run by `titan-plan profile` (the planner never imports torch).

    python -m torch.distributed.run --standalone --nproc-per-node N -m executor.profile --out R.json

Rank 0 measures GEMM throughput by shape and memory bandwidth (while the
other ranks wait, so it has the machine); then all ranks measure all-reduce,
all-gather, reduce-scatter, all-to-all and point-to-point (rank 0 <-> 1) for
each power-of-two group size and a range of message sizes. Each figure is
the median of several timed repetitions after warm-up. Rank 0 writes the raw
measurements as JSON; `planner/profile.py` fits them into a hardware spec.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from cost_models.specs import this_host_cores

GEMM_SHAPES = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
               (4096, 1024, 1024), (1024, 4096, 1024), (8192, 256, 768), (8192, 768, 256))
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timeit(fn, device, *, warmup: int = 2, reps: int = 5, min_time: float = 0.02) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            _sync(device)
            el = time.perf_counter() - t0
            if el >= min_time or n >= 50:
                break
        times.append(el / n)
    return statistics.median(times)


def _timeit_fixed(fn, device, iters: int, reps: int = 3) -> float:
    """Same call count on every rank (collectives deadlock if ranks loop differently)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def bench_gemm(device, dtype, shapes=GEMM_SHAPES) -> list[dict]:
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = _timeit(lambda: torch.mm(a, b), device)
        out.append({"m": m, "n": n, "k": k, "seconds": t, "tflops": 2 * m * n * k / t / 1e12})
    return out


def bench_memory_bw(device, nbytes: int = 256 * 2 ** 20) -> float:
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    t = _timeit(lambda: dst.copy_(src), device)
    return 2 * nbytes / t / 1e9   # read + write


def bench_collectives(device, dtype, sizes: list[int], group_sizes: list[int]) -> list[dict]:
    rank = dist.get_rank()
    rows = []
    for g in group_sizes:
        ranks = list(range(g))
        group = dist.new_group(ranks)   # every rank must call new_group
        member = rank < g
        for nbytes in sizes:
            n = max(g, nbytes // torch.tensor([], dtype=dtype).element_size())
            n -= n % g
            x = torch.ones(n, device=device, dtype=dtype)
            chunk = torch.empty(n // g, device=device, dtype=dtype)
            full = torch.empty(n, device=device, dtype=dtype)
            iters = max(2, min(20, 2 ** 24 // max(1, n * x.element_size())))
            ops = {
                "all_reduce": lambda: dist.all_reduce(x, group=group),
                "all_gather": lambda: dist.all_gather_into_tensor(full, chunk, group=group),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(chunk, x, group=group),
                "all_to_all": lambda: dist.all_to_all_single(full, x, group=group),
            }
            for name, fn in ops.items():
                dist.barrier()
                t = _timeit_fixed(fn, device, iters) if member else 0.0
                rows.append({"op": name, "group": g, "bytes": n * x.element_size(), "seconds": t})
            if g == 2:
                dist.barrier()
                if member:
                    peer = 1 - rank

                    def p2p():
                        if rank == 0:
                            dist.send(x, peer)
                            dist.recv(x, peer)
                        else:
                            dist.recv(x, peer)
                            dist.send(x, peer)
                    t = _timeit_fixed(p2p, device, iters) / 2   # one direction
                    rows.append({"op": "p2p", "group": 2, "bytes": n * x.element_size(), "seconds": t})
        dist.barrier()
    return rows if rank == 0 else []


def _rss_bytes() -> int:
    """Resident memory of this process (the runtime's fixed cost on a CPU 'device')."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m executor.profile",
                                 description="GEMM, memory-bandwidth and collective microbenchmarks")
    ap.add_argument("--out", required=True, help="JSON file for rank 0's measurements")
    ap.add_argument("--max-bytes", type=int, default=16 * 2 ** 20, help="largest message (default 16 MiB)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and sizes (for tests)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if cuda else torch.float32
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "world": world,
                    "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
                    "cpu_count": os.cpu_count()}
    shapes = GEMM_SHAPES[:4] if args.quick else GEMM_SHAPES
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        result["gemm"] = bench_gemm(device, dtype, shapes)
        if cuda:
            result["gemm_fp32"] = bench_gemm(device, torch.float32, shapes[:3])
        else:
            result["gemm_bf16"] = bench_gemm(device, torch.bfloat16, shapes[:2])
        result["rss_bytes"] = _rss_bytes()
        result["memory_bw_gbs"] = bench_memory_bw(device)
        result["memory_total_bytes"] = (torch.cuda.get_device_properties(device).total_memory if cuda
                                        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        if not cuda:
            # one process with all of the host's cores (titan-run's threads when a host runs fewer
            # processes than cores), while the other ranks wait: how GEMMs and copies scale with threads
            cores = this_host_cores()
            result["host_cores"] = cores
            if cores > 1:
                torch.set_num_threads(cores)
                result["threaded"] = {"threads": cores, "gemm": bench_gemm(device, dtype, shapes),
                                      "memory_bw_gbs": bench_memory_bw(device)}
                torch.set_num_threads(1)
        print(f"[profile] gemm + memory bandwidth: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if dist.is_initialized() and world > 1:
        dist.barrier()
        top = args.max_bytes if not args.quick else min(args.max_bytes, 4 * 2 ** 20)
        sizes = [2 ** k for k in range(12, top.bit_length()) if 2 ** k <= top]
        sizes = sizes[::2] if args.quick else sizes
        groups = [g for g in (2, 4, 8, 16, 32, 64) if g <= world]
        t0 = time.perf_counter()
        result["collectives"] = bench_collectives(device, dtype, sizes, groups)
        if rank == 0:
            print(f"[profile] collectives: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if rank == 0:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
