"""The cluster config group: presets compose against ClusterConfig, with the issue's figures, and bad
values are refused with one line naming the key."""

from __future__ import annotations

import pytest

from suite.config.compose import compose_config, known_options, to_object
from suite.config.errors import ConfigError
from suite.config.validate import check_values

PRESETS = ("a100-40g", "a100-80g", "h100-80g", "h200", "cpu")


def _cluster(*overrides: str):
    return to_object(compose_config(list(overrides)))


def test_every_preset_is_shipped_and_composes():
    assert set(PRESETS) <= set(known_options("cluster"))
    for name in PRESETS:
        cfg = _cluster(f"cluster={name}")
        check_values(cfg)
        assert cfg.cluster.name == name
        assert cfg.cluster.memory_gib > cfg.cluster.reserved_gib


def test_a100_40g_has_the_issue_figures():
    c = _cluster("cluster=a100-40g", "cluster.nodes=48").cluster
    assert c.nodes == 48 and c.devices_per_node == 8
    assert c.peak_flops["bf16"] == 312e12
    assert c.intra_node_bandwidth_gbs * 2 == 600  # NVLink 600 GB/s counts both directions
    assert c.inter_node_bandwidth_gbs == 8 * 200 / 8  # 8 x 200 Gb/s in GB/s


def test_default_cluster_is_this_cpu():
    assert _cluster().cluster.name == "cpu"


@pytest.mark.parametrize(
    "override, key",
    [
        ("cluster.nodes=0", "cluster.nodes"),
        ("cluster.compute_efficiency=1.5", "cluster.compute_efficiency"),
        ("cluster.inter_node_bandwidth_gbs=-1", "cluster.inter_node_bandwidth_gbs"),
        ("cluster.reserved_gib=100", "cluster.reserved_gib"),
        ("+cluster.collective_efficiency.all_gatherr=0.5", "cluster.collective_efficiency.all_gatherr"),
        ("+cluster.collective_efficiency.all_gather=0", "cluster.collective_efficiency.all_gather"),
    ],
)
def test_bad_cluster_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_values(_cluster("cluster=a100-40g", override))
