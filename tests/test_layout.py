"""cost_models.layout: the one pipeline split, tied to the executor's (issue 12 item 2)."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from cost_models.coefficients import Coefficients
from cost_models.estimate import estimate
from cost_models.flops import param_counts
from cost_models.layout import (busiest_rank_layers, holds_ends, in_flight_on_rank, layer_mix, rank_index,
                                rank_layers, rank_params, stage_layer_counts)
from cost_models.specs import load_hardware, load_model
from cost_models.workload import Workload
from executor.dry_run_step import rank_actions
from executor.parallel.pipeline import split_layers, stage_ids_for_rank
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable


def _plans(extra_units: int = 0):
    out = []
    for L, pp in itertools.product((3, 5, 8, 13, 16, 61, 80, 126), (1, 2, 3, 4, 7, 8, 16)):
        for sched, vs in (("1F1B", (1,)), ("GPipe", (1,)), ("Interleaved1F1B", (2, 3, 4, 5)),
                          ("ZBVZeroBubble", (2,)), ("DualPipeV", (2,))):
            for v in vs:
                if pp == 1 and sched != "1F1B" or pp * v > L + extra_units:
                    continue
                out.append((L, Plan(pp=pp, schedule=sched, stages_per_rank=v, n_microbatches=2 * pp)))
    return out


CASES = _plans()
WEIGHTED_CASES = _plans(extra_units=2)     # pp_split weighted: the embedding and the head are units too


class _Model:                       # the two facts of a model the layout reads
    def __init__(self, n_layers, n_dense):
        self.n_layers, self.n_moe_layers = n_layers, n_layers - n_dense
        self.is_moe = n_dense < n_layers


def _executor_rank(L, plan, r, n_dense=0, weighted=False):
    """(layers, dense layers, holds stage 0, holds the last stage) of pipeline rank r, from the executor."""
    ranges = split_layers(L, plan.pp * plan.stages_per_rank, weighted)
    ids = stage_ids_for_rank(plan, r)
    layers = [i for s in ids for i in ranges[s]]
    return len(layers), sum(i < n_dense for i in layers), 0 in ids, len(ranges) - 1 in ids


def test_stage_layer_counts_is_the_executor_split():
    for L, n in [(4, 4), (10, 4), (7, 3), (126, 16), (126, 32), (80, 64), (61, 16)]:
        assert [len(r) for r in split_layers(L, n)] == stage_layer_counts(L, n)
        assert sum(stage_layer_counts(L, n)) == L and max(stage_layer_counts(L, n)) - min(stage_layer_counts(L, n)) <= 1
    with pytest.raises(ValueError, match="at least one layer per stage"):
        stage_layer_counts(3, 4)


def test_weighted_split_counts_the_embedding_and_the_head():
    assert stage_layer_counts(70, 12, weighted=True) == [5] + [6] * 10 + [5]      # BLOOM: 72 units / 12
    assert stage_layer_counts(126, 128, weighted=True) == [0] + [1] * 126 + [0]   # Llama 3: a chunk per unit
    assert stage_layer_counts(30, 8, weighted=True) == [3, 4, 4, 4, 4, 4, 4, 3]    # Zero Bubble's 6.2B
    assert stage_layer_counts(5, 1, weighted=True) == [5]
    with pytest.raises(ValueError, match=r"\+2 units"):
        stage_layer_counts(3, 6, weighted=True)


@pytest.mark.parametrize("weighted", [False, True])
def test_rank_layers_match_the_executor_for_every_rank_and_schedule(weighted):
    cases = WEIGHTED_CASES if weighted else CASES
    for L in sorted({L for L, _ in cases}):
        plans = [p for l, p in cases if l == L]
        t = CandidateTable.from_plans(plans)
        n_dense = min(3, L - 1)
        for r in range(max(p.pp for p in plans)):
            on = np.array([r < p.pp for p in plans])
            tot, dense = rank_layers(t, L, np.minimum(r, t.pp - 1), n_dense, weighted)
            want = np.array([_executor_rank(L, p, min(r, p.pp - 1), n_dense, weighted) for p in plans])
            np.testing.assert_array_equal(tot[on], want[on, 0])
            np.testing.assert_array_equal(dense[on], want[on, 1])
        busiest = busiest_rank_layers(t, L, weighted)
        np.testing.assert_array_equal(busiest, [max(_executor_rank(L, p, r, 0, weighted)[0] for r in range(p.pp))
                                                for p in plans])


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("n_dense", [0, 1, 3, 10])
def test_busiest_rank_has_the_most_moe_blocks(n_dense, weighted):
    plans = [p for L, p in (WEIGHTED_CASES if weighted else CASES) if L == 61]
    t = CandidateTable.from_plans(plans)
    m = _Model(61, n_dense)
    nd, nm = layer_mix(t, m, weighted=weighted)
    for i, p in enumerate(plans):
        per_rank = [_executor_rank(61, p, r, n_dense, weighted) for r in range(p.pp)]
        best = max((tot - d, tot) for tot, d, _, _ in per_rank)
        assert (nm[i], nd[i] + nm[i]) == best, p.describe()
        fd, fm = layer_mix(t, m, first=True, weighted=weighted)
        assert (fd[i], fm[i]) == (per_rank[0][1], per_rank[0][0] - per_rank[0][1])


@pytest.mark.parametrize("weighted", [False, True])
def test_ends_of_the_model(weighted):
    plans = [p for L, p in (WEIGHTED_CASES if weighted else CASES) if L == 16]
    t = CandidateTable.from_plans(plans)
    m = _Model(16, 16)
    for which in ("first", "last", "busiest"):
        emb, head = holds_ends(t, m, which, weighted)
        r = rank_index(t, m, which, weighted)
        for i, p in enumerate(plans):
            _, _, e, h = _executor_rank(16, p, int(r[i]), 0, weighted)
            assert (emb[i], head[i]) == (e, h), (which, p.describe())


def test_in_flight_1f1b_follows_the_executors_order():
    plans = [Plan(pp=pp, schedule="1F1B", n_microbatches=n) for pp in (2, 4, 8) for n in (pp, 2 * pp, 3 * pp)]
    t = CandidateTable.from_plans(plans)
    for r in range(8):
        got = in_flight_on_rank(t, np.minimum(r, t.pp - 1))
        for i, p in enumerate(plans):
            acts = rank_actions(p, [(min(r, p.pp - 1), None)])
            live = peak = 0
            for kind, _, _ in acts:
                live += {"F": 1, "B": -1}.get(kind, 0)
                peak = max(peak, live)
            assert got[i] == peak, (r, p.describe())


def test_issue_example_compute_follows_the_busiest_ranks_layers():
    """llama3-70b (80 layers), pp 16, Interleaved1F1B with V = 2, 4, 5: the executor puts 5 layers on
    the busiest rank in all three (was ceil(80 / (16 V)) * V = 6, 8, 5), so compute is one figure."""
    model, hw = load_model("llama3-70b"), load_hardware("h100-sxm")
    wl = Workload(seq_len=8192, global_batch=128)
    plans = [Plan(dp_shard=1, pp=16, tp=8, microbatch=1, n_microbatches=128, schedule="Interleaved1F1B",
                  stages_per_rank=v, ac="full") for v in (2, 4, 5)]
    t = CandidateTable.from_plans(plans)
    assert busiest_rank_layers(t, model.n_layers).tolist() == [5, 5, 5]
    assert [max(len([i for s in stage_ids_for_rank(p, r) for i in split_layers(80, 16 * p.stages_per_rank)[s]])
                for r in range(16)) for p in plans] == [5, 5, 5]
    c = estimate(t, model, hw, wl, Coefficients()).time["compute"]
    np.testing.assert_allclose(c, c[0], rtol=1e-9)


def test_a_tied_head_on_another_rank_is_a_second_copy_of_the_embedding():
    """Tied embeddings: with one pipeline stage the head *is* the embedding (counted once); with
    pipelining the last stage holds its own copy (Megatron-LM, DeepSpeed TiedLayerSpec), with its
    gradient and optimizer state; a V schedule keeps both ends on rank 0, so one copy again."""
    tied = dataclasses.replace(load_model("llama3-8b"), tie_embeddings=True)
    pc = param_counts(tied)
    emb = pc["embedding"] / 2
    t = CandidateTable.from_plans([
        Plan(dp_shard=1, pp=4, tp=2, microbatch=1, n_microbatches=8, schedule="1F1B"),
        Plan(dp_shard=4, tp=2, microbatch=1, n_microbatches=1),
        Plan(dp_shard=1, pp=2, tp=2, microbatch=1, n_microbatches=8, schedule="ZBVZeroBubble", stages_per_rank=2)])
    rp = rank_params(t, tied)
    nd, _ = rp["last_layers"]
    assert rp["last_dense"][0] == pytest.approx(nd[0] * rp["dense_block"][0] + emb + pc["final_norm"])
    nd1, _ = rp["first_layers"]
    assert rp["first_dense"][1] == pytest.approx(nd1[1] * rp["dense_block"][1] + emb + pc["final_norm"])
    nd2, _ = rp["first_layers"]
    assert rp["first_dense"][2] == pytest.approx(nd2[2] * rp["dense_block"][2] + emb + pc["final_norm"])


@pytest.mark.parametrize("weighted", [False, True])
def test_busiest_rank_with_long_dense_prefixes(weighted):
    """Dense prefixes spanning several rounds of interleaved or V stages: the busiest rank by MoE blocks (then
    blocks) is the executor's, over every rank (the ranks around the dense/MoE boundary are candidates)."""
    for L, n_dense in itertools.product((27, 47, 94), (1, 5, 10, 20)):
        plans = [Plan(pp=pp, schedule=sched, stages_per_rank=v, n_microbatches=4 * pp)
                 for pp in (2, 3, 4, 6, 7, 8, 12, 16)
                 for sched, vs in (("1F1B", (1,)), ("Interleaved1F1B", (2, 3, 4, 5)), ("ZBVZeroBubble", (2,)),
                                   ("DualPipeV", (2,)))
                 for v in vs if pp * v <= L + 2 * weighted]
        t = CandidateTable.from_plans(plans)
        nd, nm = layer_mix(t, _Model(L, n_dense), weighted=weighted)
        for i, p in enumerate(plans):
            per_rank = [_executor_rank(L, p, r, n_dense, weighted) for r in range(p.pp)]
            assert (nm[i], nd[i] + nm[i]) == max((tot - d, tot) for tot, d, _, _ in per_rank), (L, n_dense, p.describe())


def test_per_layout_functions_equal_their_per_candidate_form():
    """The layout functions run once per distinct (pp, stages, schedule[, tp, ep]) and broadcast back
    (`layout.per_layout`): on an enumerated MoE table with many candidates per layout, every array equals the
    undecorated function's on the whole table, for both pipeline splits and every rank."""
    import search_spaces.constraints as C
    from cost_models import layout
    from cost_models.specs import load_model
    from search_spaces.enumerate import enumerate_plans
    from search_spaces.space import load_space

    model = load_model("deepseek-v3-671b")
    target = C.Target.of(model, world_size=64, seq_len=4096, global_batch=128, gpus_per_node=8,
                         float8_supported=True, pp_weighted=False)
    table = enumerate_plans(load_space("moe"), target).table
    assert len(table) > 10 * len(layout.unique_rows(table, layout.PARAM_COLUMNS)[0])    # many per layout

    def same(a, b):
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, tuple):
            for x, y in zip(a, b):
                same(x, y)
        else:
            np.testing.assert_array_equal(np.broadcast_to(a, len(table)), np.broadcast_to(b, len(table)))

    for weighted in (False, True):
        same(layout.rank_params(table, model, weighted), layout.rank_params.__wrapped__(table, model, weighted))
        same(layout.busiest_rank_layers(table, model.n_layers, weighted),
             layout.busiest_rank_layers.__wrapped__(table, model.n_layers, weighted))
        for which in layout.RANKS:
            same(layout.rank_index(table, model, which, weighted),
                 layout.rank_index.__wrapped__(table, model, which, weighted))
            same(layout.layer_mix(table, model, which=which, weighted=weighted),
                 layout.layer_mix.__wrapped__(table, model, which=which, weighted=weighted))
            same(layout.holds_ends(table, model, which, weighted),
                 layout.holds_ends.__wrapped__(table, model, which, weighted))


def test_per_layout_results_are_kept_once_read_only_and_read_through_a_taken_table():
    """`per_layout` keeps each result in the table's memo under its bound arguments (a positional and a keyword
    call share it), read-only; `layout.take` gives a sub-table that reads its parent's results at its rows.  Each
    equals the function on a table without a memo."""
    import search_spaces.constraints as C
    from cost_models import activations, layout
    from cost_models.specs import load_model
    from search_spaces.enumerate import enumerate_plans
    from search_spaces.space import load_space

    model = load_model("llama3-70b")
    target = C.Target.of(model, world_size=64, seq_len=4096, global_batch=128, gpus_per_node=8,
                         float8_supported=True, pp_weighted=False)
    table = enumerate_plans(load_space("dense"), target).table
    wl, coeffs = Workload(seq_len=4096, global_batch=128), Coefficients()
    kept = layout.rank_params(table, model, True)
    assert layout.rank_params(table, model, weighted=True) is kept
    assert not kept["busiest_dense"].flags.writeable
    with pytest.raises(ValueError):
        kept["busiest_dense"][0] = 0.0

    def fresh(t):
        return CandidateTable(t.columns)       # the same columns, an empty memo

    def same(a, b):
        if isinstance(a, (dict, tuple)):
            for x, y in zip(a.values() if isinstance(a, dict) else a, b.values() if isinstance(b, dict) else b):
                same(x, y)
        else:
            np.testing.assert_array_equal(a, b)

    same(kept, layout.rank_params(fresh(table), model, True))
    act = activations.per_layer_activation_bytes(table, model, wl, coeffs, moe=False)
    same(act, activations.per_layer_activation_bytes(fresh(table), model, wl, coeffs, moe=False))
    idx = np.random.default_rng(0).choice(len(table), size=len(table) // 3, replace=False)
    sub = layout.take(table, idx)
    read = layout.rank_params(sub, model, True)
    same(read, layout.rank_params(fresh(table.take(idx)), model, True))
    same(read, {k: (tuple(x[idx] for x in v) if isinstance(v, tuple) else v[idx]) for k, v in kept.items()})
    same(activations.per_layer_activation_bytes(sub, model, wl, coeffs, moe=False),
         tuple(a[idx] for a in act))
