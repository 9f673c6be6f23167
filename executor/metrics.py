"""Per-step measurements (``metrics_writer.py`` writes the records).

Communication time per mesh axis (:class:`CommTimer`)
    Method: while installed, the public collective entry points are wrapped
    with timers -- every ``torch.distributed`` collective / P2P function
    (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
    ``batch_isend_irecv``, ...; FSDP2, pipeline and ring attention use these),
    ``Work.wait`` (the wait of their async versions), and the functional
    collectives DTensor uses for TP/SP and ``loss_parallel``.  The time is
    charged to the mesh axis whose process group the call names.  What is
    measured is the time the training thread spends inside these calls (the
    launch, plus the wait for async ones): the *exposed* communication time on
    that rank, not the time the network is busy while compute overlaps.
    Functional collectives are waited for right away (their completion is
    timed), which removes the little overlap they could have had.
    Limits: collectives issued from inside a compiled region (TP collectives of
    a compiled block) run in generated code and are not seen; time waiting for
    a slower peer counts as communication; nested calls count once.

Peak memory per rank
    GPU: the CUDA caching allocator's ``max_memory_reserved`` per step (what an
    OOM is about; ``max_memory_allocated`` is reported too).
    CPU: on one step (``train.profile_step``), the CPU allocator's allocation
    and free events are recorded with ``torch.profiler(profile_memory=True)``
    (this sees compiled code too, and storage resizes); peak = bytes of the
    training state alive at the step start (parameters, gradients, optimizer
    state) + the highest running total of bytes allocated minus freed during
    the step (frees the profiler misses -- gloo frees collective temporaries on
    its own thread -- are inferred, see :func:`peak_of_allocations`).  Not process RSS.

MFU = tokens/s per device x ``cost_models.flops.flops_per_token`` / peak FLOP/s
of the hardware spec (bf16 or fp32 peak, matching the compute dtype).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------- communication
_C10D_FUNCS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "reduce", "gather", "scatter",
               "all_gather_object", "broadcast_object_list", "all_reduce_coalesced")
_FUNCOL_FUNCS = ("broadcast", "all_reduce", "all_reduce_coalesced", "all_gather_tensor",
                 "all_gather_tensor_autograd", "all_gather_single", "all_gather_into_tensor_coalesced",
                 "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_single",
                 "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd",
                 "permute_tensor")


class CommTimer:
    """Exposed communication seconds per axis (see the module docstring)."""

    def __init__(self, group_to_axis: dict[str, str]):
        self.group_to_axis = dict(group_to_axis)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._pending: dict[int, str] = {}     # id(Work) -> axis
        self._tls = threading.local()
        self._saved: list[tuple[object, str, object]] = []

    # -- bookkeeping
    def reset(self) -> None:
        self.seconds, self.calls = {}, {}
        self._pending.clear()

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def _axis(self, group) -> str:
        try:
            if group is None:
                group = dist.group.WORLD
            if isinstance(group, str):
                name = group
            elif isinstance(group, dist.ProcessGroup):
                name = group.group_name
            else:
                import torch.distributed._functional_collectives as funcol
                name = funcol._resolve_group_name(group)
        except Exception:
            return "other"
        return self.group_to_axis.get(name, "other")

    def _add(self, axis: str, dt: float) -> None:
        self.seconds[axis] = self.seconds.get(axis, 0.0) + dt
        self.calls[axis] = self.calls.get(axis, 0) + 1

    # -- wrappers
    def _wrap(self, fn, *, functional: bool):
        """Time `fn` (a c10d or functional collective) and charge it to its group's axis."""
        sig = inspect.signature(fn)
        timer = self

        def group_of(args, kwargs):
            if fn.__name__ == "batch_isend_irecv":
                ops = args[0] if args else kwargs.get("p2p_op_list", [])
                return getattr(ops[0], "group", None) if ops else None
            try:
                return sig.bind_partial(*args, **kwargs).arguments.get("group")
            except TypeError:
                return None

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if torch.compiler.is_compiling() or getattr(timer._tls, "depth", 0):
                return fn(*args, **kwargs)
            axis = timer._axis(group_of(args, kwargs))
            timer._tls.depth = 1
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if functional:   # time to completion (AsyncCollectiveTensor)
                    for t in (out if isinstance(out, (list, tuple)) else [out]):
                        if isinstance(t, torch.Tensor) and callable(getattr(t, "wait", None)):
                            t.wait()
            finally:
                timer._tls.depth = 0
                timer._add(axis, time.perf_counter() - t0)
            if not functional:   # async c10d work: its wait() is timed when it is called
                for w in (out if isinstance(out, list) else [out]):
                    if isinstance(w, dist.Work):
                        timer._pending[id(w)] = axis
            return out
        return wrapper

    def _wrap_c10d(self, fn):
        return self._wrap(fn, functional=False)

    def _wrap_funcol(self, fn):
        return self._wrap(fn, functional=True)

    def _wrap_wait(self, orig_wait):
        timer = self

        def wait(work, *args, **kwargs):
            axis = timer._pending.pop(id(work), None)
            if axis is None or getattr(timer._tls, "depth", 0):
                return orig_wait(work, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return orig_wait(work, *args, **kwargs)
            finally:
                timer._add(axis, time.perf_counter() - t0)
        return wait

    # -- install / uninstall
    def _patch(self, owner, name, new):
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def install(self) -> "CommTimer":
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d
        for name in _C10D_FUNCS:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            wrapped = self._wrap_c10d(fn)
            self._patch(dist, name, wrapped)
            if getattr(c10d, name, None) is fn:
                self._patch(c10d, name, wrapped)
        for name in _FUNCOL_FUNCS:
            fn = getattr(funcol, name, None)
            if fn is not None:
                self._patch(funcol, name, self._wrap_funcol(fn))
        self._patch(dist.Work, "wait", self._wrap_wait(dist.Work.wait))
        return self

    def uninstall(self) -> None:
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)
        self._saved.clear()


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """all-gather into one tensor (``all_gather_single`` where it exists: the older name is deprecated)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


# --------------------------------------------------------------------------- memory
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
        from torch.profiler import ProfilerActivity, profile
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
    from torch._C._profiler import _EventType
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
    import bisect
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


# --------------------------------------------------------------------------- hardware, MFU
_GPU_NAMES = (("h200", "h200"), ("h100", "h100-sxm"), ("b200", "b200"), ("mi300", "mi300x"),
              ("a100-sxm4-40", "a100-40g"), ("a100-pcie-40", "a100-40g"), ("a100", "a100-80g"))


def hardware_for_device(device: torch.device, override: str | None):
    """The hardware spec for MFU: the override, else the CPU preset or the GPU matched by name."""
    from cost_models.specs import load_hardware
    if override:
        return load_hardware(override)
    if device.type == "cpu":
        return load_hardware("cpu")
    name = torch.cuda.get_device_name(device).lower().replace(" ", "-")
    for key, preset in _GPU_NAMES:
        if key in name:
            return load_hardware(preset)
    return None


def flops_per_token(spec, seq_len: int) -> float | None:
    """`cost_models.flops.flops_per_token`, or None (with a warning) when it is not available."""
    try:
        from cost_models.flops import flops_per_token as fpt
    except ImportError as e:
        print(f"titan-run: warning: MFU unavailable: cost_models.flops.flops_per_token cannot be imported ({e})",
              file=sys.stderr)
        return None
    return float(fpt(spec, seq_len))


def mfu(tokens_per_s_per_device: float, fpt: float | None, peak_flops: float | None) -> float | None:
    if not fpt or not peak_flops:
        return None
    return tokens_per_s_per_device * fpt / peak_flops
