"""The MoE routing of the dry run's FakeTensor step (``dry_run_step.py``): balanced, with its integers known.

A FakeTensor has a shape but no values, and the mixture-of-experts step sizes
some of its buffers by values: the tokens per expert (the padded expert batch,
``int(counts.max())``), the expert-parallel all-to-all splits (``tolist()``)
and the regrouping of received rows.  Under FakeTensor those raise
``DataDependentOutputException`` / ``DynamicOutputShapeException``, and one
rank alone could not know them anyway: they depend on the data and on what the
other ranks route.  So the dry run fixes the routing to the analytic model's
assumption (``cost_models``: every token's top_k copies spread evenly over the
experts) and runs the real MoE code on it:

* each router's expert ids are replaced, by a forward hook applied from
  outside, with the balanced assignment ``(token * top_k + slot) mod E``
  (top_k distinct experts per token, ``T * top_k / E`` tokens per expert);
* :class:`RoutingValues`, a dispatch mode over the FakeTensorMode, carries
  the real values of such integer bookkeeping tensors: an ATen op whose tensor
  inputs all have values (or a factory with none) and whose outputs are small
  integer or bool tensors also runs on the values, so ``argsort``, the counts,
  ``.tolist()`` and ``repeat_interleave`` see numbers while every float tensor
  stays fake (and is what the memory tracker counts);
* the expert-parallel counts exchange receives, from every ep rank, what this
  rank sends to it: every rank routes alike (balanced, the same counts).

The real run never goes through here.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakTensorKeyDictionary

from .models.moe import MoEFeedForward

__all__ = ["RoutingValues", "balanced_routing"]

# the largest integer tensor whose values are carried (the routing bookkeeping holds tokens * top_k entries)
MAX_VALUED_NUMEL = 1 << 24
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


def _bookkeeping(t) -> bool:
    return (isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())
            and t.numel() <= MAX_VALUED_NUMEL)


def _integer_factory(func, args, kwargs) -> bool:
    """A tensor factory (no tensor inputs) of integers: ``arange`` of ints, or an integer/bool dtype."""
    dtype = kwargs.get("dtype")
    if dtype is None and func.overloadpacket is torch.ops.aten.arange:
        return all(isinstance(a, int) for a in args)
    return dtype in (torch.int64, torch.int32, torch.bool)


class RoutingValues(TorchDispatchMode):
    """Real values alongside the FakeTensors of integer bookkeeping (see the module docstring)."""

    def __init__(self, fake_mode):
        super().__init__()
        self.fake_mode = fake_mode
        self.values = WeakTensorKeyDictionary()

    def fake_with_value(self, real: torch.Tensor) -> torch.Tensor:
        """A FakeTensor of `real`'s shape that carries `real` as its value."""
        fake = self.fake_mode.from_tensor(real)
        self.values[fake] = real
        return fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if func is _LOCAL_SCALAR and tensors[0] in self.values:
            return self.values[tensors[0]].item()
        known = (func.namespace == "aten" and torch.Tag.nondeterministic_seeded not in func.tags
                 and all(t in self.values for t in tensors) and (tensors or _integer_factory(func, args, kwargs)))
        if not known:
            for t in self._written(func, args, kwargs):
                self.values.pop(t, None)     # its value is stale now
            return func(*args, **kwargs)
        real_args, real_kwargs = tree_map_only(torch.Tensor, lambda t: self.values[t], (args, kwargs))
        with no_dispatch():
            real_out = func(*real_args, **real_kwargs)
        real_leaves = [t for t in tree_leaves(real_out) if isinstance(t, torch.Tensor)]
        if not all(_bookkeeping(t) for t in real_leaves):
            for t in self._written(func, args, kwargs):
                self.values.pop(t, None)
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except (torch._subclasses.fake_tensor.DynamicOutputShapeException,
                torch._subclasses.fake_tensor.DataDependentOutputException):
            # the output's shape depends on the values (repeat_interleave): shape the fake by the real one
            out = tree_map_only(torch.Tensor, self.fake_mode.from_tensor, real_out)
        fakes = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for fake, real in zip(fakes, real_leaves):
            self.values[fake] = real
        return out

    @staticmethod
    def _written(func, args, kwargs) -> list[torch.Tensor]:
        """The tensor arguments `func` writes to (in-place and out= ops)."""
        out = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            out += [t for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        return out


def _balanced_ids(mode: RoutingValues, idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Expert ids [tokens, k] of the balanced routing, ``(token * k + slot) mod E``, carrying their values."""
    tokens, k = idx.shape
    with no_dispatch():      # a real tensor (the hook runs inside the fake mode)
        real = (torch.arange(tokens * k, dtype=idx.dtype) % n_experts).view(tokens, k)
    return mode.fake_with_value(real)


def _alike_exchange(mode: RoutingValues, exchange, ep_rank: int):
    """`exchange` (the ep counts all-to-all), its result given the value every rank routing alike gives."""

    def counts_exchange(send: torch.Tensor) -> torch.Tensor:
        recv = exchange(send)
        sent = mode.values.get(send)
        if sent is not None:
            with no_dispatch():
                mode.values[recv] = sent[ep_rank].expand_as(sent).clone()
        return recv

    return counts_exchange


@contextlib.contextmanager
def balanced_routing(stages, fake_mode):
    """Inside `fake_mode`: every MoE layer of `stages` routes balanced, its bookkeeping integers known."""
    layers = [m for _, stage in stages for m in stage.modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        yield None
        return
    mode = RoutingValues(fake_mode)
    handles, patched = [], []
    for ff in layers:
        n_experts = ff.router.n_experts
        handles.append(ff.router.register_forward_hook(
            lambda _m, _inp, out, e=n_experts: (out[0], _balanced_ids(mode, out[1], e))))
        experts = ff.experts
        if hasattr(experts, "exchange_counts"):
            experts.exchange_counts = _alike_exchange(mode, experts.exchange_counts,
                                                      experts.ep_mesh.get_local_rank())
            patched.append(experts)
    try:
        with mode:
            yield mode
    finally:
        for h in handles:
            h.remove()
        for experts in patched:
            del experts.exchange_counts         # the class's method again
