"""torch.compile per transformer block.

``nn.Module.compile()`` compiles a block in place, so parameter names do not
change; identical blocks share one compiled graph (parameters are graph
inputs).  Applied after TP/CP/AC and before FSDP (FSDP's hooks stay outside
the compiled region).  Ring attention must exclude itself from compilation
(``torch.compiler.disable``): compiled ring collectives deadlock on gloo
(docs/torch_on_cpu.md §8a).
"""
from __future__ import annotations

import logging

import torch
from torch import nn


def apply_compile(model: nn.Module) -> None:
    if not torch.cuda.is_available():
        # inductor imports torch.utils.cpp_extension, which warns on every rank that a CUDA_HOME exists
        # without a CUDA runtime (the CUDA wheel on a CPU host): true, and nothing a CPU run can act on
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # Every block is a separate module object: leave room for one cache entry per block.
    cfg = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(getattr(cfg, knob), 8 * len(model.layers)))
            break
    for block in model.layers.values():
        block.compile()
