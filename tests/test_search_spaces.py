"""Plan, search spaces and the vectorized enumerator (property tests against brute force)."""
from __future__ import annotations

import itertools
import types

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from search_spaces import (AC_MODES, SCHEDULES, Plan, PlanError, SpaceError, Target, check_plan,
                           enumerate_plans, load_space, space_names)
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
                try:
                    p = Plan(dp_replicate=dpr, dp_shard=dps, pp=pp, tp=tp, cp=cp, ep=ep, microbatch=mb,
                             n_microbatches=nmb, schedule=sched, stages_per_rank=v, ac=ac,
                             reshard_after_forward=rs, compile=co, float8=f8, backend=be)
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
