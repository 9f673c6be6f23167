"""Parallelisms, one module each, applied from outside the model in one fixed order.

Every one is applied in ``parallelize.py`` (:func:`build_model_parts`, :func:`parallelize`),
to each pipeline stage, in this order:

    PP split -> (float8) -> TP/SP -> CP -> EP -> AC -> compile -> FSDP

=========================  ===============================================
PP split, schedules        ``pipeline.py``
TP / SP, loss parallel     ``tensor_parallel.py``
TP / SP on spmd_types      ``spmd_tensor_parallel.py`` (tables), ``spmd_step.py`` (typed step)
CP (ring attention)        ``context_parallel.py``, ``ring_attention.py``, ``spmd_context_parallel.py`` (typed, spmd_types)
EP (all-to-all experts)    ``expert_parallel.py``, ``spmd_expert_parallel.py`` (typed, spmd_types)
AC (full, selective)       ``activation_checkpoint.py``
compile (per block)        ``compile.py``
FSDP2 / HSDP, spmd_types   ``fsdp.py``
=========================  ===============================================
"""
from .parallelize import (Precision, build_model_parts, parallelize, resolve_backend, resolve_precision,
                          tp_shards_embedding, uses_fsdp)

__all__ = ["Precision", "build_model_parts", "parallelize", "resolve_backend", "resolve_precision", "uses_fsdp",
           "tp_shards_embedding"]
