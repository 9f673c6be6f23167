"""cost_models/comm.py: alpha-beta collective times and where each mesh axis's links lie."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.coefficients import Coefficients
from cost_models.comm import all_reduce_time, all_to_all_time, group_link, p2p_time, ring_gather_time
from cost_models.specs import load_hardware


def test_alpha_beta_collectives_on_known_numbers():
    assert ring_gather_time(8, 1e9, 1e11, 1e-5) == pytest.approx(7e-5 + 7 / 8 * 1e-2)
    assert all_reduce_time(8, 1e9, 1e11, 1e-5) == pytest.approx(2 * (7e-5 + 7 / 8 * 1e-2))
    assert ring_gather_time(1, 1e9, 1e11, 1e-5) == 0.0
    assert p2p_time(1e9, 1e11, 1e-5) == pytest.approx(1e-2 + 1e-5)
    # all intra-node: 7/8 of 0.8 GB at 100 GB/s + 7 latencies
    assert all_to_all_time(8, 8e8, 8, 1e11, 1e-5, 1e10, 2e-5) == pytest.approx(7 / 8 * 8e-3 + 7e-5)
    # 4 of 8 on the node: off-node half at 10 GB/s dominates
    assert all_to_all_time(8, 8e8, 4, 1e11, 1e-5, 1e10, 2e-5) == pytest.approx(4 / 8 * 8e-2 + 4 * 2e-5)


def test_axis_link_placement():
    hw, co = load_hardware("h100-sxm"), Coefficients()
    e = hw.efficiency
    tp8 = group_link(np.array([8]), np.array([1]), hw, co)                 # tp inside a node
    assert tp8.intra[0] and tp8.bw[0] == pytest.approx(hw.intra_node_bw_gbs * 1e9 * e["comm_intra"])
    dp_strided = group_link(np.array([16]), np.array([8]), hw, co)         # one member per node
    assert not dp_strided.intra[0]
    assert dp_strided.bw[0] == pytest.approx(hw.inter_node_bw_gbs * 1e9 * e["comm_inter"])
    dp_dense = group_link(np.array([16]), np.array([1]), hw, co)           # 8 members per node share 8 NICs
    assert dp_dense.bw[0] == pytest.approx(min(8 * hw.inter_node_bw_gbs * e["comm_inter"],
                                               hw.intra_node_bw_gbs * e["comm_intra"]) * 1e9)
    assert dp_dense.p2p_bw[0] == pytest.approx(hw.inter_node_bw_gbs * 1e9 * e["comm_inter"])
