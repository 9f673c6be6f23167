"""When a pipeline rank may let go of an input gradient it has sent: a static reading of the schedule's program.

torch's multi-stage runtime (``_PipelineScheduleRuntime``) runs each rank's list of actions,
``pipeline_order_with_comms[rank]`` (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, ...), and keeps every
send's Work, and with it the sent tensor, to the end of the step.  A send may only be waited where the
wait cannot block on something the peer has yet to do.  The programs of all ranks are known ahead, so
such a point can be read off them: rank ``r`` sends the input gradient of stage ``s``, micro-batch ``m``
to rank ``p`` (stage ``s - 1``); ``p`` runs the backward of ``(s - 1, m)`` only after that receive has
completed; the first message ``p`` sends to ``r`` after that backward leaves ``p`` later still, so once
``r`` has received it -- at the start of the compute action that consumes it -- the gradient send has
completed (on gloo the receiver holds its bytes; on NCCL the wait is only a stream dependency), and its
wait returns at once.  Sends with no later message back (the cool-down's last ones) stay to the step's end.

Read off torch 2.14's Interleaved1F1B, ZBVZeroBubble and DualPipeV programs (pp 2-16, v 2-8, 2 and 4 micro-batches
per pipeline rank: tests/test_pipeline_sends.py): at the point where a rank holds the most forward activations, at most two such gradients are
still held (three on some ZBVZeroBubble ranks), whatever the micro-batch count, where torch holds every one
sent so far; the cost model's ``pipeline_extra_bytes`` charges that bound (``HELD_GRAD_SENDS``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

# Consumer keys: ("F", stage, micro-batch) for a forward that takes a received activation, ("B", stage,
# micro-batch) for a (full or input) backward that takes a received output gradient.
Key = tuple[str, int, int]
_CONSUMES = {"F": "F", "B": "B", "I": "B"}


def _flat(actions: Iterable) -> list:
    """The actions in the order they run, an OVERLAP_F_B action's sub-actions in its place."""
    out = []
    for a in actions:
        subs = getattr(a, "sub_actions", None)
        out.extend(subs if subs else (a,))
    return out


def _kind(action) -> str:
    t = action.computation_type
    return getattr(t, "value", str(t))


def _index(program: list, stage_to_rank: Callable[[int], int]) -> tuple[dict[Key, int], list[tuple[int, int, Key]]]:
    """(position of each consuming compute action, [(position, destination rank, consumer key)] of each send)."""
    consume: dict[Key, int] = {}
    sends: list[tuple[int, int, Key]] = []
    for i, a in enumerate(program):
        kind = _kind(a)
        if kind in _CONSUMES:
            consume.setdefault((_CONSUMES[kind], a.stage_index, a.microbatch_index), i)
        elif kind == "SEND_F":
            sends.append((i, stage_to_rank(a.stage_index + 1), ("F", a.stage_index + 1, a.microbatch_index)))
        elif kind == "SEND_B":
            sends.append((i, stage_to_rank(a.stage_index - 1), ("B", a.stage_index - 1, a.microbatch_index)))
    return consume, sends


def grad_send_releases(order: dict[int, list], stage_to_rank: Callable[[int], int],
                       rank: int) -> dict[Key, list[tuple[int, int]]]:
    """For `rank`, the input-gradient sends it may let go at each consuming compute action:
    {consumer key: [(sending stage, micro-batch), ...]}.  `order` is every rank's program
    (``pipeline_order_with_comms``)."""
    index = {q: _index(_flat(acts), stage_to_rank) for q, acts in order.items()}
    consume_here, my_sends = index[rank]
    out: dict[Key, list[tuple[int, int]]] = {}
    for pos, dest, key in my_sends:
        if key[0] != "B" or dest == rank or dest not in index:
            continue
        peer_consume, peer_sends = index[dest]
        used = peer_consume.get(key)
        if used is None:
            continue
        back = next((c for p, d, c in peer_sends if p > used and d == rank), None)
        if back is None or consume_here.get(back, -1) <= pos:
            continue
        out.setdefault(back, []).append((key[1] + 1, key[2]))
    return out


def held_at_activation_peak(order: dict[int, list], stage_to_rank: Callable[[int], int], rank: int,
                            weight: float = 64.0) -> int:
    """Input-gradient sends `rank` still holds, under :func:`grad_send_releases`, where its forward chunks in
    flight (F less B/W) are the most (ties: the most held; `weight` puts the activations first)."""
    release = grad_send_releases(order, stage_to_rank, rank)
    held = in_flight = 0
    best = (-1.0, 0)
    for a in _flat(order[rank]):
        kind = _kind(a)
        if kind in _CONSUMES:
            held -= len(release.get((_CONSUMES[kind], a.stage_index, a.microbatch_index), ()))
        in_flight += 1 if kind == "F" else (-1 if kind in ("B", "W") else 0)
        held += kind == "SEND_B"
        best = max(best, (in_flight * weight + held, held))
    return best[1]
