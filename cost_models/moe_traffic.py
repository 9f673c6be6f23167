"""Expert-parallel all-to-all traffic per optimizer step, as the step-time model counts it.

`step_time.stage_times` charges each MoE block, per micro-batch and direction,
one dispatch and one combine all-to-all (Lepikhin et al. 2020, GShard,
arXiv:2006.16668 Sec. 3.2) in which every EP rank sends

    a2a_bytes = tokens / sp * top_k * dim * elt * ep_imbalance    (time; bytes sent: below)

(tokens = microbatch * seq_len / cp; sp = tp under sequence parallel; the
self-addressed 1/ep share is included, as in `comm.all_to_all_time`): 2 such
all-to-alls forward, 2 backward, and 2 more under full activation
checkpointing (the recomputed forward).  Charging the imbalance to every
all-to-all is right for the *time*: with full-duplex links an all-to-all
lasts as long as the busiest rank's larger direction, and the busiest rank
(its experts get ``ep_imbalance`` x the mean tokens) receives that much in
dispatch and sends it in combine.

What one rank *sends* is another matter (this module's figure): with
``base = tokens / sp * top_k * dim * elt``, the busiest rank sends

* dispatch: its own routed tokens, ``base`` -- every rank sends exactly its
  tokens x top_k rows, however they are routed;
* combine: the results of the rows it received, ``ep_imbalance * base``;
* backward: the reverse routes (dispatch-backward sends what dispatch
  received, ``ep_imbalance * base``; combine-backward what combine received,
  ``base``);

so ``(1 + ep_imbalance) / 2 * base`` per all-to-all on average, not
``ep_imbalance * base`` (measured with bench/bench_moe.py: the busiest rank
sent 6.72 MiB per step where ``ep_imbalance * base`` predicted 8.50 MiB).  This module exposes that volume so a
measured run (the executor's ``summary.json`` ``moe.all_to_all_bytes_per_step``:
bytes one rank sends in dispatch + combine, forward and backward) can be
checked against it; `step_time.py` itself stays the one place the *time* is
computed.
"""
from __future__ import annotations

import numpy as np

from .layout import layer_mix


def sends_once_per_node(model, workload) -> bool:
    """Workload ``ep_dispatch`` resolved: True when the EP dispatch sends a token over the network once per
    distinct remote node (``per_node``: DeepEP, HybridEP), False when it sends every routed copy
    (``every_copy``).  ``auto`` is ``every_copy`` for the fsdp2 layout (this executor and TorchTitan send
    every copy with one all_to_all_single) and, for the megatron layout, ``per_node`` exactly when the model
    routes node-limited (DeepSeek-V3's node-limited routing is built around that dispatch, arXiv:2412.19437
    Sec. 3.2.2, and Megatron-Bridge's DeepSeek-V3 recipes run it: bench/reference_recipes.yaml) and
    ``every_copy`` otherwise (Megatron's ``alltoall`` dispatcher, the recipes' default)."""
    if workload.ep_dispatch != "auto":
        return workload.ep_dispatch == "per_node"
    return workload.state_layout == "megatron" and node_limited(model)


# SMs the per-node dispatch kernels hold while they run: DeepEP's normal (training) kernels default to 20
# (deep_ep Buffer.num_sms = 20; Megatron-core TransformerConfig.moe_deepep_num_sms = 20), the budget DeepSeek-V3
# trained with ("we employ the warp specialization technique ... and partition 20 SMs into 10 communication
# channels", arXiv:2412.19437 Sec. 3.2.2).  HybridEP defaults to 16 in Megatron-core; the workload does not
# tell the two apart.
PER_NODE_DISPATCH_SMS = 20


def dispatch_sm_share(model, workload, hw) -> float:
    """Share of the GPU's SMs the EP dispatch and combine kernels occupy while they run: the per-node
    dispatchers' (`PER_NODE_DISPATCH_SMS` of ``hw.sm_count``), whose communication runs in SM-resident kernels;
    0 for the every-copy all-to-all (NCCL states no SM budget) and where the SM count is unknown.  Compute that
    overlaps those kernels runs on the other SMs (step_time._ep_exposed)."""
    sms = int(hw.sm_count or 0)
    if sms <= PER_NODE_DISPATCH_SMS or not sends_once_per_node(model, workload):
        return 0.0
    return PER_NODE_DISPATCH_SMS / sms


def node_limited(model) -> bool:
    """True when the router picks a token's experts inside its best ``n_limited_groups`` of ``n_expert_groups``."""
    return bool(model.n_expert_groups and model.n_limited_groups < model.n_expert_groups)


def ib_share(model, ep, per_node, once_per_node: bool | None = None) -> np.ndarray:
    """[n] share of a rank's all-to-all bytes (top_k copies of each token) that crosses the network.

    Every copy sent (``once_per_node`` False: Megatron's ``alltoall`` dispatcher, this project's executor,
    TorchTitan's default EP, which all permute a token's top_k copies and exchange them with one NCCL
    all-to-all): (p - k) / p of the copies go to ranks on other nodes (p = ep, k = EP ranks per node), with
    or without a routing group limit (a token's own node is as likely as any other among the ones it picks).

    Once per node (``once_per_node`` True: DeepEP's normal kernels and NVIDIA's Hybrid-EP, Megatron-core's
    ``--moe-token-dispatcher-type flex`` with ``--moe-flex-dispatcher-backend deepep | hybridep``,
    megatron/core/transformer/moe/fused_a2a.py, NVIDIA/Megatron-LM 19c61eb): a token crosses the network
    ONCE per distinct remote node that holds one of its experts, to the GPU with the same in-node index,
    which forwards it over NVLink to the experts' GPUs (DeepSeek-V3, arXiv:2412.19437 Sec. 3.2.2; DeepEP's
    layout kernel counts ``num_tokens_per_rdma_rank += (is_in_rdma_rank[j] > 0)``, csrc/kernels/layout.cu;
    Hybrid-EP "first performs IB communication between peer GPUs, then each rank distributes the received
    inter-node data locally", its RDMA buffer holds ``max_tokens_per_rank x (num_nodes - 1)`` tokens, and
    its combine "pre-reduces data within node before sending to peers", docs/Hybrid-EP_Implementation.md;
    deepseek-ai/DeepEP branch hybrid-ep, commit 94a9f8f).  With the experts laid out contiguously over the
    EP ranks a node holds ``E_n = n_experts k / p`` of them; a token reaches ``M`` of the ``N = ceil(p / k)``
    nodes (all N; with node-limited routing, ``n_expert_groups``/``n_limited_groups``,
    ``M = min(N, n_limited_groups * max(1, group size / E_n))``), and with its top_k experts spread
    uniformly over those it hits ``D = M (1 - (1 - 1/M)^top_k)`` distinct nodes on average (occupancy),
    ``D (N-1)/N`` of them remote.  Share = that many token copies / top_k.  The combine is the reverse path
    (reduced per node before the network), so it moves as much.  The NVLink fan-out is
    :func:`nvlink_relay`.

    ``once_per_node`` None: once per node exactly when the routing is node-limited (the rule before the
    workload key ``ep_dispatch``; `step_time` passes :func:`sends_once_per_node`).
    """
    p = np.asarray(ep, dtype=np.float64)
    k = np.minimum(np.asarray(per_node, dtype=np.float64), p)
    uniform = (p - k) / p
    limited = node_limited(model)
    if not (limited if once_per_node is None else once_per_node):
        return uniform
    nodes = np.ceil(p / np.maximum(k, 1.0))
    reach = nodes
    if limited:
        per_node_experts = model.n_experts * k / p
        group = model.n_experts / model.n_expert_groups
        reach = np.minimum(nodes, model.n_limited_groups * np.maximum(1.0, group / per_node_experts))
    distinct = reach * (1.0 - (1.0 - 1.0 / reach) ** model.top_k)
    once = distinct * (nodes - 1.0) / nodes / model.top_k
    return np.where(nodes > 1, np.minimum(once, uniform), uniform)


def nvlink_relay(model, ep, per_node, once_per_node: bool, rail_optimized: bool) -> np.ndarray:
    """[n] the ``relay`` factor of `comm.all_to_all_time`: NVLink bytes per off-node byte, over (k-1)/k.

    Every copy sent: 1 on a rail-optimized network (NCCL's PXN first moves a copy for another rail's GPU
    over NVLink to the local GPU on that rail), else 0.  Once per node: each network copy lands on the
    peer GPU, which writes the token over NVLink to every other GPU of its node that holds one of its
    experts (DeepEP's and Hybrid-EP's forwarding, see :func:`ib_share`; the combine gathers them back the
    same way), so the NVLink side carries every remote copy, (p - k)/p of the bytes, times (k-1)/k -- the
    relay is (p - k)/p over the once-per-node share.  (DeepEP writes a token once per destination GPU, not
    once per expert; with several of a token's experts on one GPU that is less, which this ignores.)"""
    rail = np.full(np.shape(ep), float(rail_optimized))
    if not once_per_node:
        return rail
    p = np.asarray(ep, dtype=np.float64)
    k = np.minimum(np.asarray(per_node, dtype=np.float64), p)
    share = ib_share(model, ep, per_node, True)
    return np.where(share > 0, (p - k) / p / np.maximum(share, 1e-300), rail)


def a2a_overlap_runs(table, workload) -> np.ndarray:
    """[n] True where Megatron's EP all-to-all overlap (workload ``ep_a2a_overlap: combined_1f1b``) runs:
    its TransformerConfig checks (megatron/core/transformer/transformer_config.py) ask for EP > 1, a
    virtual pipeline when pp > 1 (here: Interleaved1F1B), no full recompute and no 'moe' in
    recompute_modules; and the combined schedule needs a second micro-batch to pair with.  The scalar
    twin is :func:`a2a_overlap_blocker`."""
    if workload.ep_a2a_overlap != "combined_1f1b":
        return np.zeros(len(table), dtype=bool)
    moe_rec = table.is_ac("selective") & workload.recomputes("moe")
    return ((table.ep > 1) & ((table.pp == 1) | table.is_schedule("Interleaved1F1B")) & ~table.is_ac("full")
            & ~moe_rec & (table.n_microbatches >= 2))


def a2a_overlap_blocker(plan, workload) -> str | None:
    """Why `plan` keeps its all-to-alls exposed although the workload asks for ``combined_1f1b`` (one
    phrase), or None when the overlap runs or is not asked for; the scalar twin of :func:`a2a_overlap_runs`."""
    if workload.ep_a2a_overlap != "combined_1f1b":
        return None
    for bad, why in ((plan.ep <= 1, "ep 1: no all-to-all"),
                     (plan.pp > 1 and plan.schedule != "Interleaved1F1B",
                      f"schedule {plan.schedule} with pp {plan.pp}: Megatron overlaps under an interleaved "
                      "pipeline only"),
                     (plan.ac == "full", "ac full: Megatron refuses full recompute with the overlap"),
                     (plan.ac == "selective" and workload.recomputes("moe"),
                      "recompute module 'moe': Megatron refuses it with the overlap"),
                     (plan.n_microbatches < 2, "one micro-batch: no second one to pair with")):
        if bad:
            return why
    return None


def ep_all_to_all_bytes(table, model, workload, coeffs) -> np.ndarray:
    """[n] bytes the busiest EP rank (of the most MoE-heavy pipeline rank) sends in all-to-alls per
    optimizer step; with ``coeffs.ep_imbalance == 1`` every EP rank sends that much.  Every routed copy
    (workload ``ep_dispatch: every_copy``, what titan-run measures); a once-per-node dispatch sends
    :func:`ib_share` of the off-node part instead."""
    if not model.is_moe:
        return np.zeros(len(table))
    elt = 4.0 if workload.dtype == "fp32" else 2.0
    tokens = table.microbatch * float(workload.seq_len) / table.cp
    sp = table.tp if workload.sequence_parallel else np.ones(len(table))
    # one all-to-all of one block, averaged over dispatch/combine (see above): own tokens out in
    # dispatch, ep_imbalance x as many back in combine
    one = tokens / sp * model.top_k * model.dim * elt * (1.0 + coeffs.ep_imbalance) / 2.0
    _, n_moe = layer_mix(table, model, first=False, weighted=workload.pp_weighted)
    passes = 4.0 + 2.0 * table.is_ac("full")          # dispatch + combine: forward, backward, recompute
    return np.where(table.ep > 1, n_moe * table.n_microbatches * passes * one, 0.0)


__all__ = ["a2a_overlap_blocker", "a2a_overlap_runs", "ep_all_to_all_bytes", "ib_share", "node_limited",
           "nvlink_relay", "sends_once_per_node"]
