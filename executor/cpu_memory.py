"""Peak memory per rank of one step.

GPU: the CUDA caching allocator's ``max_memory_reserved`` per step (what an
OOM is about; ``max_memory_allocated`` is reported too).
CPU: on one step (``train.profile_step``), the CPU allocator's allocation
and free events are recorded with ``torch.profiler(profile_memory=True)``
(this sees compiled code too, and storage resizes); peak = bytes of the
training state alive at the step start (parameters, gradients, optimizer
state) + the highest running total of bytes allocated minus freed during
the step (frees the profiler misses -- gloo frees collective temporaries on
its own thread -- are inferred, see :func:`peak_of_allocations`).  Not process RSS.
"""
from __future__ import annotations

import bisect
import contextlib
import os
import sys

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        key = st.data_ptr()
        if key in seen or st.device.type == "meta":
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def training_state_bytes(params, optimizer) -> int:
    tensors = list(params) + [p.grad for p in params]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return _storage_bytes(tensors)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the profiler's C++ start/stop banners (fd 2) while it starts and stops."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class CpuPeakMemory:
    """Context manager: peak CPU tensor bytes of one step (see the module docstring)."""

    def __init__(self, baseline_bytes: int):
        self.baseline = baseline_bytes
        self.peak_bytes: int | None = None

    def __enter__(self):
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak_bytes = self.baseline + max(0, _peak_from_events(self._prof))
        return False


def _collective_kind(ev) -> str:
    """What a profiler allocation event is with respect to collectives, by its nearest collective frame:
    "" (none), "temp" (inside a c10d backend op: its own temporaries), "gather" (the output of a functional
    all-gather: an activation, never training state), "output" (another functional collective's output)."""
    p = ev.parent
    while p is not None:
        if p.name.startswith("c10d::"):
            return "temp"
        if p.name.startswith("_c10d_functional::"):
            return "gather" if p.name.startswith("_c10d_functional::all_gather") else "output"
        p = p.parent
    return ""


def _peak_from_events(prof) -> int:
    allocs = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == "cpu":
            size = ev.extra_fields.alloc_size
            allocs.append((ev.start_time_ns, size, ev.extra_fields.ptr, _collective_kind(ev) if size > 0 else ""))
        stack.extend(ev.children)
    return peak_of_allocations(allocs)


def _replay(allocs, early: dict[int, int] | None = None) -> tuple[int, set[int], set[int]]:
    """(peak, indices of the blocks whose free was never recorded but inferred from a reuse of their address,
    indices of the blocks still live at the end).

    `allocs`: (time_ns, size, ptr, ...) sorted by time; size < 0 is a free.  `early`: block index -> event
    index after which that block counts as freed."""
    after: dict[int, list[int]] = {}
    for blk, at in (early or {}).items():
        after.setdefault(at, []).append(blk)
    starts: list[int] = []            # sorted start addresses of live blocks
    live: dict[int, tuple[int, int]] = {}      # ptr -> (size, block index)
    cur = peak = 0
    inferred: set[int] = set()
    for k, (_, size, ptr, *_rest) in enumerate(allocs):
        if size < 0:
            if ptr in live:
                cur -= live.pop(ptr)[0]
                del starts[bisect.bisect_left(starts, ptr)]
            else:
                cur += size               # allocated before the window
        else:
            # live blocks overlapping [ptr, ptr + size) were freed unseen
            i = bisect.bisect_right(starts, ptr) - 1
            if i >= 0 and starts[i] + live[starts[i]][0] <= ptr:
                i += 1
            i = max(i, 0)
            while i < len(starts) and starts[i] < ptr + max(size, 1):
                sz, blk = live.pop(starts.pop(i))
                cur -= sz
                inferred.add(blk)
            bisect.insort(starts, ptr)
            live[ptr] = (size, k)
            cur += size
            peak = max(peak, cur)
        for blk in after.get(k, ()):      # blocks known to be dead by now (see peak_of_allocations)
            q = allocs[blk][2]
            if live.get(q, (0, -1))[1] == blk:
                cur -= live.pop(q)[0]
                del starts[bisect.bisect_left(starts, q)]
    return peak, inferred, {blk for _, blk in live.values()}


def peak_of_allocations(allocs) -> int:
    """Peak of the net allocated bytes over (time_ns, size, ptr[, kind]) events (size < 0: a free; kind: see
    :func:`_collective_kind`).

    Some frees are never recorded: gloo frees on its own worker thread, which the profiler does
    not see.  Two rules recover them:

    * The allocator cannot hand out memory that is still in use, so an allocation overlapping a
      block the events still count as live proves that block was freed: it is dropped then.
    * That alone leaves such a block counted until its address happens to be reused, or to the
      end.  A block allocated inside a collective whose free went unseen was released last by
      gloo's thread, so the trainer had already dropped it -- which it does right after using it:
      gloo drops the finished work moments after completing it, and a block the trainer kept
      longer would have been freed, visibly, by the trainer.  Such a block (freed unseen as the
      first rule proves; or never freed in the window when it is a backend temporary or an
      all-gather output, which are never training state) counts until the next allocation made
      outside a collective (its consumer's output), then as freed.
    Measured on tp4 with llama3-debug: per-rank peaks of one run spread over 77-84 MiB with the
    first rule alone (a rank's figure depended on thread timing); with both, 77.0-77.5 on every rank.
    Frees of blocks allocated before the recorded window lower the total as they come.
    """
    allocs = sorted(allocs, key=lambda a: a[0])
    peak, inferred, at_end = _replay(allocs)
    kind = [a[3] if len(a) > 3 else "" for a in allocs]
    unseen = [b for b in inferred if kind[b]] + [b for b in at_end if kind[b] in ("temp", "gather")]
    if not unseen:
        return peak
    nxt, following = [None] * len(allocs), None    # the next allocation made outside a collective
    for k in range(len(allocs) - 1, -1, -1):
        nxt[k] = following
        if allocs[k][1] > 0 and not kind[k]:
            following = k
    early = {blk: nxt[blk] for blk in unseen if nxt[blk] is not None}
    return _replay(allocs, early)[0] if early else peak
