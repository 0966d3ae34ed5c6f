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
        ("cluster.time_share=0", "cluster.time_share=0.0 must be in"),
        ("cluster.inter_node_bandwidth_gbs=-1", "cluster.inter_node_bandwidth_gbs"),
        ("cluster.reserved_gib=100", "cluster.reserved_gib"),
        ("cluster.collective_efficiency.all_gatherr=0.5", "cluster.collective_efficiency.all_gatherr"),
        (
            "cluster.collective_efficiency.all_gather=0",
            "cluster.collective_efficiency.all_gather=0.0 must be in",
        ),
    ],
)
def test_bad_cluster_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_values(_cluster("cluster=a100-40g", override))


def test_every_collective_has_a_factor_the_command_line_can_set():
    """Every preset carries all five (1.0 unless measured otherwise), so `cluster.collective_efficiency.X=`
    overrides it; the cpu preset's gloo figures are below 1; a name that is not a collective is named."""
    for name in PRESETS:
        factors = _cluster(f"cluster={name}").cluster.collective_efficiency
        assert set(factors) == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv"}
    cpu = _cluster("cluster=cpu").cluster.collective_efficiency
    assert cpu["reduce_scatter"] < 1 and cpu["all_gather"] < 1 and cpu["all_reduce"] == 1.0
    assert (
        _cluster(
            "cluster=h100-80g", "cluster.collective_efficiency.all_reduce=0.8"
        ).cluster.collective_efficiency["all_reduce"]
        == 0.8
    )
    cfg = _cluster("cluster=cpu")
    cfg.cluster.collective_efficiency["allreduce"] = 0.5  # e.g. from a hand-built config
    with pytest.raises(
        ConfigError, match="collective_efficiency.allreduce=0.5: not a collective; use one of"
    ):
        check_values(cfg)


def test_gpu_presets_bound_host_memory_per_node_from_the_data_sheets():
    """DGX A100 640GB, DGX H100 and DGX H200: 2 TB of system memory per node; DGX A100 320GB: 1 TB.
    The cpu preset leaves it unbounded (offload is not searched there)."""
    expected = {"a100-40g": 1024, "a100-80g": 2048, "h100-80g": 2048, "h200": 2048}
    for name, gib in expected.items():
        c = _cluster(f"cluster={name}").cluster
        assert c.host_memory_gib == gib and c.host_memory_bandwidth_gbs > 100, name
    assert _cluster("cluster=cpu").cluster.host_memory_gib is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.host_memory_gib=0", "cluster.host_memory_gib=0.0 must be positive GiB per node"),
        ("cluster.host_memory_bandwidth_gbs=-1", "cluster.host_memory_bandwidth_gbs=-1.0 must be positive"),
    ],
)
def test_bad_host_memory_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        check_values(_cluster("cluster=a100-80g", override))
