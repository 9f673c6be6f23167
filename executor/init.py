"""Layout-independent weight initialization.

Every parameter gets the same full values whatever the plan: the full tensor
is generated from a seed derived from ``(seed, fqn)`` with the model's
``init_rule(fqn)``, and each rank copies in its own shard
(``distribute_tensor`` with the parameter's mesh and placements, which covers
FSDP ``Shard(0)``, TP colwise/rowwise and FSDP+TP ``_StridedShard``).  The
FQN is the one of the plain model: wrapper prefixes added by activation
checkpointing / compile / FSDP are removed first.

The values depend on the device type the generator runs on (CPU and CUDA
generators differ), not on the layout.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_fqn(fqn: str) -> str:
    for p in WRAPPER_PREFIXES:
        fqn = fqn.replace(p, "")
    return fqn


def param_seed(seed: int, fqn: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{fqn}".encode()).digest()[:8], "little") & (2 ** 63 - 1)


def full_value(rule: tuple[str, float], shape: torch.Size, *, seed: int, fqn: str,
               device: torch.device) -> torch.Tensor:
    kind, std = rule
    if kind == "ones":
        return torch.ones(shape, device=device)
    if kind == "zeros":
        return torch.zeros(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(param_seed(seed, fqn))
    t = torch.empty(shape, device=device)
    if kind == "normal":
        return t.normal_(0.0, std, generator=gen)
    if kind == "trunc_normal":      # truncated at +-2 std
        return nn.init.trunc_normal_(t, 0.0, std, -2 * std, 2 * std, generator=gen)
    raise ValueError(f"unknown init rule {kind!r} for parameter '{fqn}'")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local tensor (a view), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` laid out as the (D)Tensor `like`."""
    if not isinstance(like, DTensor):
        return full
    try:
        dt = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    except TypeError:   # torch without src_data_rank: every rank holds `full`, a scatter is harmless
        dt = distribute_tensor(full, like.device_mesh, like.placements)
    return dt.to_local()


@torch.no_grad()
def init_weights(module: nn.Module, rule_fn, *, seed: int, device: torch.device) -> None:
    """Fill every parameter of `module` (already materialized with ``to_empty``).  A module may name the parameter
    whose values one of its own takes (``init_fqn``: a pipeline's last stage holds a copy of a tied embedding)."""
    alias = getattr(module, "init_fqn", None) or (lambda f: f)
    for name, p in module.named_parameters():
        fqn = alias(clean_fqn(name))
        full = full_value(rule_fn(fqn), p.shape, seed=seed, fqn=fqn, device=device)
        local = local_shard(full.to(p.dtype), p)
        dst = p.to_local() if isinstance(p, DTensor) else p
        assert dst.shape == local.shape, f"{fqn}: local shape {tuple(dst.shape)} != shard {tuple(local.shape)}"
        dst.copy_(local)

