"""titan-run's eager loss (executor/parallel/fused_loss.py) against ``F.cross_entropy`` on the fp32 upcast.

For each logits shape and dtype: forward + backward time (medians of alternating runs) and the bytes per
logit each keeps for backward (``saved_tensors_hooks``) and allocates in backward at most (a dispatch mode
watching every output).  Prints one line per case, then ``RESULT`` with the worst time ratio and the
memory figures.

    python bench/bench_loss.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from executor.parallel.fused_loss import fused_cross_entropy  # noqa: E402

CASES = ((2048, 512), (2048, 2048), (4096, 32000), (2048, 128256))


def eager(logits, labels):
    return F.cross_entropy(logits.float(), labels)


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _run(fn, x, labels):
    a = x.detach().requires_grad_()
    t0 = time.perf_counter()
    fn(a, labels).backward()
    return time.perf_counter() - t0


def _memory(fn, x, labels):
    """(bytes per logit saved for backward beyond the logits' own storage, largest allocation in backward per
    logit)."""
    a = x.detach().requires_grad_()
    saved: dict[int, int] = {}

    def pack(t):
        if t.numel() >= x.numel() and t.untyped_storage().data_ptr() != a.untyped_storage().data_ptr():
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(a, labels)
    watch = _Largest()
    with watch:
        loss.backward()
    return sum(saved.values()) / x.numel(), watch.largest / x.numel()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="alternating runs per case (default 7)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    ratios, mem = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        for n, v in CASES:
            x = torch.randn(n, v, dtype=dtype)
            labels = torch.randint(0, v, (n,))
            te, tf = [], []
            for _ in range(args.repeats):
                te.append(_run(eager, x, labels))
                tf.append(_run(fused_cross_entropy, x, labels))
            me, mf = _memory(eager, x, labels), _memory(fused_cross_entropy, x, labels)
            r = statistics.median(te) / statistics.median(tf)
            ratios.append(r)
            name = str(dtype).replace("torch.", "")
            mem[name] = (me, mf)
            print(f"{name:9s} [{n}, {v}]: eager {1e3 * statistics.median(te):8.1f} ms  fused "
                  f"{1e3 * statistics.median(tf):8.1f} ms  (eager / fused {r:.2f}x); extra bytes kept per logit "
                  f"{me[0]:.1f} -> {mf[0]:.1f}, largest backward allocation per logit {me[1]:.1f} -> {mf[1]:.2f}",
                  flush=True)
    (be, bf), (fe, ff) = mem["bfloat16"], mem["float32"]
    print(f"RESULT fused loss: time eager/fused min {min(ratios):.2f}x median {statistics.median(ratios):.2f}x; "
          f"extra bytes kept per logit bf16 {be[0]:.1f} -> {bf[0]:.1f}, fp32 {fe[0]:.1f} -> {ff[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
