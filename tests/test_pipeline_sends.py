"""The points at which titan-run lets go of a sent input gradient (executor/parallel/pipeline_sends.py), read
off torch's own multi-stage schedule programs (built without a process group), are checked against an
independent run of all ranks' programs with vector clocks: the peer's use of the gradient happens before
the point; and the number still held at a rank's activation peak is the cost model's bound."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cost_models.activations import HELD_GRAD_SENDS, HELD_GRAD_SENDS_ZBV
from executor.parallel.pipeline_sends import _flat, _kind, grad_send_releases, held_at_activation_peak

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def _programs(name: str, pp: int, v: int, m: int):
    """Every rank's program (``pipeline_order_with_comms``) and the stage -> rank map of torch's schedule."""
    cls = schedules.get_schedule_class(name)
    n = pp * v
    ids = [0, n - 1] if name in V_SHAPED else [i * pp for i in range(v)]
    stages = [SimpleNamespace(num_stages=n, group_size=pp, group_rank=0, stage_index=i, is_first=i == 0,
                              is_last=i == n - 1, submod=None) for i in ids]
    sched = cls(stages, n_microbatches=m)
    return sched.pipeline_order_with_comms, sched.stage_index_to_group_rank


def _needs(action, sent_keys) -> tuple | None:
    kind = _kind(action)
    key = {"F": "F", "B": "B", "I": "B"}.get(kind)
    if key is None:
        return None
    k = (key, action.stage_index, action.microbatch_index)
    return k if k in sent_keys else None


def _vector_clocks(order, to_rank):
    """Run all ranks' programs (sends never block, a compute action waits for the message it consumes) and
    return each (rank, position)'s vector clock."""
    progs = {r: _flat(a) for r, a in order.items()}
    ranks = sorted(progs)
    sent_keys = set()
    for acts in progs.values():
        for a in acts:
            kind = _kind(a)
            if kind == "SEND_F":
                sent_keys.add(("F", a.stage_index + 1, a.microbatch_index))
            elif kind == "SEND_B":
                sent_keys.add(("B", a.stage_index - 1, a.microbatch_index))
    mailbox, clocks = {}, {}
    pos = {r: 0 for r in ranks}
    vc = {r: [0] * len(ranks) for r in ranks}
    while any(pos[r] < len(progs[r]) for r in ranks):
        moved = False
        for r in ranks:
            while pos[r] < len(progs[r]):
                a = progs[r][pos[r]]
                need = _needs(a, sent_keys)
                if need is not None:
                    if need not in mailbox:
                        break
                    vc[r] = [max(x, y) for x, y in zip(vc[r], mailbox[need])]
                vc[r][r] += 1
                kind = _kind(a)
                if kind == "SEND_F":
                    mailbox[("F", a.stage_index + 1, a.microbatch_index)] = list(vc[r])
                elif kind == "SEND_B":
                    mailbox[("B", a.stage_index - 1, a.microbatch_index)] = list(vc[r])
                clocks[(r, pos[r])] = list(vc[r])
                pos[r] += 1
                moved = True
        assert moved, "the programs deadlock"
    return progs, clocks


CASES = [("Interleaved1F1B", pp, v, m) for pp in (2, 4) for v in (2, 4) for m in (pp, 3 * pp)] + \
        [(name, pp, 2, m) for name in V_SHAPED for pp in (2, 4) for m in (2 * pp, 3 * pp)]


@pytest.mark.parametrize("name, pp, v, m", CASES)
def test_each_release_follows_the_peers_use_of_the_gradient(name, pp, v, m):
    order, ranks = _programs(name, pp, v, m)
    progs, clocks = _vector_clocks(order, ranks.__getitem__)

    def position(rank, key):
        return next(i for i, a in enumerate(progs[rank]) if _needs(a, {key}) == key)

    released = 0
    for r in order:
        for trigger, sends in grad_send_releases(order, ranks.__getitem__, r).items():
            at = clocks[(r, position(r, trigger))]
            for stage, mb in sends:
                peer = ranks[stage - 1]
                used = clocks[(peer, position(peer, ("B", stage - 1, mb)))]
                assert all(x <= y for x, y in zip(used, at)), (r, trigger, stage, mb)
                released += 1
    assert released > 0


@pytest.mark.parametrize("name, vs", [("Interleaved1F1B", (2, 4, 8)), ("ZBVZeroBubble", (2,)), ("DualPipeV", (2,))])
@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_held_gradients_at_the_activation_peak_stay_within_the_cost_models_bound(name, vs, pp):
    bound = HELD_GRAD_SENDS_ZBV if name == "ZBVZeroBubble" else HELD_GRAD_SENDS
    for v in vs:
        for m in (2 * pp, 4 * pp):
            order, ranks = _programs(name, pp, v, m)
            held = [held_at_activation_peak(order, ranks.__getitem__, r) for r in order]
            assert max(held) <= bound, (v, m, held)
