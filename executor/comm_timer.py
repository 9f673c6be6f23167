"""Exposed communication time per mesh axis (:class:`CommTimer`), per step.

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
"""
from __future__ import annotations

import functools
import inspect
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

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
