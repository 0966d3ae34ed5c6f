"""parallel.ep_dispatch: which ep groups the hierarchical all-to-all can run on, and what auto picks.

The exchange itself (and that it matches the flat one) is tests/distributed/test_hierarchical_dispatch.py.
"""

from __future__ import annotations

import pytest

from suite.config.errors import ConfigError
from suite.parallel.dims import ParallelDims
from suite.parallel.hierarchical_dispatch import group_layouts, node_layout, resolve_dispatch


def dims(world: int, **degrees: int) -> ParallelDims:
    full = {"dp": 1, "sharding": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1} | degrees
    return ParallelDims(**full, world_size=world)


def test_node_layout_needs_equal_node_major_blocks():
    assert node_layout([0, 1, 2, 3], per_node=2) == (2, 2)
    assert node_layout([0, 1, 2, 3], per_node=4) == (1, 4)
    assert node_layout([0, 1, 2, 3], per_node=1) == (4, 1)
    assert node_layout([2, 3, 4, 5], per_node=3) is None  # 1 rank on node 0, 3 on node 1
    assert node_layout([0, 2, 4, 6], per_node=4) == (2, 2)  # strided (tp / cp in between)


def test_group_layouts_follow_the_expert_mesh():
    # ep=4 over dp2 x sharding2 on 2 nodes x 2: one group, 2 nodes of 2
    assert group_layouts(dims(4, dp=2, sharding=2, ep=4), per_node=2) == [(2, 2)]
    # ep=2 with tp=2 on 2 nodes x 4: ranks 0,2 | 1,3 | 4,6 | 5,7 -> each group on one node
    assert group_layouts(dims(8, dp=4, tp=2, ep=2), per_node=4) == [(1, 2)] * 4
    # the groups of ep=2 over 6 data ranks on 2 nodes x 3: (0,1) (2,3) (4,5): the middle one straddles
    assert group_layouts(dims(6, dp=6, ep=2), per_node=3) == [(1, 2), (2, 1), (1, 2)]


def test_auto_is_hierarchical_only_across_nodes():
    assert resolve_dispatch("auto", [(2, 2)]) == "hierarchical"
    assert resolve_dispatch("auto", [(1, 4)]) == "flat"
    assert resolve_dispatch("auto", [(1, 2), (2, 1), (1, 2)]) == "flat"
    assert resolve_dispatch("flat", [(2, 2)]) == "flat"
    assert resolve_dispatch("hierarchical", [(1, 4)]) == "hierarchical"  # one node: runs, crosses nothing
    with pytest.raises(ConfigError, match="parallel.ep_dispatch=hierarchical needs"):
        resolve_dispatch("hierarchical", [(1, 2), (2, 1), (1, 2)])
