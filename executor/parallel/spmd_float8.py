"""Float8 linears under tensor parallelism on the ``spmd_types`` backend (plain local shards).

torchao's float8 training (``convert_to_float8_training``, tensorwise dynamic scaling) casts each
matmul operand -- the input, the weight, and in backward the output gradient -- to float8 with
ONE scale per tensor, ``scale = float8_max / amax(|tensor|)``.  Its tensor-parallel support
(``Float8ColwiseParallel`` / ``Float8RowwiseParallel``) works on DTensors, whose ``amax`` is a
global reduction.  On the spmd path the weights are plain local shards, so a Float8Linear left
alone would scale each rank's shard by that shard's own amax: a different float8 grid on every
rank, and not the grid of the same run on one process.

Here every operand that is not replicated over tp is cast with its amax all-reduced (MAX) over the
tp group first (torchao's ``tensor_to_scale(..., reduce_amax=True, device_mesh=tp)``), so each rank
quantizes its shard on the grid the whole tensor gets on one process:

* the weight of a column-wise (S(0)) or row-wise (S(1)) linear;
* the input of a row-wise linear (this rank's features, V), and of any linear that runs on the
  sequence-parallel tokens (S(1), e.g. a MoE router); the input of a column-wise or replicated
  linear inside a module that all-gathers its input (``ModuleSharding.input``) is R: no reduction;
* the output gradient of every linear except a row-wise one (whose output is reduce-scattered, so
  its gradient is the all-gathered R tensor): V for a column-wise linear, S(1) on sequence shards,
  and the pending sum (P) of a replicated linear on gathered tokens (MLA's ``wq_a`` / ``wkv_a``).
  A pending sum is quantized per rank before it is summed, on the common grid of the ranks'
  largest partial: this one case cannot be the single process's grid (which quantizes the sum).

The casts are torchao's own (``hp_tensor_and_scale_to_float8``, differentiable pass-through), made
before its ``matmul_with_hp_or_float8_args``, which uses an operand that is already float8 as it is
(in backward too): with tensorwise scaling the backward's casts of the same tensors are the same
values, so a column-wise linear computes exactly what one process does with the same weights.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .spmd_tensor_parallel import ALL_GATHER, COLWISE, REPLICATE, ROOT_SHARDING, ROWWISE, ModuleSharding, _block_table


@functools.cache
def _float8_api() -> SimpleNamespace:
    """torchao's float8 pieces, imported once (optional package, the float8 extra: only float8 plans reach here)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import tensor_to_scale
    return SimpleNamespace(ScalingGranularity=ScalingGranularity, ScalingType=ScalingType, Float8Linear=Float8Linear,
                           matmul=matmul_with_hp_or_float8_args, GemmInputRole=GemmInputRole,
                           to_float8=hp_tensor_and_scale_to_float8, tensor_to_scale=tensor_to_scale)


def _cast(x: torch.Tensor, dtype, mm_config, role, mesh: DeviceMesh):
    """`x` as a float8 tensor on the grid of its tp-global amax (differentiable: the gradient passes)."""
    ao = _float8_api()
    scale = ao.tensor_to_scale(x, dtype, reduce_amax=True, device_mesh=mesh)
    return ao.to_float8(x, scale, dtype, mm_config, role)


class _GradToFloat8(torch.autograd.Function):
    """Forward: identity.  Backward: the gradient cast to float8 on its tp-global amax's grid."""

    @staticmethod
    def forward(ctx, x, dtype, mm_config, mesh):
        ctx.dtype, ctx.mm_config, ctx.mesh = dtype, mm_config, mesh
        return x

    @staticmethod
    def backward(ctx, grad):
        role = _float8_api().GemmInputRole.GRAD_OUTPUT
        return _cast(grad, ctx.dtype, ctx.mm_config, role, ctx.mesh), None, None, None


def _tp_forward(self, input: torch.Tensor) -> torch.Tensor:
    """Float8Linear.forward with the tp-sharded operands cast on their global amax (module docstring)."""
    ao = _float8_api()
    matmul, GemmInputRole = ao.matmul, ao.GemmInputRole
    c, mesh = self.config, self._spmd_tp_mesh
    x = input
    if self._spmd_reduce_input:
        x = _cast(x, c.cast_config_input.target_dtype, self.linear_mm_config, GemmInputRole.INPUT, mesh)
    w_t = self.weight.t()
    if self._spmd_reduce_weight:
        w_t = _cast(w_t, c.cast_config_weight.target_dtype, self.linear_mm_config, GemmInputRole.WEIGHT, mesh)
    out = matmul.apply(x, w_t, self.linear_mm_config, c)
    if self._spmd_reduce_grad:
        out = _GradToFloat8.apply(out, c.cast_config_grad_output.target_dtype, self.linear_mm_config, mesh)
    if self.bias is not None:
        out = out + self.bias.to(out.dtype)
    return out


def _check_config(mod, path: str) -> None:
    ao = _float8_api()
    ScalingGranularity, ScalingType = ao.ScalingGranularity, ao.ScalingType
    c = mod.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output,
             c.cast_config_input_for_grad_weight, c.cast_config_weight_for_grad_input,
             c.cast_config_grad_output_for_grad_weight)
    if (c.enable_fsdp_float8_all_gather or c.round_scales_to_power_of_2
            or any(k.scaling_type is not ScalingType.DYNAMIC or k.scaling_granularity
                   is not ScalingGranularity.TENSORWISE for k in casts)
            or casts[3:] != casts[:3]):
        raise ValueError(f"float8 with tensor parallel: {path} is not torchao's default tensorwise dynamic "
                         "recipe (the only one the spmd_types TP casts here)")


def _rules(path: str, table: dict[str, ModuleSharding]) -> tuple[str, bool, bool]:
    """(weight kind, input gathered, output partial) of the linear at `path` of a block or the root.

    A linear no table names (a MoE block's router and shared experts) has an R weight and runs on
    the sequence-parallel tokens (spmd_tensor_parallel.MOE_BLOCK_SHARDING)."""
    sharding = table.get(path, ModuleSharding(params={"weight": REPLICATE}))
    gathered = any(s.input == ALL_GATHER and (path == p or path.startswith(p + ".")) for p, s in table.items())
    return sharding.params.get("weight", REPLICATE), gathered, sharding.partial_output


def apply_spmd_float8_tp(model: nn.Module, tp_mesh: DeviceMesh) -> int:
    """Give each Float8Linear of `model` the tp-global amax casts; the number of linears done.

    Run after ``convert_to_float8_training`` and ``apply_spmd_tp`` (the weights are local shards), with
    the same tables (``spmd_tensor_parallel.ROOT_SHARDING`` and each block's)."""
    Float8Linear = _float8_api().Float8Linear
    tables = {name: _block_table(block) for name, block in model.layers.items()}
    done = 0
    for path, mod in model.named_modules():
        if not isinstance(mod, Float8Linear):
            continue
        head, _, rest = path.partition(".")
        name, _, rel = rest.partition(".")
        if head == "layers" and name in tables:
            kind, gathered, partial = _rules(rel, tables[name])
        else:
            kind, gathered, partial = _rules(path, ROOT_SHARDING)
        _check_config(mod, path)
        mod._spmd_tp_mesh = tp_mesh
        mod._spmd_reduce_weight = kind in (COLWISE, ROWWISE)
        mod._spmd_reduce_input = kind == ROWWISE or not gathered
        mod._spmd_reduce_grad = not partial
        mod.forward = _tp_forward.__get__(mod)
        done += 1
    return done


__all__ = ["apply_spmd_float8_tp"]
