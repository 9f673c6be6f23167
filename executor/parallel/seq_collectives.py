"""The sequence-parallel boundary collectives written out as point-to-point exchanges, for gloo in erasure mode.

Under TP + SP every block has four boundaries a step (``spmd_tensor_parallel``): the all-gather of
the attention / feed-forward input over the sequence (backward: a reduce-scatter of its gradient)
and the reduce-scatter of the row-wise linears' pending sums (backward: an all-gather).  On gloo
the library versions cost more bytes and copies than the operation needs:

* ``reduce_scatter_tensor`` is a clone of the whole input, a FULL all-reduce of it (on 2 ranks a
  ring: each rank sends and receives the whole tensor's half twice) and a copy of this rank's chunk
  (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``); a sequence-dim scatter first also
  copies the input into rank-major order (``funcol.reduce_scatter_tensor``'s chunk + cat).  The
  direct reduce-scatter sends each peer only its chunk (``isend``), receives this rank's chunk
  from each peer (``irecv``) and sums them locally, in rank order;
* the sequence-dim all-gather gathers rank-major into a staging tensor (gloo first copies this
  rank's input into it) and then concatenates along the sequence (a second full copy); here the
  peers' chunks are received and every chunk is copied once into its place.

The sums are those of the library collectives: on 2 ranks ``a + b == b + a`` bitwise (IEEE
addition is commutative), so the result is exact; with more ranks the local sum runs in rank
order, every rank reducing its own chunk (the same value on every rank that needs it), which
may round differently from gloo's ring order (parity tests: within their tolerances).

These functions carry no ``spmd_types`` types: ``spmd_tensor_parallel`` uses them only on gloo
and only while the type checker is off (erasure mode, the default), where a typed collective
is exactly this collective; under ``train.spmd_typecheck`` the typed ones run.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = 1      # [batch, seq, ...]


def _post(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group) -> list[dist.Work]:
    """Post the receive of ``recvs[p]`` from and the send of ``sends[p]`` to each peer p (ranks in `group`)."""
    works = [dist.irecv(buf, group=group, group_src=p) for p, buf in recvs.items()]
    works += [dist.isend(t, group=group, group_dst=p) for p, t in sends.items()]
    return works


def _exchange(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group) -> None:
    """Send ``sends[p]`` to and receive ``recvs[p]`` from each peer p (ranks in `group`), then wait."""
    for w in _post(sends, recvs, group):
        w.wait()


class _Works(dist.Work):
    """Several point-to-point works as one ``dist.Work`` (what FSDP2 waits on for an async all-gather)."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def all_gather_exchange(out: torch.Tensor, inp: torch.Tensor, group, rank: int, size: int,
                    async_op: bool = False) -> dist.Work | None:
    """``out`` (1-D, ``size`` rank-major chunks) = every rank's ``inp``, by a direct exchange: this rank's chunk
    is sent to each peer and each peer's chunk received straight into its place (FSDP2's all-gather buffer,
    whose input is already this rank's chunk of ``out``: then nothing is copied).  Returns the work when
    `async_op` (the chunks are in place once it is waited on), else waits and returns None."""
    chunks = out.chunk(size)
    if inp.data_ptr() != chunks[rank].data_ptr():
        chunks[rank].copy_(inp)
    peers = [p for p in range(size) if p != rank]
    works = _post({p: chunks[rank] for p in peers}, {p: chunks[p] for p in peers}, group)
    if async_op:
        return _Works(works)
    for w in works:
        w.wait()
    return None


def all_gather_seq(x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
    """``[b, s/size, ...]`` per rank -> ``[b, s, ...]`` on every rank, rank r's chunk at sequence block r."""
    x = x.contiguous()
    b, s_loc = x.shape[0], x.shape[SEQ_DIM]
    out = x.new_empty((b, size * s_loc, *x.shape[2:]))
    blocks = out.view(b, size, s_loc, *x.shape[2:])          # [b, rank, s/size, ...], views of `out`
    peers = [p for p in range(size) if p != rank]
    if b == 1:          # each sequence block of `out` is contiguous: receive straight into it
        recvs = {p: blocks[:, p] for p in peers}
    else:
        recvs = {p: x.new_empty(x.shape) for p in peers}
    _exchange({p: x for p in peers}, recvs, group)
    blocks[:, rank].copy_(x)
    if b != 1:
        for p, buf in recvs.items():
            blocks[:, p].copy_(buf)
    return out


class PendingReduceScatter:
    """A reduce-scatter in flight: this rank's chunk of the sum of every rank's `chunks` (``chunks[p]`` goes to
    rank p).  Posting sends each peer its chunk and receives this rank's chunk from each peer; :meth:`finish`
    waits and sums the chunks locally in rank order (the one sum of :func:`reduce_scatter_seq` and
    :func:`reduce_scatter_flat`)."""

    def __init__(self, chunks, group, rank: int, size: int):
        own = chunks[rank]
        peers = [p for p in range(size) if p != rank]
        self._recvs = {p: torch.empty(own.shape, dtype=own.dtype, device=own.device) for p in peers}
        self._works = _post({p: chunks[p].contiguous() for p in peers}, self._recvs, group)
        self._parts = [own if p == rank else self._recvs[p] for p in range(size)]

    def finish(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Wait for the peers' chunks; return their sum (written into `out` when given)."""
        for w in self._works:
            w.wait()
        parts = self._parts
        if out is None:
            out = parts[0] + parts[1]
        else:
            torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out += part
        self._works, self._parts, self._recvs = [], [], {}
        return out


def reduce_scatter_seq(x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
    """``[b, s, ...]`` pending sum per rank -> this rank's sequence block ``[b, s/size, ...]`` of the sum."""
    s = x.shape[SEQ_DIM]
    if s % size:
        raise ValueError(f"sequence parallel: sequence length {s} is not divisible by tp={size}")
    return PendingReduceScatter(x.chunk(size, SEQ_DIM), group, rank, size).finish()


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group, rank: int, size: int) -> None:
    """``out`` = this rank's dim-0 chunk of the sum of every rank's ``inp`` (contiguous, rank-major chunks: the
    layout of FSDP2's reduce-scatter buffer), by the same exchange as :func:`reduce_scatter_seq`."""
    PendingReduceScatter(inp.chunk(size), group, rank, size).finish(out)


class GatherSeq(torch.autograd.Function):
    """S(1) -> R over the sequence: all-gather forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.comm = (group, rank, size)
        return all_gather_seq(x, group, rank, size)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, *ctx.comm), None, None, None


class ScatterSeq(torch.autograd.Function):
    """P -> S(1) over the sequence: reduce-scatter forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.comm = (group, rank, size)
        return reduce_scatter_seq(x, group, rank, size)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, *ctx.comm), None, None, None


# --------------------------------------------------------------------------- inside a compiled block
# The same two exchanges as custom ops, so a compiled TP block (spmd_types erasure mode, gloo) runs them inside its
# graph, where the autograd.Functions above (dist.isend / irecv) would break it; torch's functional collectives
# there are gloo's library ones (the clone + full all-reduce + chunk copy of a reduce-scatter).  The group is
# passed by its registered name, as in torch's functional collectives; each op's backward is the other.
@torch.library.custom_op("titan::all_gather_seq", mutates_args=())
def all_gather_seq_op(x: torch.Tensor, group_name: str, rank: int, size: int) -> torch.Tensor:
    return all_gather_seq(x, dist.distributed_c10d._resolve_process_group(group_name), rank, size)


@torch.library.custom_op("titan::reduce_scatter_seq", mutates_args=())
def reduce_scatter_seq_op(x: torch.Tensor, group_name: str, rank: int, size: int) -> torch.Tensor:
    return reduce_scatter_seq(x, dist.distributed_c10d._resolve_process_group(group_name), rank, size).contiguous()


@all_gather_seq_op.register_fake
def _(x, group_name, rank, size):
    return x.new_empty((x.shape[0], size * x.shape[SEQ_DIM], *x.shape[2:]))


@reduce_scatter_seq_op.register_fake
def _(x, group_name, rank, size):
    return x.new_empty((x.shape[0], x.shape[SEQ_DIM] // size, *x.shape[2:]))


def _setup_comm(ctx, inputs, output) -> None:
    ctx.comm = inputs[1:]


all_gather_seq_op.register_autograd(lambda ctx, grad: (reduce_scatter_seq_op(grad, *ctx.comm), None, None, None),
                                    setup_context=_setup_comm)
reduce_scatter_seq_op.register_autograd(lambda ctx, grad: (all_gather_seq_op(grad, *ctx.comm), None, None, None),
                                        setup_context=_setup_comm)


__all__ = ["GatherSeq", "PendingReduceScatter", "ScatterSeq", "all_gather_exchange", "all_gather_seq",
           "all_gather_seq_op", "reduce_scatter_flat", "reduce_scatter_seq", "reduce_scatter_seq_op"]
