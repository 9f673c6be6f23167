"""Plan, search spaces and the vectorized enumerator (property tests against brute force)."""
from __future__ import annotations

import dataclasses

import itertools
import types

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy as np

from search_spaces import (AC_MODES, SCHEDULES, Plan, PlanError, SpaceError, Target, check_plan,
                           enumerate_plans, load_space, space_names)
from search_spaces import constraints as C
from search_spaces.plan import BACKENDS, MESH_AXES
from search_spaces.enumerate import schedule_options
from search_spaces.planfile import read_plan_file, write_plan_file
from search_spaces.space import divisors, space_from_dict
from search_spaces.table import CandidateTable


def test_plan_yaml_round_trip(tmp_path):
    p = Plan(dp_replicate=2, dp_shard=4, pp=2, tp=2, cp=2, ep=4, microbatch=2, n_microbatches=4,
             schedule="Interleaved1F1B", stages_per_rank=2, ac="selective", reshard_after_forward=False,
             compile=True, float8=True, backend="dtensor")
    assert Plan.from_dict(yaml.safe_load(yaml.safe_dump(p.to_dict()))) == p
    write_plan_file(tmp_path / "plan.yaml", {"model": "llama3-debug", "plan": p, "workload": {"seq_len": 64}})
    back = read_plan_file(tmp_path / "plan.yaml")
    assert back["plan"] == p and back["model"] == "llama3-debug"
    assert p.world_size == 2 * 4 * 2 * 2 * 2 and p.global_batch() == 8 * 2 * 4


@pytest.mark.parametrize("bad, needle", [
    ({"tp": 0}, "'tp' must be a positive integer"),
    ({"tp": "2"}, "'tp' must be a positive integer"),
    ({"schedule": "1f1b"}, "'schedule' must be one of GPipe, 1F1B"),
    ({"ac": "some"}, "'ac' must be one of none, selective, full"),
    ({"backend": "jax"}, "'backend' must be one of spmd_types, dtensor"),
    ({"compile": "yes"}, "'compile' must be true or false"),
    ({"ep": 3, "dp_shard": 2}, "'ep' (3) must divide dp_shard*cp"),
    ({"schedule": "ZBVZeroBubble", "stages_per_rank": 1, "pp": 2, "n_microbatches": 2}, "must be 2"),
    ({"pp": 4, "n_microbatches": 2}, "too small for schedule 1F1B"),
    ({"tpp": 2}, "unknown key 'tpp'"),
])
def test_plan_validation_names_the_key(bad, needle):
    with pytest.raises(PlanError) as e:
        Plan.from_dict(bad)
    assert needle in str(e.value)


def test_check_world():
    with pytest.raises(PlanError, match="world size is 16"):
        Plan(dp_shard=4, tp=2).check_world(16)


def test_space_files_load():
    assert {"dense", "moe", "long_context"} <= set(space_names())
    for n in space_names():
        s = load_space(n)
        assert s.knobs["schedule"] and s.knobs["ac"]


@pytest.mark.parametrize("doc, needle", [
    ({"degrees": {"dp_shard": "all"}}, "unknown degree 'degrees.dp_shard'"),
    ({"degrees": {"tp": [0, 2]}}, "'degrees.tp' must be 'all' or a list"),
    ({"knobs": {"ac": ["none", "most"]}}, "'knobs.ac' value 'most'"),
    ({"knobs": {"microbatch": []}}, "'knobs.microbatch' must be a non-empty list"),
    ({"knob": {}}, "unknown key 'knob'"),
])
def test_space_errors(doc, needle):
    with pytest.raises(SpaceError) as e:
        space_from_dict(doc)
    assert needle in str(e.value)


def test_unknown_space_lists_known():
    with pytest.raises(SpaceError, match="known: dense"):
        load_space("densest")


# ---------------------------------------------------------------------------- property tests
def _model(n_layers, n_heads, kv_div, ffn, n_experts=0):
    return types.SimpleNamespace(n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads // kv_div,
                                 ffn_hidden=ffn, moe_ffn_hidden=ffn // 2 if n_experts else 0, n_experts=n_experts)


def brute_force(space, t: Target) -> set[tuple]:
    """Every tuple of values, filtered by `check_plan` (the one-plan reference rules)."""
    W = t.world_size
    out = set()
    ax = {a: space.degree_values(a, W) for a in ("dp_replicate", "pp", "tp", "cp", "ep")}
    for dpr, dps, pp, tp, cp, ep in itertools.product(ax["dp_replicate"], divisors(W), ax["pp"], ax["tp"],
                                                      ax["cp"], ax["ep"]):
        if dpr * dps * pp * tp * cp != W:
            continue
        for mb in space.knobs["microbatch"]:
            if t.global_batch % (dpr * dps * mb):
                continue
            nmb = t.global_batch // (dpr * dps * mb)
            scheds = [("1F1B", 1)] if pp == 1 else [(SCHEDULES[s], v) for s, v in schedule_options(space)]
            for (sched, v), ac, rs, co, f8, be in itertools.product(
                    scheds, space.knobs["ac"], space.knobs["reshard_after_forward"], space.knobs["compile"],
                    space.knobs["float8"], space.knobs["backend"]):
                try:   # runnable=False: the micro-batch rules are left to check_plan, which must apply them
                    p = Plan(dp_replicate=dpr, dp_shard=dps, pp=pp, tp=tp, cp=cp, ep=ep, microbatch=mb,
                             n_microbatches=nmb, schedule=sched, stages_per_rank=v, ac=ac,
                             reshard_after_forward=rs, compile=co, float8=f8, backend=be, runnable=False)
                except PlanError:
                    continue
                if not check_plan(p, t, tp_within_node=space.tp_within_node):
                    out.add(tuple(sorted(p.to_dict().items())))
    return out


spaces = st.fixed_dictionaries({
    "degrees": st.fixed_dictionaries({
        "tp": st.sampled_from(["all", [1, 2], [1, 2, 4]]),
        "pp": st.sampled_from(["all", [1, 2]]),
        "cp": st.sampled_from(["all", [1], [1, 2]]),
        "ep": st.sampled_from(["all", [1], [1, 2, 4]]),
        "dp_replicate": st.sampled_from(["all", [1]]),
    }),
    "tp_within_node": st.booleans(),
    "knobs": st.fixed_dictionaries({
        "microbatch": st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=2, unique=True),
        "schedule": st.lists(st.sampled_from(list(SCHEDULES)), min_size=1, max_size=3, unique=True),
        "stages_per_rank": st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=2, unique=True),
        "ac": st.lists(st.sampled_from(list(AC_MODES)), min_size=1, max_size=2, unique=True),
        "reshard_after_forward": st.sampled_from([[True], [True, False]]),
        "float8": st.sampled_from([[False], [False, True]]),
    }),
})


@settings(max_examples=60, deadline=None)
@given(space_doc=spaces, world=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]),
       n_layers=st.sampled_from([1, 2, 3, 4, 6]), n_heads=st.sampled_from([2, 4, 6, 8]),
       kv_div=st.sampled_from([1, 2]), ffn=st.sampled_from([12, 16, 24]), moe=st.booleans(),
       seq_len=st.sampled_from([6, 8, 16, 24]), gb=st.sampled_from([1, 2, 4, 8, 12, 16]),
       gpn=st.sampled_from([2, 4, 8]), f8=st.booleans())
def test_enumeration_equals_brute_force(space_doc, world, n_layers, n_heads, kv_div, ffn, moe, seq_len, gb,
                                        gpn, f8):
    space = space_from_dict(space_doc)
    m = _model(n_layers, n_heads, kv_div, ffn, n_experts=4 if moe else 0)
    t = Target.of(m, world_size=world, seq_len=seq_len, global_batch=gb, gpus_per_node=gpn, float8_supported=f8)
    en = enumerate_plans(space, t)
    got = [tuple(sorted(p.to_dict().items())) for p in en.table.plans()]
    assert len(got) == len(set(got)), "duplicate candidates"
    assert set(got) == brute_force(space, t)
    # and every enumerated candidate satisfies every constraint
    for p in en.table.plans():
        assert check_plan(p, t, tp_within_node=space.tp_within_node) == []


def test_table_round_trip():
    plans = [Plan(dp_shard=2, tp=2), Plan(pp=2, n_microbatches=4, schedule="DualPipeV", stages_per_rank=2,
                                          ac="full", float8=True)]
    t = CandidateTable.from_plans(plans)
    assert t.plans() == plans and len(t) == 2
    assert list(t.world_size) == [4, 2]


def test_big_enumeration_counts_rejections():
    m = types.SimpleNamespace(n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248, moe_ffn_hidden=0,
                              n_experts=0)
    t = Target.of(m, world_size=16384, seq_len=8192, global_batch=512, gpus_per_node=8)
    en = enumerate_plans(load_space("dense"), t)
    assert len(en.table) > 1000
    reasons = en.rejected_total()
    assert reasons and all(v > 0 for v in reasons.values())
    assert (en.table.world_size == 16384).all()
    assert (en.table.tp <= 8).all()


# ---------------------------------------------------------------------------- one rule, two forms
def _random_plans(rng, n: int) -> list[Plan]:
    out = []
    while len(out) < n:
        d = {k: int(rng.choice([1, 2, 3, 4, 8])) for k in ("dp_replicate", "dp_shard", "pp", "tp", "cp", "ep")}
        d.update(microbatch=int(rng.choice([1, 2, 3])), n_microbatches=int(rng.integers(1, 20)),
                 schedule=str(rng.choice(SCHEDULES)), stages_per_rank=int(rng.choice([1, 2, 3])),
                 ac=str(rng.choice(AC_MODES)), float8=bool(rng.integers(2)), backend=str(rng.choice(BACKENDS)))
        try:
            out.append(Plan(**d, runnable=False))
        except PlanError:
            pass
    return out


def test_each_rule_is_the_same_on_one_plan_and_on_columns():
    """The enumerator applies the predicates of constraints.py to columns: they agree with one plan."""
    rng = np.random.default_rng(0)
    plans = _random_plans(rng, 400)
    table = CandidateTable.from_plans(plans)
    for _ in range(20):
        m = _model(int(rng.choice([2, 3, 8, 12])), int(rng.choice([4, 6, 8, 16])), int(rng.choice([1, 2])),
                   int(rng.choice([12, 16, 48])), n_experts=int(rng.choice([0, 4, 6])))
        t = Target.of(m, world_size=int(rng.choice([8, 16, 64])), seq_len=int(rng.choice([6, 16, 48])),
                      global_batch=int(rng.choice([4, 8, 96])), gpus_per_node=int(rng.choice([2, 8])),
                      float8_supported=bool(rng.integers(2)))
        t = dataclasses.replace(t, tie_embeddings=bool(rng.integers(2)))
        for rule in C.CHECK_ORDER:
            col = np.broadcast_to(rule.ok(table, t), (len(plans),))
            one = [bool(rule.ok(p, t)) for p in plans]
            assert col.tolist() == one, rule.reason
        # and check_plan is exactly the rules that fail
        for p in plans[:50]:
            assert [r for r, _ in check_plan(p, t)] == [r.reason for r in C.CHECK_ORDER if not r.ok(p, t)]


def test_micro_batch_rules_reach_check_plan():
    """A what-if plan (runnable=False) exists; check_plan names the rule titan-run needs."""
    t = Target.of(_model(24, 8, 1, 16), world_size=12, seq_len=16, global_batch=2, gpus_per_node=8)
    p = Plan(pp=12, n_microbatches=2, runnable=False)
    assert check_plan(p, t) == [(C.R_MICRO, "plan key 'n_microbatches' (2) is too small for schedule 1F1B "
                                            "with pp=12: needs at least 12")]
    assert check_plan(p, t, runnable=False) == []
    with pytest.raises(PlanError, match="too small for schedule 1F1B"):
        Plan(pp=12, n_microbatches=2)
    with pytest.raises(PlanError, match="must be a multiple of"):
        Plan(pp=2, n_microbatches=5, schedule="Interleaved1F1B", stages_per_rank=2)


def test_derived_facts_of_a_plan_and_of_a_table_agree():
    plans = _random_plans(np.random.default_rng(1), 200)
    table = CandidateTable.from_plans(plans)
    for name in ("world_size", "dp", "dp_cp", "fsdp_size", "expert_fsdp_size", "n_stages", "seq_divisor",
                 "is_v_schedule", "is_multi_stage"):
        assert getattr(table, name).tolist() == [getattr(p, name) for p in plans], name
    assert table.global_batch().tolist() == [p.global_batch() for p in plans]
    p = Plan(dp_replicate=2, dp_shard=4, cp=2, tp=4, ep=4)
    assert (p.fsdp_size, p.dp_cp, p.expert_fsdp_size, p.seq_divisor) == (8, 16, 2, 16)
    assert Plan(tp=4).seq_divisor == 4
    assert Plan(pp=2, n_microbatches=4, schedule="DualPipeV", stages_per_rank=2).is_v_schedule
    assert MESH_AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def test_plan_complete():
    # dp_shard takes what remains; micro-batch 1 and the count from the global batch (estimate, trials)
    p = Plan.complete({"tp": 8, "pp": 16, "schedule": "Interleaved1F1B"}, world_size=16384, global_batch=2048)
    assert (p.dp_shard, p.stages_per_rank, p.microbatch, p.n_microbatches) == (128, 2, 1, 16)
    # titan-run's default layout: the fewest micro-batches the schedule accepts, the micro-batch derived
    p = Plan.complete({"tp": 2}, world_size=4, global_batch=8, fewest_microbatches=True)
    assert (p.dp_shard, p.microbatch, p.n_microbatches) == (2, 4, 1)
    p = Plan.complete({"pp": 2, "schedule": "DualPipeV"}, world_size=4, global_batch=16, fewest_microbatches=True)
    assert (p.dp_shard, p.stages_per_rank, p.n_microbatches, p.microbatch) == (2, 2, 4, 2)
    # given n_microbatches: the micro-batch follows
    assert Plan.complete({"n_microbatches": 4}, world_size=2, global_batch=16).microbatch == 2
    # without a global batch nothing is derived
    assert Plan.complete({}, world_size=2).to_dict() == Plan(dp_shard=2).to_dict()
    # what-if: titan-run's micro-batch rules only with runnable (the default)
    with pytest.raises(PlanError, match="too small"):
        Plan.complete({"pp": 4}, world_size=4, global_batch=2)
    assert Plan.complete({"pp": 4}, world_size=4, global_batch=2, runnable=False).n_microbatches == 2
    for partial, kw, needle in [
        ({"tp": 3}, {"world_size": 8}, "dp_replicate*pp*tp*cp = 1*1*3*1 = 3 do not divide the world size 8"),
        ({"microbatch": 3}, {"world_size": 2, "global_batch": 8},
         "global batch 8 sequences is not divisible by dp*microbatch = 2*3"),
        ({"n_microbatches": 3}, {"world_size": 2, "global_batch": 8},
         "global batch 8 sequences is not divisible by dp*n_microbatches = 2*3"),
        ({"tp": "2"}, {"world_size": 8}, "plan key 'tp' must be a positive integer"),
        ({"tpp": 2}, {"world_size": 8}, "unknown key 'tpp'"),
        ({"schedule": "1f1b"}, {"world_size": 8}, "'schedule' must be one of"),
    ]:
        with pytest.raises(PlanError) as e:
            Plan.complete(partial, **kw)
        assert needle in str(e.value)


def test_one_printer():
    p = Plan(dp_replicate=2, dp_shard=4, pp=2, tp=2, microbatch=2, n_microbatches=4, schedule="Interleaved1F1B",
             stages_per_rank=2, ac="full", reshard_after_forward=False, compile=True)
    assert p.describe() == "rep2·fsdp4·pp2·tp2 mb2x4 Interleaved1F1B/v2 ac:full noreshard compile"


def test_tied_embeddings_are_searched_on_every_axis():
    """titan-run keeps tied embeddings tied on every axis (under tp the embedding and the head shard the same
    vocabulary rows; over pipeline stages the last holds a copy whose gradient is summed with the embedding's):
    the search proposes tp > 1 and pp > 1 for a tied model too."""
    m = _model(8, 8, 1, 16)
    m.tie_embeddings = True
    t = Target.of(m, world_size=8, seq_len=16, global_batch=16, gpus_per_node=8)
    assert t.tie_embeddings
    table = enumerate_plans(load_space("dense"), t).table
    assert (np.asarray(table.tp) > 1).any() and (np.asarray(table.pp) > 1).any()
    assert check_plan(Plan(dp_shard=4, tp=2, microbatch=4), t) == []
    assert check_plan(Plan(dp_shard=4, pp=2, microbatch=2, n_microbatches=2), t) == []


def test_titan_run_limits_are_what_a_what_if_may_break():
    """check_plan(runnable=False) leaves out titan-run's own limits (constraints.TITAN_RUN_LIMITS) and
    titan_run_limits names them: more virtual stages than layers is a limit of titan-run's split; a pipeline
    rank with no layer at all is illegal for everyone; too few micro-batches is the pipeline runtime's."""
    m = _model(4, 4, 1, 16)                              # 4 layers
    t = Target.of(m, world_size=2, seq_len=64, global_batch=8, gpus_per_node=8)
    v3 = Plan(pp=2, microbatch=1, n_microbatches=8, schedule="Interleaved1F1B", stages_per_rank=3)
    assert check_plan(v3, t, runnable=False) == []
    assert C.titan_run_limits(v3, t) == [("layout", "pp*stages_per_rank = 6 > 4 layers")]
    assert [r for r, _ in check_plan(v3, t)] == [C.R_PP_LAYERS]
    few = Plan(pp=2, microbatch=8, n_microbatches=1, schedule="1F1B", runnable=False)
    assert check_plan(few, t, runnable=False) == [] and [k for k, _ in C.titan_run_limits(few, t)] == ["schedule"]
    t8 = Target.of(m, world_size=8, seq_len=64, global_batch=8, gpus_per_node=8)
    pp8 = Plan(pp=8, microbatch=1, n_microbatches=8, schedule="1F1B")
    assert [r for r, _ in check_plan(pp8, t8, runnable=False)] == [C.R_PP_RANKS]


def test_split_backward_schedules_refuse_selective_checkpointing():
    """ZBVZeroBubble and DualPipeV run input and weight gradients as two autograd passes; titan-run refuses
    selective checkpointing there in one line (a what-if keeps it, check_plan names the rule), the search
    never proposes it, and full checkpointing stays."""
    kw = dict(pp=2, n_microbatches=4, stages_per_rank=2)
    for sched in ("ZBVZeroBubble", "DualPipeV"):
        with pytest.raises(PlanError, match=f"schedule {sched} with ac 'selective'.*use ac 'full' or 'none'"):
            Plan(schedule=sched, ac="selective", **kw)
        Plan(schedule=sched, ac="full", **kw)
        p = Plan(schedule=sched, ac="selective", runnable=False, **kw)
        t = Target.of(_model(8, 8, 1, 16), world_size=2, seq_len=16, global_batch=4, gpus_per_node=8)
        assert [r for r, _ in check_plan(p, t)] == [C.R_SPLIT_AC] and check_plan(p, t, runnable=False) == []
        assert C.titan_run_limits(p, t)[0][0] == "schedule"
    Plan(pp=2, n_microbatches=4, schedule="Interleaved1F1B", stages_per_rank=2, ac="selective")   # one pass: fine
    space = space_from_dict({"degrees": {"pp": [2]}, "knobs": {"schedule": ["DualPipeV", "1F1B"],
                                                              "ac": ["selective", "full"]}})
    t = Target.of(_model(8, 8, 1, 16), world_size=2, seq_len=16, global_batch=8, gpus_per_node=8)
    en = enumerate_plans(space, t)
    combos = {(p.schedule, p.ac) for p in en.table.plans()}
    assert ("DualPipeV", "selective") not in combos and {("DualPipeV", "full"), ("1F1B", "selective")} <= combos
    assert en.rejected_total()[C.R_SPLIT_AC] > 0


def test_torchs_selective_checkpoint_allows_one_recompute():
    """Why the rule exists (and a sign to lift it if torch changes): two autograd passes over a region under
    torch's selective activation checkpoint -- input gradients, then weight gradients, as the V schedules'
    split backward runs them -- fail on the second; full checkpointing recomputes the region again."""
    import functools
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    lin = torch.nn.Linear(8, 8)
    calls = [0]

    def block(x):
        calls[0] += 1
        return torch.relu(lin(x)) * 2

    policy = functools.partial(create_selective_checkpoint_contexts,
                               lambda ctx, op, *a, **k: (CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default
                                                         else CheckpointPolicy.PREFER_RECOMPUTE))
    x = torch.randn(4, 8, requires_grad=True)
    loss = checkpoint(block, x, use_reentrant=False, context_fn=policy).sum()
    torch.autograd.grad(loss, [x], retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        torch.autograd.grad(loss, [lin.weight])
    calls[0] = 0
    loss = checkpoint(block, x, use_reentrant=False).sum()
    torch.autograd.grad(loss, [x], retain_graph=True)
    torch.autograd.grad(loss, [lin.weight])
    assert calls[0] == 3            # the forward, then one recompute per pass


def test_the_default_long_context_search_reaches_what_the_published_run_ran():
    """NeMo's Llama 2 7B at 1M tokens on 1,024 H100 trained without recompute: the long-context space titan-plan
    takes by default must offer that, so its pick is predicted at least as fast as the published layout (with
    recompute always on it was 0.78x of it; the 128K row, 0.81x, fails the same way).  The search is the pick
    bench's (`bench/bench_pick_vs_published.py` `pick`: the default space, compile and float8 held at the run's)."""
    row_id = "nemo_longseq_24.03_H100_LLAMA2-7B_seq1024k_1024gpu"
    from cost_models.coefficients import Coefficients
    from cost_models.estimate import estimate
    from planner.plan_command import default_space
    from search_spaces.table import CandidateTable
    from tests.cost_model_helpers import load_bench
    vr, bench = load_bench("validate_reference"), load_bench("bench_pick_vs_published")
    case = vr.build_case(next(r for r in vr.load_extra_rows() if r["id"] == row_id))
    assert case.plan.ac == "none" and default_space(case.model, case.workload) == "long_context"
    published = float(estimate(CandidateTable.from_plans([case.plan]), case.model, case.hw, case.workload,
                               Coefficients()).step_time_s[0])
    _, step, _ = bench.pick(case, "time")
    assert step <= published * (1 + 1e-9)
