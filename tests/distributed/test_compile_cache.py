"""Compiled blocks with a warm inductor cache: the cache is keyed by the process groups a graph's names mean.

A compiled graph names the groups of its collectives by their registered names (a creation counter), and
torch's AOTAutograd cache key replaces the opaque mesh / group inputs by ordinals: under CP 2 x TP 2 on
dtensor the two tp groups (ranks 0-1, 2-3) wrote one cache entry, and the second run in the same
TORCHINDUCTOR_CACHE_DIR gave half the ranks the other group's name ("Could not resolve the process group
registered under the name 16").  ``parallel/compile.py`` puts a digest of this process's groups (name and
ranks) into ``torch.compiler.config.cache_key_tag``.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from executor.parallel.compile import GROUP_TAG_PREFIX, group_layout_tag, key_compile_caches_by_groups
from search_spaces.plan import Plan
from tests.distributed.harness import assert_close_per_step, run_titan


def _tag_of(rank: int, shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    """The group tag of `rank` in a fresh fake world holding one mesh of `shape`."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        init_device_mesh("cpu", shape, mesh_dim_names=names)
        return group_layout_tag()
    finally:
        dist.destroy_process_group()


def test_group_tag_tells_apart_ranks_whose_groups_differ_and_is_stable_across_runs():
    cp_tp = [_tag_of(r, (2, 2), ("cp", "tp")) for r in range(4)]
    assert all(t.startswith(GROUP_TAG_PREFIX) for t in cp_tp)
    assert len(set(cp_tp)) == 4                 # every rank's (cp group, tp group) pair is its own
    assert _tag_of(2, (2, 2), ("cp", "tp")) == cp_tp[2]        # the next run, same layout: the same key
    # another layout whose groups carry the same names but other ranks: another key
    assert _tag_of(0, (4,), ("dp",)) != cp_tp[0]
    assert group_layout_tag() == ""             # no process group


def test_cache_key_tag_keeps_the_users_part():
    before = torch.compiler.config.cache_key_tag
    try:
        torch.compiler.config.cache_key_tag = "mine"
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
        try:
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
            first = key_compile_caches_by_groups()
            assert first == f"mine|{group_layout_tag()}" and key_compile_caches_by_groups() == first
        finally:
            dist.destroy_process_group()
        assert key_compile_caches_by_groups() == "mine"   # no groups now: our part leaves, the user's stays
    finally:
        torch.compiler.config.cache_key_tag = before


def _cache_entries(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in (cache / "aotautograd").rglob("*") if p.is_file()}


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_cp_tp_runs_twice_on_one_inductor_cache(tmp_path):
    """CP 2 x TP 2, dtensor, per-block compile, run twice with one TORCHINDUCTOR_CACHE_DIR (the second run crashed
    before the fix): the second run takes graphs from the warm cache (it writes fewer AOTAutograd entries than the
    first wrote) and trains exactly as the first.  (Measured: of the 20 entries of a first run, 8 are loaded by
    the next run and 12 are compiled again with new keys on every run, torch-side: not a group-name collision,
    each key holds one entry.)"""
    cache = tmp_path / "inductor"
    plan = Plan(cp=2, tp=2, microbatch=2, compile=True, backend="dtensor")
    runs, written = [], []
    for i in range(2):
        before = _cache_entries(cache) if cache.exists() else set()
        runs.append(run_titan(plan, steps=3, seq_len=128, run_dir=tmp_path / f"run{i}",
                              extra_env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}, timeout=1500))
        assert "backend dtensor" in runs[-1].proc.stdout, runs[-1].proc.stdout[-2000:]
        written.append(len(_cache_entries(cache) - before))
    assert written[0] > 0, "the first run wrote no AOTAutograd cache entry: nothing warm to test"
    assert written[1] < written[0], f"the second run loaded nothing from the cache (entries written: {written})"
    assert_close_per_step(runs[1].losses, runs[0].losses, rtol=1e-6)
    assert_close_per_step(runs[1].grad_norms, runs[0].grad_norms, rtol=1e-6, what="grad norm")
