"""Tensor parallel + sequence parallel on the ``spmd_types`` backend (local SPMD, Megatron style).

Parameters stay plain local tensors, each annotated with its local SPMD type on the
``tp`` axis; every collective is explicit and typed, at a module boundary.  What is
sharded how is data -- :data:`BLOCK_SHARDING` and :data:`ROOT_SHARDING`, tables of
module path -> :class:`ModuleSharding` (parameter types, input / output boundary) --
applied from outside the plain-PyTorch model with forward hooks
(:func:`apply_spmd_tp`).  The model code is not changed.

Types on the tp axis (``spmd_types``: R replicate, V varying, P pending sum,
S(d) varying = this rank's shard of dim d):

* between blocks the hidden state is sequence-sharded, S(1);
* norms (weight R) run on those local tokens: R x V -> V.  Their gradient is a
  pending sum over tp (R's backward type is P): FSDP keeps it as a ``Partial``
  gradient and the global grad-norm clip reduces it (``train.clip_grad_norm_``);
* ``attention`` / ``feed_forward`` inputs are all-gathered S(1) -> R (backward:
  reduce-scatter);
* column-wise linears (weight S(0)) produce this rank's heads / hidden units, V;
* row-wise linears (weight S(1)) produce a pending sum: their output is declared
  P (``reinterpret`` V -> P) and reduce-scattered P -> S(1) (backward: all-gather);
* the token embedding is vocab-parallel (weight S(0)): ids outside this rank's
  rows give zeros, the lookup is a pending sum, reduce-scattered to S(1);
* the LM head is column-wise over the vocabulary: the logits stay vocab-sharded
  (V) and :func:`vocab_parallel_cross_entropy` never gathers them (two all-reduces
  of one value per token, typed P -> I, so the loss is Invariant over tp).

FSDP2 then runs over the typed parameters on the SPMD mesh (data-parallel axes +
tp, ``fully_shard(..., dp_mesh_dims=...)``, ``fsdp.apply_fsdp_spmd``), also when
there is no data-parallel axis (a one-rank ``dp_shard``): the sharded parameters
are then DTensors on that mesh (``_StridedShard`` / ``Shard`` / ``Replicate``
from the annotations), so initialization, the grad-norm clip and checkpoints see
the same placements as on the DTensor backend.

Covered: dense GQA blocks (Llama), MoE blocks (:data:`MOE_BLOCK_SHARDING`) and multi-head latent
attention (``attention: mla``, ``models/mla.py``; :data:`MLA_ATTENTION_SHARDING`), sharded by heads
as the dtensor path does (``tensor_parallel.attention_plan``): the up-projections ``wq`` / ``wq_b``
and ``wkv_b`` column-wise (V: this rank's heads), ``wo`` row-wise with the SP reduce-scatter.  The
low-rank down-projections ``wq_a`` / ``wkv_a`` and the latent norms ``q_norm`` / ``kv_norm`` hold no
head dimension: their weights are R and they run on the all-gathered (R) sequence, so their outputs
are R -- the rotary key ``k_pe`` that ``wkv_a`` makes is one R tensor shared by the local heads
(R joins V: V).  Each tp rank back-propagates through its own heads only, so their gradients are
pending sums (R's backward type is P), reduced like the norms'.

On gloo, with the checker off (erasure mode, the default), the sequence all-gathers and
reduce-scatters of the eager boundaries run as direct point-to-point exchanges
(:data:`P2P_OPS`, ``seq_collectives.py``, docs/torch_on_cpu.md §11: half the bytes of gloo's
reduce-scatter, same values), and the loss is one autograd Function with the typed version's
loss and gradient, bitwise (``vocab_parallel_loss.py``); under ``train.spmd_typecheck`` the typed
collectives run.

What a block keeps of its all-gathered inputs (workload key ``tp_activations``): ``gathered``
(the default) lets every column-wise linear save the all-gathered ``[b, s, dim]`` input, as
DTensor TP does; ``sharded`` is Megatron's sequence parallelism (Korthikanti et al. 2022,
Sec. 4.2.2): inside each module with an all-gather input boundary (``attention``,
``feed_forward``, the LM head ``output``) a ``saved_tensors_hooks`` pair keeps only this
rank's sequence shard in place of the gathered tensor (:class:`_SeqShard`) and all-gathers it
again in backward, once for all the linears that saved it (wq / wk / wv, w1 / w3).  The
re-gathered tensor is bitwise the forward's, so the gradients are the ``gathered`` run's.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import spmd_types as spmd

from ..comm_timer import all_gather_flat
from .seq_collectives import GatherSeq, ScatterSeq, all_gather_seq_op, reduce_scatter_seq_op
from .vocab_parallel_loss import VocabParallelCrossEntropy

# spmd_types 0.3 calls funcol.all_gather_tensor / reduce_scatter_tensor, deprecated in torch 2.14: once per
# collective and process otherwise, on every rank (the call may come through comm_timer's wrapper)
warnings.filterwarnings("ignore", category=FutureWarning,
                        message=r"`torch\.distributed\._functional_collectives\.(all_gather_tensor|reduce_scatter_tensor)`"
                                r" is deprecated")

SEQ_DIM = 1          # [batch, seq, ...]: the sequence-parallel dimension

# parameter kinds -> local SPMD type on tp
COLWISE, ROWWISE, REPLICATE = "colwise", "rowwise", "replicate"
PARAM_TYPES = {COLWISE: spmd.S(0), ROWWISE: spmd.S(1), REPLICATE: spmd.R}
ALL_GATHER, REDUCE_SCATTER = "all_gather", "reduce_scatter"


@dataclass(frozen=True)
class ModuleSharding:
    """How one module runs under TP: its parameters' kinds, and the typed collective at its boundary.

    ``params``: parameter name -> COLWISE (S(0), rows sharded) | ROWWISE (S(1)) | REPLICATE (R).
    ``input``: ALL_GATHER -- the first positional input is all-gathered over the sequence, S(1) -> R.
    ``output``: REDUCE_SCATTER -- the output (a pending sum, P) is reduce-scattered, P -> S(1).
    (names of :data:`BOUNDARY_OPS`)
    ``partial_output``: the output is a pending sum over tp (row-wise linear, vocab-parallel lookup).
    ``vocab_parallel``: an embedding whose rows are this rank's vocabulary slice.
    """
    params: dict = field(default_factory=dict)
    input: str | None = None
    output: str | None = None
    partial_output: bool = False
    vocab_parallel: bool = False


_NORM = ModuleSharding(params={"weight": REPLICATE})
_COL = ModuleSharding(params={"weight": COLWISE})
_ROW_SP = ModuleSharding(params={"weight": ROWWISE}, partial_output=True, output=REDUCE_SCATTER)

# module path relative to a transformer block -> sharding
BLOCK_SHARDING: dict[str, ModuleSharding] = {
    "attention_norm": _NORM,
    "attention": ModuleSharding(input=ALL_GATHER),
    "attention.wq": _COL,
    "attention.wk": _COL,
    "attention.wv": _COL,
    "attention.wo": _ROW_SP,
    "ffn_norm": _NORM,
    "feed_forward": ModuleSharding(input=ALL_GATHER),
    "feed_forward.w1": _COL,
    "feed_forward.w3": _COL,
    "feed_forward.w2": _ROW_SP,
}

# multi-head latent attention (models/mla.py), replacing the "attention*" rows of a block's table: the
# up-projections by heads (S(0)), the down-projections and latent norms R (on the gathered sequence, so
# their outputs -- the latents and the shared rotary key -- are R), wo row-wise with the SP reduce-scatter
_REPLICATED = ModuleSharding(params={"weight": REPLICATE})
MLA_ATTENTION_SHARDING: dict[str, ModuleSharding] = {
    "attention": ModuleSharding(input=ALL_GATHER),
    "attention.wq": _COL,               # q_lora_rank 0: queries straight from x
    "attention.wq_a": _REPLICATED,
    "attention.q_norm": _REPLICATED,
    "attention.wq_b": _COL,
    "attention.wkv_a": _REPLICATED,     # latent + k_pe (one rotary key for all heads)
    "attention.kv_norm": _REPLICATED,
    "attention.wkv_b": _COL,            # per head: [k_nope, v]
    "attention.wo": _ROW_SP,
}

# module path relative to the model root -> sharding
ROOT_SHARDING: dict[str, ModuleSharding] = {
    "tok_embeddings": ModuleSharding(params={"weight": COLWISE}, vocab_parallel=True, partial_output=True,
                                     output=REDUCE_SCATTER),
    "norm": _NORM,
    "output": ModuleSharding(params={"weight": COLWISE}, input=ALL_GATHER),    # logits stay vocab-sharded
}

# a MoE block: the attention as in BLOCK_SHARDING; the MoE layer is not TP-sharded: router, routed and shared
# experts run on this rank's sequence-parallel tokens (S(1), no gather), their parameters R on tp, so their
# gradients are pending sums over tp, reduced like the norms' (the routed experts: spmd_expert_parallel.py)
MOE_BLOCK_SHARDING: dict[str, ModuleSharding] = {k: v for k, v in BLOCK_SHARDING.items()
                                                 if not k.startswith("feed_forward")}


def spmd_tp_unsupported(spec) -> str | None:
    """None if the spmd TP tables cover every block of `spec`, else what is missing."""
    if getattr(spec, "attention", "gqa") not in ("gqa", "mla"):
        return f"attention {spec.attention!r} has no spmd_types TP sharding table (tables: gqa, mla)"
    return None


def _block_table(block: nn.Module) -> dict[str, ModuleSharding]:
    """The sharding table of one transformer block: dense or MoE, with GQA or MLA attention."""
    table = MOE_BLOCK_SHARDING if getattr(block, "moe_enabled", False) else BLOCK_SHARDING
    if hasattr(block.attention, "wkv_a"):        # MLA (models/mla.py)
        table = {**{k: v for k, v in table.items() if not k.startswith("attention.") and k != "attention"},
                 **MLA_ATTENTION_SHARDING}
    return table


class _TP:
    """The tp axis: its process group (what the collectives take), spmd axis (the key of a type), rank, size."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.axis = spmd.MeshAxis.of(self.group)
        self.rank = mesh.get_local_rank()
        self.size = mesh.size()
        # gloo: the SP boundaries run as direct point-to-point exchanges while the checker is off (P2P_OPS)
        self.p2p = dist.get_backend(self.group) == "gloo"


def _local_param(p: nn.Parameter, kind: str, tp: _TP) -> nn.Parameter:
    """This rank's shard of `p` (on the meta device: shapes only), annotated with its tp type."""
    shape = list(p.shape)
    if kind != REPLICATE:
        dim = 0 if kind == COLWISE else 1
        if shape[dim] % tp.size:
            raise ValueError(f"tensor parallel: dimension {dim} of a {tuple(shape)} parameter is not divisible "
                             f"by tp={tp.size}")
        shape[dim] //= tp.size
    local = nn.Parameter(torch.empty(shape, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
    spmd.assert_type(local, {tp.axis: PARAM_TYPES[kind]})
    return local


def _gather_seq(x: torch.Tensor, tp: _TP) -> torch.Tensor:
    # backward: reduce-scatter of the gradient in the activation dtype (bf16 under mixed precision), as
    # DTensor's sequence parallel does; spmd_types asks for that choice explicitly below fp32
    return spmd.all_gather(x, tp.group, src=spmd.S(SEQ_DIM), dst=spmd.R, backward_options={"op_dtype": x.dtype})


def _scatter_seq(x: torch.Tensor, tp: _TP) -> torch.Tensor:
    return spmd.reduce_scatter(x, tp.group, src=spmd.P, dst=spmd.S(SEQ_DIM))


# boundary name -> typed collective (x, tp) -> x
BOUNDARY_OPS = {ALL_GATHER: _gather_seq, REDUCE_SCATTER: _scatter_seq}


def _gather_seq_erased(x: torch.Tensor, tp: _TP) -> torch.Tensor:
    # torch's functional collective (autograd: its backward is the sum reduce-scatter, in the gradient's dtype)
    return funcol.all_gather_single(x, SEQ_DIM, tp.group)


def _scatter_seq_erased(x: torch.Tensor, tp: _TP) -> torch.Tensor:
    return funcol.reduce_scatter_single(x, "sum", SEQ_DIM, tp.group)


def _gather_seq_p2p(x: torch.Tensor, tp: _TP) -> torch.Tensor:
    return GatherSeq.apply(x, tp.group, tp.rank, tp.size)


def _scatter_seq_p2p(x: torch.Tensor, tp: _TP) -> torch.Tensor:
    return ScatterSeq.apply(x, tp.group, tp.rank, tp.size)


# the same collectives on gloo in erasure mode, as point-to-point exchanges (seq_collectives.py: half the bytes of
# gloo's reduce-scatter, one copy less per all-gather; measured at [2, 512, 256] fp32 on 2 ranks, medians of 55:
# reduce-scatter 1.68 -> 0.67 ms, all-gather 1.18 -> 0.66 ms); same values (exact on 2 ranks)
P2P_OPS = {ALL_GATHER: _gather_seq_p2p, REDUCE_SCATTER: _scatter_seq_p2p}


def _p2p_unless_checking(name: str, typed, tp: _TP):
    """Boundary `name`: the typed collective `typed` under the checker (``train.spmd_typecheck``), else on gloo
    its :data:`P2P_OPS` twin (in erasure mode the typed collective is just that collective)."""
    fast = P2P_OPS.get(name)
    if fast is None:
        return typed
    return lambda x, tp: fast(x, tp) if tp.p2p and not spmd.is_type_checking() else typed(x, tp)


# the same collectives with their types erased, for the boundaries inside a compiled block (apply_spmd_tp
# `erased_blocks`): spmd_types' collectives read ``x.grad_fn``, which Dynamo cannot trace, so a typed boundary is an
# eager island that splits the block's graph; torch's functional collectives are traced into it
ERASED_OPS = {ALL_GATHER: _gather_seq_erased, REDUCE_SCATTER: _scatter_seq_erased}


def _gather_seq_erased_p2p(x: torch.Tensor, tp: _TP) -> torch.Tensor:
    return all_gather_seq_op(x, tp.group.group_name, tp.rank, tp.size)


def _scatter_seq_erased_p2p(x: torch.Tensor, tp: _TP) -> torch.Tensor:
    return reduce_scatter_seq_op(x, tp.group.group_name, tp.rank, tp.size)


# on gloo: the point-to-point exchanges of P2P_OPS as custom ops, traced into the compiled graph like ERASED_OPS
ERASED_P2P_OPS = {ALL_GATHER: _gather_seq_erased_p2p, REDUCE_SCATTER: _scatter_seq_erased_p2p}


# --------------------------------------------------------------------------- tp_activations: sharded
class _SeqShard:
    """This rank's sequence shard of one all-gathered module input, kept for backward in its place.

    :meth:`full` all-gathers it again over tp (a plain collective: backward is not typed) on the
    first unpack and caches the result, so every node that saved the gathered tensor (or a view
    of it) shares one re-gather; the cache goes with the last of those nodes.  `packed` is the
    shard as the enclosing saved-tensor hooks (if any) packed it."""
    __slots__ = ("packed", "outer_unpack", "tp", "_full", "version")

    def __init__(self, shard: torch.Tensor, tp: _TP, outer):
        self.outer_unpack = outer[1] if outer is not None else None
        self.packed = outer[0](shard) if outer is not None else shard
        self.tp, self._full, self.version = tp, None, shard._version

    def full(self) -> torch.Tensor:
        if self._full is None:
            shard = self.packed if self.outer_unpack is None else self.outer_unpack(self.packed)
            if shard._version != self.version:      # what autograd checks for the tensors it saves itself
                raise RuntimeError("tp_activations sharded: the sequence shard of an all-gathered input was "
                                   "modified in place after forward, so backward cannot gather it again")
            shard = shard.contiguous()
            flat = shard.new_empty((self.tp.size * shard.shape[0], *shard.shape[1:]))
            with torch.no_grad(), spmd.no_typecheck():
                all_gather_flat(flat, shard, group=self.tp.group)
                self._full = torch.cat(flat.chunk(self.tp.size, 0), dim=SEQ_DIM)   # rank order = sequence order
        return self._full


class _ShardView:
    """A saved view (size, stride, offset) of a gathered input whose storage `_SeqShard.full` rebuilds."""
    __slots__ = ("shard", "geometry")

    def __init__(self, shard: _SeqShard, t: torch.Tensor):
        self.shard, self.geometry = shard, (t.size(), t.stride(), t.storage_offset())


class _Outer:
    """A tensor packed by the enclosing saved-tensor hooks (e.g. a caller's), unpacked by them."""
    __slots__ = ("packed", "unpack")

    def __init__(self, packed, unpack):
        self.packed, self.unpack = packed, unpack


class _KeepShards:
    """The saved-tensor hooks of one call of a module whose input `gathered` was all-gathered from `shard`.

    pack: a tensor on the gathered tensor's storage (the tensor or a view: a linear saves its
    input flattened to 2-D) becomes a :class:`_ShardView` on one :class:`_SeqShard`; any other
    goes to the enclosing hooks if there are any (so they still see, e.g. count or offload, what
    this module keeps -- the shard included), else is kept as it is.  unpack: the inverse."""

    def __init__(self, shard: torch.Tensor, gathered: torch.Tensor, tp: _TP):
        # the enclosing default hooks, to chain to (torch.utils.checkpoint reads them the same way)
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.base, self.tp = gathered if gathered._base is None else gathered._base, tp
        self.storage = gathered.untyped_storage().data_ptr()      # 0 on the meta device: matched by base only
        self.device = gathered.device
        self.seq_shard: _SeqShard | None = None
        self.shard = shard.detach()

    def _on_gathered(self, t: torch.Tensor) -> bool:
        if (t if t._base is None else t._base) is self.base:
            return True
        return (bool(self.storage) and t.layout == torch.strided and t.device == self.device
                and t.untyped_storage().data_ptr() == self.storage)     # e.g. an _unsafe_view of it

    def pack(self, t: torch.Tensor):
        if self._on_gathered(t):
            if self.seq_shard is None:
                self.seq_shard = _SeqShard(self.shard, self.tp, self.outer)
            return _ShardView(self.seq_shard, t)
        return t if self.outer is None else _Outer(self.outer[0](t), self.outer[1])

    def close(self) -> None:
        """After the module's forward: drop the gathered tensor and the shard (only the saved _SeqShard keeps
        that), since torch's saved variables hold on to this object through their pack hook."""
        self.base = self.shard = self.seq_shard = self.outer = None
        self.storage = 0

    @staticmethod
    def unpack(x):
        if isinstance(x, _ShardView):
            return x.shard.full().as_strided(*x.geometry)
        if isinstance(x, _Outer):
            return x.unpack(x.packed)
        return x


def _gather_keeping_shard(gather, tp: _TP):
    """The input boundary under ``tp_activations: sharded``: (pre-hook, post-hook) that all-gather the
    input and run the module's forward under :class:`_KeepShards` hooks."""
    def pre(mod, args):
        shard = args[0]
        gathered = gather(shard, tp)
        if (not gathered.is_contiguous() or gathered.storage_offset()
                or gathered.untyped_storage().nbytes() != gathered.numel() * gathered.element_size()):
            gathered = gathered.clone(memory_format=torch.contiguous_format)   # the storage full() rebuilds
        keep = _KeepShards(shard, gathered, tp)
        hooks = torch.autograd.graph.saved_tensors_hooks(keep.pack, keep.unpack)
        mod.__dict__.setdefault("_spmd_keep_shards", []).append((hooks, keep))
        hooks.__enter__()
        return (gathered, *args[1:])

    def post(mod, args, out):
        hooks, keep = mod.__dict__["_spmd_keep_shards"].pop()
        hooks.__exit__(None, None, None)
        keep.close()
    return pre, post


def _eager(hook):
    """A boundary hook (typed collective, ``reinterpret``) as an eager island inside a compiled block.

    spmd_types 0.3's collectives and ``reinterpret`` read ``x.grad_fn``, which Dynamo cannot trace:
    inside a compiled block each call would break the graph anyway, and Dynamo would then retry on
    the op's own frames (the autograd.Function forwards, recompiled per process group).  Excluded
    explicitly, the hook runs as in eager mode (erasure: just the collective) and the compute
    between the boundaries is compiled (docs/torch_on_cpu.md §8e)."""
    return torch.compiler.disable(hook, recursive=True)


def _apply_one(module: nn.Module, sharding: ModuleSharding, tp: _TP, done: dict, keep_shards: bool,
               erased: bool = False) -> None:
    for name, kind in sharding.params.items():
        p = getattr(module, name, None)
        if p is None:
            continue
        if id(p) not in done:            # a tied parameter is sharded once
            done[id(p)] = _local_param(p, kind, tp)
        module.register_parameter(name, done[id(p)])

    if sharding.vocab_parallel:
        rows = module.weight.shape[0]
        lo = tp.rank * rows

        def embed_pre(mod, args):
            ids = args[0] - lo
            mask = (ids < 0) | (ids >= rows)
            mod._spmd_vocab_mask = mask          # read (and dropped) by embed_post of the same call
            return (ids.masked_fill(mask, 0), *args[1:])

        def embed_post(mod, args, out):
            mask = mod.__dict__.pop("_spmd_vocab_mask")
            return out.masked_fill(mask.unsqueeze(-1), 0.0)
        module.register_forward_pre_hook(embed_pre)
        module.register_forward_hook(embed_post)

    if erased:      # inside a compiled block: untyped collectives traced into its graph (ERASED_OPS)
        ops = ERASED_P2P_OPS if tp.p2p else ERASED_OPS
        if sharding.input is not None:
            gather = _boundary_op(sharding.input, "input", ops)
            module.register_forward_pre_hook(lambda mod, args: (gather(args[0], tp), *args[1:]))
        if sharding.output is not None:     # a pending sum (partial_output) is a type only: nothing to run
            scatter = _boundary_op(sharding.output, "output", ops)
            module.register_forward_hook(lambda mod, args, out: scatter(out, tp))
        return
    if sharding.input is not None:
        gather = _p2p_unless_checking(sharding.input, _boundary_op(sharding.input, "input"), tp)
        if keep_shards and sharding.input == ALL_GATHER:
            pre, post = _gather_keeping_shard(gather, tp)
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post, always_call=True)
        else:
            module.register_forward_pre_hook(_eager(lambda mod, args: (gather(args[0], tp), *args[1:])))
    if sharding.partial_output:     # a type only (forward and backward are identities): for the checker
        module.register_forward_hook(_eager(
            lambda mod, args, out: spmd.reinterpret(out, tp.group, src=spmd.V, dst=spmd.P)
            if spmd.is_type_checking() else out))
    if sharding.output is not None:
        scatter = _p2p_unless_checking(sharding.output, _boundary_op(sharding.output, "output"), tp)
        module.register_forward_hook(_eager(lambda mod, args, out: scatter(out, tp)))


def _boundary_op(name: str, where: str, ops: dict = BOUNDARY_OPS):
    if name not in ops:
        raise ValueError(f"ModuleSharding.{where}: {name!r} (allowed: {', '.join(map(repr, ops))})")
    return ops[name]


def _apply_table(root: nn.Module, table: dict, tp: _TP, done: dict, keep_shards: bool,
                 erased: bool = False) -> None:
    for path, sharding in table.items():
        try:
            module = root.get_submodule(path)
        except AttributeError:      # absent in this model (GELU MLP has no w3) or this pipeline stage
            continue
        if module is not None:
            _apply_one(module, sharding, tp, done, keep_shards, erased)


TP_ACTIVATIONS = ("gathered", "sharded")


def apply_spmd_tp(model: nn.Module, tp_mesh: DeviceMesh, *, block_sharding: dict | None = None,
                  root_sharding: dict | None = None, tp_activations: str = "gathered",
                  erased_blocks: bool = False) -> None:
    """Shard `model` (on the meta device) over `tp_mesh` as the tables say; hooks do the typed collectives.

    The tables default to :data:`BLOCK_SHARDING` / :data:`ROOT_SHARDING` (a test passes an
    altered copy to show that the checker names a missing collective).  `tp_activations`:
    ``gathered`` lets the linears save the all-gathered inputs, ``sharded`` keeps the sequence
    shards and all-gathers them again in backward (module docstring; eager only: not under
    compile, and it must not run inside selective checkpointing).  `erased_blocks` (for blocks that will be
    compiled, with the checker off): the blocks' boundaries run :data:`ERASED_OPS` (on gloo
    :data:`ERASED_P2P_OPS`), the same collectives without their types, traced into the compiled graph; the root's (embedding, LM head) stay typed."""
    if tp_activations not in TP_ACTIVATIONS:
        raise ValueError(f"apply_spmd_tp: tp_activations {tp_activations!r} (allowed: "
                         f"{', '.join(map(repr, TP_ACTIVATIONS))})")
    tp = _TP(tp_mesh)
    done: dict = {}
    keep = tp_activations == "sharded"
    _apply_table(model, ROOT_SHARDING if root_sharding is None else root_sharding, tp, done, keep)
    if erased_blocks and keep:
        raise ValueError("apply_spmd_tp: tp_activations 'sharded' keeps shards in eager blocks only, not with "
                         "erased_blocks")
    for block in model.layers.values():
        _apply_table(block, _block_table(block) if block_sharding is None else block_sharding, tp, done, keep,
                     erased_blocks)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_mesh: DeviceMesh,
                                 batch_types: dict) -> torch.Tensor:
    """Mean token cross-entropy of vocab-sharded logits ``[b, s, V/tp]`` (V on tp), without gathering them.

    Per token: the max over the vocabulary (all-reduce MAX, no gradient), the sum of exp
    and the label's logit (each a local partial sum, all-reduced P -> I).  The loss is
    Invariant over tp: every tp rank computes the same value, and backward hands each
    rank the gradient of its own logits.  `batch_types` are the batch's types on the
    data-parallel axes (V), given to the max (made outside the type system).  With the checker off
    (erasure mode) the same loss and gradient, bitwise, come from one autograd Function
    (``vocab_parallel_loss.py``: the two per-token sums in one all-reduce, backward in closed form;
    measured at [1024, 1024] fp32 logits per rank on 2 gloo ranks, fwd+bwd median 16.7 -> 11.3 ms)."""
    tp = _TP(tp_mesh)
    logits = logits.flatten(0, 1).float()
    labels = labels.flatten()
    if not spmd.is_type_checking():
        return VocabParallelCrossEntropy.apply(logits, labels, tp.group, tp.rank)
    rows = logits.shape[-1]
    with torch.no_grad(), spmd.no_typecheck():
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp.group)
    spmd.assert_type(m, {**batch_types, tp.axis: spmd.R})
    shifted = logits - m.unsqueeze(-1)
    sum_exp = spmd.all_reduce(shifted.exp().sum(dim=-1), tp.group, src=spmd.V, dst=spmd.I)
    local = labels - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    picked = shifted.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    picked = spmd.all_reduce(picked, tp.group, src=spmd.V, dst=spmd.I)
    return (sum_exp.log() - picked).mean()


__all__ = ["BLOCK_SHARDING", "BOUNDARY_OPS", "MLA_ATTENTION_SHARDING", "MOE_BLOCK_SHARDING", "ModuleSharding",
           "ROOT_SHARDING", "TP_ACTIVATIONS", "apply_spmd_tp", "spmd_tp_unsupported",
           "vocab_parallel_cross_entropy"]
