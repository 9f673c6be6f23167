"""Where the layers go, for every candidate of a `CandidateTable` at once.

One split for the cost model and the executor: `stage_layer_counts` is what
``executor.parallel.pipeline.split_layers`` cuts the model by, and the vectorized
functions below count the same layers per pipeline rank under each schedule's
stage placement (the executor's ``stage_ids_for_rank``):

* GPipe / 1F1B: rank r holds stage r;
* Interleaved1F1B (loop placement): stages r, r + pp, ..., r + (v-1) pp;
* ZBVZeroBubble / DualPipeV (V placement): stages r and 2 pp - 1 - r.

Stage s of S = pp * v holds ``base + (s < extra)`` layers (``base, extra = divmod(L, S)``): the
earlier stages take the extra layers, so the last stage (norm and LM head) is never the biggest.
Under workload ``pp_split: weighted`` the same is done with L + 2 units, the embedding the first and
the head the last, so the end stages hold a layer fewer (`stage_layer_counts`).
MoE models put their ``n_dense_layers`` dense blocks first.

The ranks the cost model looks at: the first (rank 0: embedding, the most micro-batches in flight
under 1F1B), the last (rank pp-1: the LM head and the logits, except under the V placement, where
rank 0 holds both ends), and the busiest (the most MoE blocks, then the most blocks: the rank
whose compute paces the pipeline).
"""
from __future__ import annotations

import functools
import inspect

import numpy as np


from .flops import NONE, layer_matmuls, norm_params, param_counts

RANKS = ("first", "last", "busiest")

# The table columns where the layers go depends on (`schedule` gives the V placement), and those a rank's
# parameter counts add (the TP and EP shards of each block).
LAYOUT_COLUMNS = ("pp", "stages_per_rank", "schedule")
PARAM_COLUMNS = LAYOUT_COLUMNS + ("tp", "ep")


# --------------------------------------------------------------------------- once per distinct layout
def unique_rows(table, columns) -> tuple[np.ndarray, np.ndarray]:
    """(index of one representative per distinct combination of `columns`, inverse map); kept in the table's
    ``memo`` where it has one (the same grouping is asked for by every per-layout term of an estimate)."""
    memo = getattr(table, "memo", None)
    if memo is not None and (hit := memo.get(("unique", tuple(columns)))) is not None:
        return hit
    key = np.zeros(len(table), dtype=np.int64)
    for c in columns:
        v = getattr(table, c).astype(np.int64)
        key = key * (int(v.max(initial=0)) + 1) + v
    n = len(key)
    if n and int(key.max()) < 4 * n:
        # a dense key range (most groupings of a search table): a presence table instead of a sort, the same
        # groups in the same (ascending key) order, each represented by its first row
        present = np.zeros(int(key.max()) + 1, dtype=np.int64)
        present[key] = 1
        inverse = np.cumsum(present)[key] - 1
        first = np.full(int(inverse.max()) + 1, n, dtype=np.int64)
        np.minimum.at(first, inverse, np.arange(n))
        out = first, inverse
    else:
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        out = first, inverse.reshape(-1)
    if memo is not None:
        memo[("unique", tuple(columns))] = out
    return out


def representatives(table, columns):
    """(`table.take` of `unique_rows`' representatives, the inverse map), the sub-table kept in the table's
    ``memo`` so that the terms run on it share its own groupings."""
    rep, inverse = unique_rows(table, columns)
    memo = getattr(table, "memo", None)
    if memo is None:
        return table.take(rep), inverse
    key = ("take", tuple(columns))
    if key not in memo:
        memo[key] = table.take(rep)
    return memo[key], inverse


def broadcast_rows(v, inverse):
    """`v` (an array per representative row, or a dict / tuple of them; scalars pass) at every row of `inverse`."""
    if isinstance(v, dict):
        return {k: broadcast_rows(x, inverse) for k, x in v.items()}
    if isinstance(v, tuple):
        return tuple(broadcast_rows(x, inverse) for x in v)
    a = np.asarray(v)
    return a[inverse] if a.ndim else a


def per_layout(columns):
    """Run the decorated ``fn(table, ...)`` once per distinct combination of `columns` (the only table columns
    it reads) and broadcast its arrays back to every candidate: a search table holds a few hundred pipeline
    layouts among hundreds of thousands of candidates.  The result is kept in the table's ``memo`` under the
    call's arguments (where they hash), read-only: an estimate asks for the same rank's layers from its memory,
    time and data-parallel terms."""
    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def inner(table, *args, **kwargs):
            if not hasattr(table, "take") or len(table) < 2:
                return fn(table, *args, **kwargs)
            bound = sig.bind(table, *args, **kwargs)      # the same call however its arguments are passed
            bound.apply_defaults()
            key = ("call", fn, tuple(bound.arguments.items())[1:])
            try:
                hit = _recall(table.memo, key)
            except TypeError:           # an argument that does not hash: computed each time
                key, hit = None, None
            if hit is not None:
                return hit
            sub, inverse = representatives(table, columns)
            out = fn(table, *args, **kwargs) if len(sub) == len(table) else broadcast_rows(fn(sub, *args, **kwargs),
                                                                                         inverse)
            if key is not None:
                table.memo[key] = _read_only(out)
            return out
        return inner
    return wrap


def take(table, idx):
    """``table.take(idx)`` keeping what `per_layout` terms already computed on `table` (read at `idx`): an
    estimate's step time runs on the candidates whose memory fits, after its memory terms ran on all."""
    idx = np.asarray(idx)
    idx = np.flatnonzero(idx) if idx.dtype == bool else idx
    sub = table.take(idx)
    memo = getattr(table, "memo", None)
    if memo is not None:
        sub.memo["parent"] = (memo, idx)      # read through on a miss (`_recall`)
    return sub


def _recall(memo: dict, key):
    """A kept `per_layout` result for `key` in `memo`, else in the memo of the table it was taken from (read at
    its rows, then kept here too); None when neither has it."""
    hit = memo.get(key)
    if hit is None and "parent" in memo:
        parent, idx = memo["parent"]
        up = _recall(parent, key)
        if up is not None:
            hit = memo[key] = _read_only(broadcast_rows(up, idx))
    return hit


def _read_only(v):
    """`v` (an array, or a dict / tuple of them) made read-only in place: a kept result is shared."""
    if isinstance(v, dict):
        for x in v.values():
            _read_only(x)
    elif isinstance(v, tuple):
        for x in v:
            _read_only(x)
    elif isinstance(v, np.ndarray):
        v.flags.writeable = False
    return v


# --------------------------------------------------------------------------- the split (scalar)
def stage_layer_counts(n_layers: int, n_stages: int, weighted: bool = False) -> list[int]:
    """Layers of each pipeline stage, in stage order.

    ``weighted`` False (workload ``pp_split: layers``): the layers as even as possible, the earlier
    stages larger.  True (``pp_split: weighted``): the embedding and the LM head count as one layer each
    (DeepSpeed's ``partition_method: type:transformer|embedding`` as BLOOM ran it, Megatron-LM's
    ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split``, TorchTitan's
    ``input_weight`` / ``output_weight``; the Llama 3 paper, arXiv:2407.21783 Sec. 3.3.2, removes a layer
    from the first and the last stage): ``n_layers + 2`` units as even as possible, the earlier stages
    larger, stage 0's first unit the embedding and the last stage's last unit the head -- so the end stages
    hold a layer fewer, and one may hold none."""
    w = 1 if weighted and n_stages > 1 else 0
    units = n_layers + 2 * w
    if n_stages > units:
        extra = " (+2 units: the weighted split counts the embedding and the head)" if w else ""
        raise ValueError(f"pipeline needs at least one layer per stage: pp*stages_per_rank = {n_stages} "
                         f"stages but the model has {n_layers} layers{extra} (plan keys 'pp', 'stages_per_rank')")
    base, extra = divmod(units, n_stages)
    counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    if w:
        counts[0] -= 1
        counts[-1] -= 1
    return counts


# --------------------------------------------------------------------------- per rank (vectorized)
def _split(table, n_layers: int, weighted: bool = False):
    """(stages, base units per stage, stages with one more, units offset w): ``n_layers + 2 w`` units over
    the stages, w = 1 under the weighted split with more than one stage."""
    s = (table.pp * table.stages_per_rank).astype(np.int64)
    w = (s > 1).astype(np.int64) if weighted else np.zeros_like(s)
    units = n_layers + 2 * w
    return s, units // s, units % s, w


def _stage_span(s, base, extra, w, stage):
    """(first layer id, layer count) of `stage` (arrays): its units less the embedding's (stage 0) and the
    head's (the last stage) under the weighted split."""
    ustart = stage * base + np.minimum(stage, extra)
    n = base + (stage < extra) - w * (stage == 0) - w * (stage == s - 1)
    lo = ustart - w * (stage > 0)
    return lo, np.maximum(n, 0)


def rank_stages(table, rank) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(stage id, held)] per stage slot k of pipeline rank `rank` (an array or int): loop placement
    ``rank + k pp``, V placement ``rank, 2 pp - 1 - rank``; `held` is False past the rank's v slots."""
    pp, v = table.pp, table.stages_per_rank
    rank = np.broadcast_to(np.asarray(rank, dtype=np.int64), pp.shape)
    out = []
    for k in range(int(v.max()) if len(v) else 1):
        stage = np.where(table.is_v_schedule & (k == 1), 2 * pp - 1 - rank, rank + k * pp)
        out.append((stage, k < v))
    return out


def rank_layers(table, n_layers: int, rank, below: int = 0, weighted: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(layers on pipeline rank `rank`, how many of them have a layer id < `below`).

    The count is closed-form (the planner calls this for every candidate of every rank it compares): the loop
    placement's rank r holds stages r + k pp (k < v), of which ceil((extra - r) / pp) take an extra unit, stage
    0 (rank 0) loses the embedding's unit and stage S - 1 (rank pp - 1) the head's; the V placement's holds
    stages r and 2 pp - 1 - r.  Only a `below` inside the model (a dense prefix of a MoE model) walks the stages."""
    s, base, extra, w = _split(table, n_layers, weighted)
    pp, v = table.pp.astype(np.int64), table.stages_per_rank.astype(np.int64)
    rank = np.broadcast_to(np.asarray(rank, dtype=np.int64), pp.shape)
    with_extra = np.clip(-(-(extra - rank) // np.maximum(pp, 1)), 0, v)
    loop = v * base + with_extra - w * (rank == 0) - w * (rank == pp - 1)
    v_pair = _stage_span(s, base, extra, w, rank)[1] + _stage_span(s, base, extra, w, 2 * pp - 1 - rank)[1]
    total = np.where(table.is_v_schedule & (v == 2), v_pair, loop).astype(np.int64)
    if below <= 0:
        return total, np.zeros(len(table), dtype=np.int64)
    if below >= n_layers:
        return total, total.copy()
    first = np.zeros(len(table), dtype=np.int64)
    for stage, held in rank_stages(table, rank):
        lo, n = _stage_span(s, base, extra, w, stage)
        first += np.where(held, np.clip(below - lo, 0, n), 0)
    return total, first


def _candidate_ranks(table, n_layers: int, weighted: bool) -> list[np.ndarray]:
    """Ranks among which the most loaded one lies.  A stage's units fall with its id (the earlier stages
    take the extra ones); only the end stages lose a layer (weighted split): under the loop placement the
    most layers are on rank 0 or 1; under V, rank r holds stages r and 2 pp - 1 - r, both with an extra unit
    from r = 2 pp - extra on (extra > pp), else rank 1 has the most after rank 0."""
    pp = table.pp.astype(np.int64)
    extra = _split(table, n_layers, weighted)[2]
    top = np.maximum(pp - 1, 0)
    return [np.zeros_like(pp), np.minimum(1, top), top, np.clip(2 * pp - extra, 0, top)]


@per_layout(LAYOUT_COLUMNS)
def busiest_rank_layers(table, n_layers: int, weighted: bool = False) -> np.ndarray:
    """Layers on the most loaded pipeline rank: ``v * base + ceil(extra / pp)`` under every placement of the
    layers-only split (the loop and the V placements both spread the extra layers of the first stages over
    the ranks); the weighted split's end stages hold a layer fewer, so the ranks are compared."""
    if not weighted:
        s, base, extra, _ = _split(table, n_layers)
        return table.stages_per_rank * base + -(-extra // table.pp)
    return np.maximum.reduce([rank_layers(table, n_layers, r, weighted=True)[0]
                              for r in _candidate_ranks(table, n_layers, True)])


@per_layout(LAYOUT_COLUMNS)
def rank_index(table, model, which: str, weighted: bool = False) -> np.ndarray:
    """The pipeline rank `which` ('first', 'last' or 'busiest') of every candidate."""
    pp = table.pp.astype(np.int64)
    if which == "first":
        return np.zeros(len(table), dtype=np.int64)
    if which == "last":
        return pp - 1
    assert which == "busiest", which
    nd = model.n_layers - model.n_moe_layers
    first, second, last, v_pair = _candidate_ranks(table, model.n_layers, weighted)
    if model.n_moe_layers == 0:       # no MoE block anywhere: the rank with the most blocks (`_candidate_ranks`)
        cands = [first, last, second, v_pair]
    else:
        # the first rank whose first stage holds no dense block: it, or the last rank, has the most MoE
        # blocks (stage sizes fall with the stage id; under V the second stage's grow with the rank)
        s, base, extra, w = _split(table, model.n_layers, weighted)
        big = extra * (base + 1)                          # units in the larger stages
        u = nd + w                                        # the unit of the first MoE block
        s_moe = np.where(u <= big, -(-u // (base + 1)), extra + -(-(u - big) // np.maximum(base, 1)))

        def rank_of(stage):       # the loop placement's rank s mod pp; V: stage s >= pp on rank 2 pp - 1 - s
            stage = np.clip(stage, 0, s - 1)
            return np.where(table.is_v_schedule & (stage >= pp), 2 * pp - 1 - stage, stage % np.maximum(pp, 1))
        # and the ranks of the stages around the dense/MoE boundary (the stage holding the last dense block and
        # the next), whose MoE blocks tie with the others' when the dense prefix spans several rounds of stages
        cands = [first, np.minimum(s_moe, pp - 1), last, second, v_pair, rank_of(s_moe - 1), rank_of(s_moe)]
    best, key = cands[0], None
    for r in cands:
        tot, dense = rank_layers(table, model.n_layers, r, nd, weighted)
        k = (tot - dense) * (model.n_layers + 1) + tot      # most MoE blocks, then most blocks
        if key is None:
            key = k
        else:
            best, key = np.where(k > key, r, best), np.maximum(k, key)
    return best


@per_layout(LAYOUT_COLUMNS)
def layer_mix(table, model, first: bool = False, *, which: str | None = None,
              weighted: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(dense, moe) block counts on the first pipeline rank (`first`) or on the busiest one, or on
    the rank named by `which` ('first', 'last', 'busiest'); `weighted`: workload ``pp_split: weighted``."""
    which = which or ("first" if first else "busiest")
    nd = model.n_layers - model.n_moe_layers
    tot, dense = rank_layers(table, model.n_layers, rank_index(table, model, which, weighted), nd, weighted)
    return dense, tot - dense


def layers_per_rank(table, model, weighted: bool = False) -> np.ndarray:
    """The layers of the most loaded pipeline rank."""
    return busiest_rank_layers(table, model.n_layers, weighted)


@per_layout(LAYOUT_COLUMNS)
def holds_ends(table, model, which: str, weighted: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(holds the embedding, holds the final norm and LM head): the ranks of stage 0 and stage S-1."""
    r = rank_index(table, model, which, weighted)
    last_stage = table.pp * table.stages_per_rank - 1
    emb = np.zeros(len(table), bool)
    head = np.zeros(len(table), bool)
    for stage, held in rank_stages(table, r):
        emb |= held & (stage == 0)
        head |= held & (stage == last_stage)
    return emb, head


# --------------------------------------------------------------------------- micro-batches in flight
def in_flight_on_rank(table, rank) -> np.ndarray:
    """Micro-batches whose activations (for all of the rank's layers) are alive at the peak of
    pipeline rank `rank`.

    * no pipeline: 1 (each micro-batch's backward ends before the next forward);
    * GPipe: all n_microbatches (Huang et al. 2019, arXiv:1811.06965);
    * 1F1B: pp - r warm-up forwards (Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2.1;
      Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.3): pp on the first rank, 1 on the last;
    * Interleaved1F1B with v stages per rank: torch's ScheduleInterleaved1F1B (the "flexible"
      schedule of the Llama 3 paper, arXiv:2407.21783, Sec. 3.3.2 and Fig. 6: N contiguous
      micro-batches per stage) runs the micro-batches in rounds of N = n // max(1, n // pp) and
      (v-1) N + 2 (pp-1-r) warm-up chunks (torch's ``_get_warmup_ops``), so (v-1) N + 2 (pp-1-r) + 1
      chunks = that / v rank-micro-batches are alive.  With n a multiple of pp (N = pp, the
      depth-first schedule): pp (1 + (pp-1)/(pp v)) on the first rank (Korthikanti Sec. 4.2.3, after
      Narayanan Sec. 2.2.2), ((v-1) pp + 1)/v on the last; any other n has N > pp (e.g. pp 4,
      n 6: N 6) and more chunks in flight;
    * ZBVZeroBubble: pp -- ZB-V keeps 1F1B's peak (Qi et al. 2024, arXiv:2401.10241, Sec. 6);
    * DualPipeV: pp + 1/2 in torch's DualPipeV (the actions of each rank in torch 2.14's
      ``pipeline_order``, replayed by ``titan-run --dry-run --memory``: at most 2.5 rank-micro-batches
      in flight at pp 2 and 4.5 at pp 4 -- half a rank's layers less than the pp + 1 of the
      DeepSeek-V3 report, arXiv:2412.19437, Table 2, "Activation").
    None exceeds n_microbatches.
    """
    pp = table.pp.astype(np.float64)
    v = table.stages_per_rank.astype(np.float64)
    nmb = table.n_microbatches.astype(np.float64)
    r = np.broadcast_to(np.asarray(rank, dtype=np.float64), pp.shape)
    out = np.ones(len(table))
    g = table.is_schedule("GPipe")
    out[g] = nmb[g]
    o = table.is_schedule("1F1B")
    out[o] = pp[o] - r[o]
    i = table.is_schedule("Interleaved1F1B")
    n_round = interleaved_round_size(table)
    out[i] = ((v[i] - 1) * n_round[i] + 2 * (pp[i] - 1 - r[i]) + 1) / v[i]
    z = table.is_schedule("ZBVZeroBubble")
    out[z] = pp[z]
    d = table.is_schedule("DualPipeV")
    out[d] = pp[d] + 0.5
    out = np.minimum(out, nmb)
    out[table.pp == 1] = 1.0
    return out


@per_layout(LAYOUT_COLUMNS + ("n_microbatches",))
def rank_in_flight(table, model, which: str, weighted: bool = False) -> np.ndarray:
    """`in_flight_on_rank` of rank `which` (`rank_index`), once per pipeline layout and micro-batch count."""
    return in_flight_on_rank(table, rank_index(table, model, which, weighted))


def interleaved_round_size(table) -> np.ndarray:
    """N, the contiguous micro-batches each stage runs per round under Interleaved1F1B: torch's
    ``microbatches_per_round`` = n // max(1, n // pp) (n a multiple of the rounds,
    search_spaces.constraints); pp when n is a multiple of pp."""
    nmb = table.n_microbatches.astype(np.int64)
    return (nmb // np.maximum(1, nmb // np.maximum(table.pp.astype(np.int64), 1))).astype(np.float64)


def in_flight_microbatches(table) -> tuple[np.ndarray, np.ndarray]:
    """`in_flight_on_rank` of the first and of the last pipeline rank."""
    return in_flight_on_rank(table, 0), in_flight_on_rank(table, table.pp - 1)


def v_schedule(table) -> np.ndarray:
    return table.is_v_schedule


# --------------------------------------------------------------------------- parameters per rank
@per_layout(PARAM_COLUMNS)
def rank_params(table, model, weighted: bool = False, experts_tp_split: bool = True,
                moe_ffn_tp_split: bool = True) -> dict[str, np.ndarray]:
    """Local (TP/EP-sharded, not yet FSDP-sharded) parameter counts of the first, last and busiest
    pipeline ranks (keys ``{rank}_dense``, ``{rank}_expert``, ``{rank}_unit``: the largest FSDP unit,
    ``{rank}_tensor``: the largest parameter tensor,
    ``{rank}_has_head``, ``{rank}_has_emb``), and of one block (``dense_block``, ``moe_dense_block``,
    ``moe_expert_block``; ``moe_ffn_block``: a MoE block's router and shared experts).  `experts_tp_split` False
    (workload ``expert_tp``): the routed experts are whole on every TP rank; `moe_ffn_tp_split` False: so are a MoE
    block's router and shared experts (titan-run)."""
    pc = param_counts(model)
    tp = table.tp.astype(np.float64)

    def sharded(mms, moe_local=1.0):
        tot = 0.0 * tp
        for m in mms:
            tot = tot + m.params * (moe_local if m.expert else 1.0) / (1.0 if m.shard == NONE else tp)
        return tot

    local_experts = model.n_experts / table.ep if model.is_moe else 0.0
    dense_block = sharded(layer_matmuls(model, False)) + norm_params(model)
    if model.is_moe:
        mm = layer_matmuls(model, True)
        ffn_whole = lambda m: m.group == "ffn" and not moe_ffn_tp_split    # noqa: E731 (replicated over TP)
        moe_dense = (sharded([m for m in mm if not m.expert and not ffn_whole(m)])
                     + sum(m.params for m in mm if not m.expert and ffn_whole(m)) + norm_params(model))
        # the MoE layer's own non-expert weights (router, shared experts), as this rank holds them
        moe_ffn = (sharded([m for m in mm if not m.expert and m.group == "ffn" and not ffn_whole(m)])
                   + sum(m.params for m in mm if not m.expert and ffn_whole(m)))
        moe_expert = sharded([m for m in mm if m.expert], local_experts) * (1.0 if experts_tp_split else tp)
    else:
        moe_dense = moe_expert = moe_ffn = 0.0 * tp
    emb, head = pc["embedding"] / tp, (pc["lm_head"] / tp) + pc["final_norm"]

    def largest(mms, moe_local=1.0):
        big = 0.0 * tp
        for m in mms:
            per = m.params / (1.0 if m.shard == NONE else tp)
            big = np.maximum(big, per / model.n_experts if m.expert else per)   # one expert's weight
        return big

    dense_tensor = largest(layer_matmuls(model, False))
    moe_tensor = largest(layer_matmuls(model, True)) if model.is_moe else 0.0 * tp
    # the multi-token-prediction modules (ModelSpec.mtp_layers) on the rank holding the head: blocks of the last
    # layer's kind (`mtp_blocks`), each with its column-parallel [2h -> h] projection and three norms, reading
    # the token embedding, of which that rank keeps a copy where the embedding is elsewhere (Megatron-core's
    # MTP on the last pipeline stage; the copies' gradients are all-reduced as a tied embedding's)
    m_dense, m_moe = mtp_blocks(model)
    mtp_extra = model.mtp_layers * (2.0 * model.dim * model.dim / tp + 3 * pc["final_norm"])
    out = {}
    for which in RANKS:
        nd, nm = layer_mix(table, model, which=which, weighted=weighted)
        has_emb, has_head = holds_ends(table, model, which, weighted)
        nd, nm = nd + has_head * m_dense, nm + has_head * m_moe
        if model.tie_embeddings:
            # a tied LM head on another rank than the embedding is a second copy of the weight, with its
            # own gradient and optimizer state (Megatron-LM's word embeddings on the last stage,
            # DeepSpeed's TiedLayerSpec owners), kept equal by a per-step all-reduce
            # (step_time.tied_embedding_sync)
            head = np.where(has_head & ~has_emb, emb, 0.0) + pc["final_norm"]
        mtp_emb = np.where(has_head & ~has_emb & (model.mtp_layers > 0) & (not model.tie_embeddings), emb, 0.0)
        dense = (nd * dense_block + nm * moe_dense + np.where(has_emb, emb, 0.0) + np.where(has_head, head, 0.0)
                 + np.where(has_head, mtp_extra, 0.0) + mtp_emb)
        out[f"{which}_dense"] = dense
        out[f"{which}_expert"] = nm * moe_expert
        # the largest block (a transformer layer's FSDP unit) and the largest unit with the end stages' embedding
        # and head: a pipeline's backward re-gathers blocks, the embedding only after the blocks' backward
        out[f"{which}_block_unit"] = np.maximum(dense_block * (nd > 0), moe_dense + moe_expert * (nm > 0))
        out[f"{which}_unit"] = np.maximum.reduce([out[f"{which}_block_unit"],
                                                  np.where(has_emb, emb, 0.0), np.where(has_head, head, 0.0)])
        # the largest single parameter tensor of the rank (a per-tensor temporary is this big at most)
        out[f"{which}_tensor"] = np.maximum.reduce([dense_tensor * (nd > 0), moe_tensor * (nm > 0),
                                                    np.where(has_emb, emb, 0.0), mtp_emb,
                                                    np.where(has_head, head - pc["final_norm"], 0.0)])
        out[f"{which}_has_head"] = has_head
        out[f"{which}_has_emb"] = has_emb
        out[f"{which}_layers"] = (nd, nm)
    out["dense_block"], out["moe_dense_block"], out["moe_expert_block"] = dense_block, moe_dense, moe_expert
    out["moe_ffn_block"] = moe_ffn + 0.0 * tp
    return out


def mtp_blocks(model) -> tuple[int, int]:
    """(dense, MoE) blocks of the model's multi-token-prediction modules (`ModelSpec.mtp_layers`): each is a block
    of the last layer's kind, on the pipeline rank holding the LM head."""
    moe_last = model.n_moe_layers > 0
    return model.mtp_layers * (not moe_last), model.mtp_layers * moe_last


def expert_shard_fraction(table, model) -> np.ndarray:
    """The fraction of a rank's local experts that one expert-FSDP rank stores.

    FSDP2 shards a parameter along dim 0 in equal chunks of ceil(rows / ranks), padding the last
    ones; an expert weight's dim 0 is the ep-local expert count, so each of the dp_shard*cp/ep
    expert-FSDP ranks keeps ceil(E_local / efsdp) experts: with fewer local experts than ranks
    (mixtral-8x7b at ep 8, efsdp 4: 1 expert) every rank keeps them all (the dry run's exact bytes).
    """
    if not model.is_moe:
        return np.zeros(len(table))
    local = model.n_experts // table.ep
    efsdp = np.maximum(table.fsdp_size // table.ep, 1)
    return -(-local // efsdp) / local
