"""torch.compile per transformer block.

``nn.Module.compile()`` compiles a block in place, so parameter names do not
change; identical blocks share one compiled graph (parameters are graph
inputs).  Applied after TP/CP/AC and before FSDP (FSDP's hooks stay outside
the compiled region).  Ring attention must exclude itself from compilation
(``torch.compiler.disable``): compiled ring collectives deadlock on gloo
(docs/torch_on_cpu.md §8a).

The compile caches are keyed by this process's process groups
(:func:`group_layout_tag`): a compiled graph names the groups of its
collectives by their registered names (``'15'``, a creation counter), but
torch's AOTAutograd cache key replaces the opaque mesh/group inputs by
ordinals, so the ranks of different tp groups (ranks 0-1 and 2-3 under
CP 2 x TP 2) produced one cache entry; a warm cache then gave a rank the
other group's name ("Could not resolve the process group registered under
the name 16").
"""
from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist
from torch import nn

# the part of torch.compiler.config.cache_key_tag this module owns (anything else in the tag is kept)
GROUP_TAG_PREFIX = "titan-process-groups:"


def group_layout_tag() -> str:
    """A digest of every process group this process belongs to: its registered name and its global ranks
    (what a name baked into a compiled graph means); '' without a process group."""
    if not dist.is_initialized():
        return ""
    # the registry of this process's groups (name -> ProcessGroup) has no public accessor in torch 2.14
    groups = dist.distributed_c10d._world.pg_names
    layout = sorted((name, tuple(dist.get_process_group_ranks(pg))) for pg, name in groups.items())
    return GROUP_TAG_PREFIX + hashlib.sha256(repr(layout).encode()).hexdigest()[:16]


def key_compile_caches_by_groups() -> str:
    """Put :func:`group_layout_tag` into ``torch.compiler.config.cache_key_tag`` (replacing an earlier one of
    ours, keeping the user's); returns the tag now in force."""
    cfg = torch.compiler.config
    kept = [part for part in cfg.cache_key_tag.split("|") if part and not part.startswith(GROUP_TAG_PREFIX)]
    cfg.cache_key_tag = "|".join(kept + [t for t in (group_layout_tag(),) if t])
    return cfg.cache_key_tag


def apply_compile(model: nn.Module) -> None:
    if not torch.cuda.is_available():
        # inductor imports torch.utils.cpp_extension, which warns on every rank that a CUDA_HOME exists
        # without a CUDA runtime (the CUDA wheel on a CPU host): true, and nothing a CPU run can act on
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    key_compile_caches_by_groups()
    # Every block is a separate module object: leave room for one cache entry per block.
    cfg = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(getattr(cfg, knob), 8 * len(model.layers)))
            break
    for block in model.layers.values():
        block.compile()
