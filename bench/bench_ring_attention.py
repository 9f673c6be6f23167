"""Check and time the ring-attention kernels (executor/parallel/ring_attention.py).

Three modes; each prints one JSON object per line.

* ``kernels`` (one process, CPU or GPU): every per-block kernel usable on the
  device (cpu_flash / cuda_flash / math) against SDPA in fp32 — forward
  output and log-sum-exp, and the backward given the block's own out/lse —
  for causal square blocks and unmasked rectangular blocks, MHA and GQA.
* ``ring-sim`` (one process, CPU or GPU): the whole ring algorithm
  (``ring_forward``/``ring_backward``, head-tail layout, online-softmax merge,
  dK/dV returning home) for ``--cp`` simulated ranks, run as threads that hand
  buffers over through queues instead of P2P.  This is how the CUDA kernels get
  the full ring check on a one-GPU machine; the P2P path itself is covered by
  tests/distributed/test_context_parallel.py on gloo.
* ``ring-time`` (under torchrun, gloo or NCCL): wall time of ring attention
  fwd+bwd at the given shape vs single-device SDPA on the local shard.

    python bench/bench_ring_attention.py kernels --device cuda --dtype bf16
    python bench/bench_ring_attention.py ring-sim --device cuda --dtype bf16 --cp 4 --seq 4096
    torchrun --nproc_per_node 2 bench/bench_ring_attention.py ring-time --seq 2048
"""
from __future__ import annotations

import argparse
import json
import math
import os
import queue
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from executor.parallel.context_parallel import head_tail_indices  # noqa: E402
from executor.parallel.ring_attention import make_kernel, ring_attention, ring_backward, ring_forward  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def kernels_for(device: torch.device, dtype: torch.dtype) -> list[str]:
    if device.type == "cpu":
        return ["cpu_flash", "math"]
    out = ["math"]
    if dtype in (torch.float16, torch.bfloat16):
        out.insert(0, "cuda_flash")
    return out


def sdpa_ref(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         is_causal=causal)
    return q, k, v, out


def maxerr(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_kernels(args, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, d = 2, 8, args.head_dim
    for kv in (h, h // 4):
        for causal, sq, sk in ((True, 256, 256), (False, 128, 256)):
            q = torch.randn(b, h, sq, d, generator=g).to(device, dtype)
            k = torch.randn(b, kv, sk, d, generator=g).to(device, dtype)
            v = torch.randn(b, kv, sk, d, generator=g).to(device, dtype)
            dout = torch.randn(b, h, sq, d, generator=g).to(device, dtype)
            qr, kr, vr, ref = sdpa_ref(q, k, v, causal)
            ref.backward(dout.float())
            s = (qr @ kr.repeat_interleave(h // kv, 1).transpose(-1, -2)) / math.sqrt(d)
            if causal:
                s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=device).tril(), float("-inf"))
            lse_ref = s.logsumexp(-1)
            for name in kernels_for(device, dtype):
                kern = make_kernel(name, 1 / math.sqrt(d))
                with torch.no_grad():
                    out, lse, aux = kern.fwd(q, k, v, causal)
                    dq, dk, dv = kern.bwd(dout, q, k, v, out.to(dtype), lse, causal, aux)
                print(json.dumps({"mode": "kernels", "kernel": name, "device": device.type, "dtype": str(dtype),
                                  "causal": causal, "heads": h, "kv_heads": kv, "sq": sq, "sk": sk,
                                  "out": maxerr(out, ref), "lse": maxerr(lse, lse_ref), "dq": maxerr(dq, qr.grad),
                                  "dk": maxerr(dk, kr.grad), "dv": maxerr(dv, vr.grad)}), flush=True)


class _ThreadRing:
    """Same interface as ring_attention._Ring, for `cp` ranks simulated as threads."""

    def __init__(self, rank, size, boxes):
        self.rank, self.size, self.fake, self.boxes = rank, size, False, boxes

    def start(self, send):
        self.boxes[(self.rank + 1) % self.size].put(send.clone())
        return self

    def wait(self, handle):
        return self.boxes[self.rank].get(timeout=600)


def ring_sim(args, device, dtype):
    cp, b, h, d, s = args.cp, args.batch, args.heads, args.head_dim, args.seq
    for kv in (h, max(1, h // 4)):
        g = torch.Generator(device="cpu").manual_seed(1)
        q = torch.randn(b, h, s, d, generator=g).to(device, dtype)
        k = torch.randn(b, kv, s, d, generator=g).to(device, dtype)
        v = torch.randn(b, kv, s, d, generator=g).to(device, dtype)
        dout = torch.randn(b, h, s, d, generator=g).to(device, dtype)
        qr, kr, vr, ref = sdpa_ref(q, k, v, True)
        ref.backward(dout.float())
        base = {}
        if dtype != torch.float32:     # single-device SDPA in the same dtype, for scale
            qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
            rep = h // kv
            ob = F.scaled_dot_product_attention(qb, kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1),
                                                is_causal=True)
            ob.backward(dout)
            base = {"base_out": maxerr(ob, ref), "base_dq": maxerr(qb.grad, qr.grad),
                    "base_dk": maxerr(kb.grad, kr.grad), "base_dv": maxerr(vb.grad, vr.grad)}
        for name in kernels_for(device, dtype):
            kern = make_kernel(name, 1 / math.sqrt(d))
            boxes = [queue.Queue() for _ in range(cp)]
            results: dict[int, tuple] = {}
            errors: list[BaseException] = []

            def rank_fn(r):
                try:
                    pos = head_tail_indices(s, cp, r, device=device)
                    ql, kl, vl, dl = (t.index_select(2, pos) for t in (q, k, v, dout))
                    ring = _ThreadRing(r, cp, boxes)
                    with torch.no_grad():
                        out, lse, aux = ring_forward(ql, kl, vl, None, kern, ring=ring)
                        grads = ring_backward(dl, ql, kl, vl, out, lse, None, kern, aux, ring=ring)
                    results[r] = (pos, out, *grads)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(cp)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            wall = time.perf_counter() - t0
            err = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
            for pos, out, dq, dk, dv in results.values():
                for key, a, r in (("out", out, ref), ("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
                    err[key] = max(err[key], maxerr(a, r.detach().index_select(2, pos)))
            print(json.dumps({"mode": "ring-sim", "kernel": name, "device": device.type, "dtype": str(dtype),
                              "cp": cp, "seq": s, "heads": h, "kv_heads": kv, **err, **base,
                              "wall_s": round(wall, 3)}), flush=True)


def ring_time(args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    cp = dist.get_world_size()
    mesh = init_device_mesh(device.type, (cp,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    b, h, d, s = args.batch, args.heads, args.head_dim, args.seq
    sl = s // cp
    q = torch.randn(b, h, sl, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, max(1, h // 4), sl, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timeit(fn, n=args.iters):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) / n

    def ring_step():
        ring_attention(q, k, v, group).sum().backward()

    def local_step():
        rep = h // k.shape[1]
        F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                       is_causal=True).sum().backward()

    t_ring, t_local = timeit(ring_step), timeit(local_step)
    if rank == 0:
        print(json.dumps({"mode": "ring-time", "backend": backend, "cp": cp, "seq": s, "local_seq": sl,
                          "dtype": args.dtype, "ring_fwd_bwd_ms": round(t_ring * 1e3, 2),
                          "local_sdpa_fwd_bwd_ms": round(t_local * 1e3, 2)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("kernels", "ring-sim", "ring-time"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    if args.mode == "ring-time":
        return ring_time(args)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    if args.mode == "kernels":
        check_kernels(args, device, dtype)
    else:
        ring_sim(args, device, dtype)


if __name__ == "__main__":
    main()
