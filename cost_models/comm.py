"""Collective communication: alpha-beta costs and which link each mesh axis uses.

Alpha-beta (Hockney) model of ring collectives, as in Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005), Sec. 4
(and Chan et al. 2007): for p ranks, message size n bytes (the full, unsharded
buffer), link latency alpha and bandwidth beta^-1 = bw:

    all-gather / reduce-scatter (ring):  (p-1)*alpha + (p-1)/p * n / bw
    all-reduce (ring = RS + AG):        2*(p-1)*alpha + 2*(p-1)/p * n / bw
    all-to-all (pairwise):               (p-1)*alpha + (p-1)/p * n / bw   (n = bytes a rank sends)
    point-to-point:                      alpha + n / bw

Every function takes numpy arrays (or scalars) and broadcasts.

Mesh placement (`axis_links`): TorchTitan builds the device mesh with axes ordered
outermost -> innermost ``pp, dp_replicate, dp_shard, cp, tp`` (consecutive ranks share
a node).  An axis of degree p whose inner axes multiply to `stride` has its group
inside one node iff ``p * stride <= gpus_per_node``.  Otherwise the ring crosses nodes;
``k = max(1, gpus_per_node // stride)`` members of the group share each node.  A ring
with k members per node crosses each node boundary once per step, and NCCL stripes
the rings of a collective over all NICs of the node (one per GPU, rail-optimized), so
the ``gpus_per_node/k`` groups that run concurrently in a node share the node's
``gpus_per_node`` NICs: each group gets ``k * inter_bw`` -- but no more than the
intra-node link it also traverses.  Hence the effective bandwidth of a cross-node
axis is ``min(k * inter_bw, intra_bw)`` and its latency is the inter-node one.  For
all-to-all the traffic is not a ring: a rank's off-node share ``(p-k)/p`` goes through
its own NIC at ``inter_bw`` and its on-node share at ``intra_bw`` (`all_to_all_time`).

Latency of a cross-node ring: of its ``p-1`` steps only ``N-1`` cross a node boundary
(``N = ceil(p/k)`` nodes); the other ``p-N`` are NVLink hops.  This is NCCL's own cost
model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel: ring latency
``(nsteps - nInterSteps) * intraLat + nInterSteps * interLat`` with ``nsteps = nRanks-1``,
``nInterSteps = nNodes-1`` for all-gather / reduce-scatter), i.e. the hierarchical
(NVLink inside, network between nodes) shape of the ring.  `Link.alpha` is the per-step
average, so ``(p-1) * alpha`` is that sum; a point-to-point transfer to another node pays
the full network latency (`Link.p2p_alpha`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from search_spaces.plan import MESH_AXES as AXIS_ORDER  # innermost last: TorchTitan's ParallelDims mesh order

from .layout import representatives

# the table columns a candidate's groups and their links depend on: the mesh degrees
MESH_COLUMNS = tuple(dict.fromkeys(AXIS_ORDER + ("ep",)))


# --------------------------------------------------------------------------- collectives
def ring_gather_time(p, nbytes, bw, alpha):
    """All-gather or reduce-scatter of an `nbytes` (full size) buffer over p ranks."""
    p = np.asarray(p, dtype=np.float64)
    return np.where(p > 1, (p - 1) * alpha + (p - 1) / p * nbytes / bw, 0.0)


def all_reduce_time(p, nbytes, bw, alpha, tree_latency=None):
    """Ring all-reduce = reduce-scatter + all-gather.  With `tree_latency` (a Link's), NCCL's choice
    between ring and tree: the same bus bandwidth, the smaller latency (tuning.cc picks the faster
    algorithm per call; the tree's latency grows with log2 of the nodes, the ring's linearly)."""
    ring = 2.0 * ring_gather_time(p, nbytes, bw, alpha)
    if tree_latency is None:
        return ring
    p = np.asarray(p, dtype=np.float64)
    ring_lat = 2.0 * (p - 1) * alpha
    return np.where(p > 1, ring - ring_lat + np.minimum(ring_lat, tree_latency), 0.0)


def p2p_time(nbytes, bw, alpha):
    return alpha + nbytes / bw


def all_to_all_time(p, nbytes, k, intra_bw, intra_alpha, inter_bw, inter_alpha, *, relay=0.0, off_fraction=None):
    """All-to-all where each rank sends `nbytes` in total (1/p of it to each rank, itself included);
    k = group members on the rank's node (k >= p: all intra-node).  The on-node and off-node parts
    proceed concurrently on their links; the slower one sets the time.  Uneven all-to-alls (MoE
    dispatch/combine under router imbalance): pass the busiest rank's larger direction -- links are
    full duplex, so the rank that receives (dispatch) or sends back (combine) ep_imbalance x the mean
    sets the time, although it sends only the mean in dispatch (see `moe_traffic.py`).

    `off_fraction`: the share of `nbytes` that leaves the node (default (p-k)/p, uniform
    destinations; node-limited MoE routing sends less, `moe_traffic.ib_copies_per_token`).
    `relay` = 1 on a rail-optimized network: a message for a GPU on another rail first crosses
    NVLink to the local GPU on that rail, then the network (NCCL's PXN, NCCL 2.12 release notes;
    NVIDIA blog "Doubling all2all Performance with NVIDIA Collective Communication Library 2.12",
    2022), so (k-1)/k of the off-node bytes also load the NVLink side."""
    p = np.asarray(p, dtype=np.float64)
    k = np.minimum(np.asarray(k, dtype=np.float64), p)
    off_share = (p - k) / p if off_fraction is None else np.asarray(off_fraction, dtype=np.float64)
    on_share = (k - 1) / p + relay * off_share * (k - 1) / np.maximum(k, 1.0)
    on = on_share * nbytes / intra_bw + (k - 1) * intra_alpha
    off = off_share * nbytes / inter_bw + (p - k) * inter_alpha
    return np.where(p > 1, np.maximum(on, off), 0.0)


# --------------------------------------------------------------------------- links
@dataclass(frozen=True)
class Link:
    """Per-candidate arrays: effective collective bandwidth (B/s), latency (s), intra-node mask,
    group members per node, and the bandwidth of one point-to-point transfer (a single GPU's
    NVLink, or its own NIC when the peer is on another node)."""

    bw: np.ndarray
    alpha: np.ndarray          # per ring step (the NCCL-style average over NVLink and network steps)
    intra: np.ndarray
    per_node: np.ndarray
    p2p_bw: np.ndarray
    p2p_alpha: np.ndarray      # one point-to-point transfer: the link it crosses
    tree_latency: np.ndarray   # NCCL tree all-reduce latency: 2((k-1) intra + log2(nodes) inter)


def link_params(hw, coeffs) -> dict[str, float]:
    """Achievable bandwidth (B/s) and latency (s) of the two link levels."""
    e = hw.efficiency
    return {
        "intra_bw": hw.intra_node_bw_gbs * 1e9 * e["comm_intra"] * coeffs.intra_bw_scale,
        "inter_bw": hw.inter_node_bw_gbs * 1e9 * e["comm_inter"] * coeffs.inter_bw_scale,
        "intra_alpha": hw.intra_node_latency_us * 1e-6 * coeffs.intra_latency_scale,
        "inter_alpha": hw.inter_node_latency_us * 1e-6 * coeffs.inter_latency_scale,
    }


def group_link(degree, stride, hw, coeffs) -> Link:
    """Link of a group of `degree` ranks spaced `stride` apart in the rank order."""
    lp = link_params(hw, coeffs)
    gpn = hw.gpus_per_node
    degree = np.asarray(degree, dtype=np.int64)
    stride = np.asarray(stride, dtype=np.int64)
    intra = degree * stride <= gpn
    k = np.maximum(1, gpn // np.maximum(stride, 1))
    cross_bw = np.minimum(k * lp["inter_bw"], lp["intra_bw"])
    bw = np.where(intra, lp["intra_bw"], cross_bw)
    per_node = np.where(intra, degree, np.minimum(k, degree))
    # NCCL ring latency (module docstring): N-1 network steps and p-N NVLink steps of p-1
    nodes = np.ceil(degree / np.maximum(per_node, 1))
    steps = np.maximum(degree - 1, 1)
    ring_alpha = ((degree - nodes) * lp["intra_alpha"] + (nodes - 1) * lp["inter_alpha"]) / steps
    alpha = np.where(intra, lp["intra_alpha"], ring_alpha)
    p2p_alpha = np.where(intra, lp["intra_alpha"], lp["inter_alpha"])
    # NCCL tree (tuning.cc: 2 * ((nRanks/nNodes - 1) * intraLat + log2i(nNodes) * interLat)): a chain
    # over NVLink inside each node, a binary tree across nodes
    tree_latency = 2.0 * ((np.minimum(per_node, degree) - 1) * lp["intra_alpha"]
                          + np.floor(np.log2(np.maximum(nodes, 1))) * lp["inter_alpha"])
    p2p_bw = np.where(intra, lp["intra_bw"], lp["inter_bw"])
    return Link(bw=bw.astype(np.float64), alpha=alpha.astype(np.float64), intra=intra, per_node=per_node,
                p2p_bw=p2p_bw.astype(np.float64), p2p_alpha=p2p_alpha.astype(np.float64),
                tree_latency=tree_latency.astype(np.float64))


class LinkAt:
    """A `Link` computed for a table's representative candidates (one per mesh), read at every candidate: each
    field is gathered on first use (a term reads two or three of the seven)."""

    __slots__ = ("_link", "_inverse", "_fields")

    def __init__(self, link: Link, inverse: np.ndarray):
        self._link, self._inverse, self._fields = link, inverse, {}

    def __getattr__(self, name: str) -> np.ndarray:
        if name.startswith("_"):       # an unset slot (copy, pickle): not a field of the link
            raise AttributeError(name)
        fields = self._fields
        if name not in fields:
            fields[name] = getattr(self._link, name)[self._inverse]
        return fields[name]


def axis_links(table, hw, coeffs, ep_stride_tp: bool = True) -> dict[str, Link]:
    """`mesh_links` of each distinct mesh of a candidate table, read at every candidate (`LinkAt`)."""
    if hasattr(table, "take") and len(table) > 1:
        sub, inverse = representatives(table, MESH_COLUMNS)
        if len(sub) < len(table):
            return {k: LinkAt(v, inverse) for k, v in mesh_links(sub, hw, coeffs, ep_stride_tp).items()}
    return mesh_links(table, hw, coeffs, ep_stride_tp)


def mesh_links(table, hw, coeffs, ep_stride_tp: bool = True) -> dict[str, Link]:
    """Link of each mesh axis, plus the derived groups the parallelisms use:

    * ``fsdp``: dp_shard x cp flattened (FSDP2 shards dense weights over it), stride tp;
    * ``ep``: the innermost ``ep`` ranks of dp_shard x cp (TorchTitan carves EP from
      dp_shard and cp), stride tp; with `ep_stride_tp` False (workload ``ep_stride_tp``: Megatron-core's whole
      experts) ``ep`` consecutive ranks, across the TP ranks first;
    * ``efsdp``: the remaining dp_shard*cp/ep ranks that FSDP-shard the experts, stride ep*tp;
    * ``dp``: dp_replicate x dp_shard as one group (the Megatron data-parallel group), stride cp*tp.
    """
    deg = {a: getattr(table, a) for a in AXIS_ORDER}
    out: dict[str, Link] = {}
    stride = np.ones(len(table), dtype=np.int64)
    for a in reversed(AXIS_ORDER):
        out[a] = group_link(deg[a], stride, hw, coeffs)
        stride = stride * deg[a]
    tp, cp, ep = table.tp, table.cp, table.ep
    out["fsdp"] = group_link(table.fsdp_size, tp, hw, coeffs)
    out["ep"] = group_link(ep, tp if ep_stride_tp else np.ones_like(tp), hw, coeffs)
    out["efsdp"] = group_link(table.expert_fsdp_size, ep * tp, hw, coeffs)
    out["dp"] = group_link(table.dp, cp * tp, hw, coeffs)
    return out
