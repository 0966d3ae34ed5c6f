"""`suite plan` end to end in process: the search's invariants, the CLI's table, --json, --explain,
--help, and one-line errors (exit 2, no traceback) for bad input."""

from __future__ import annotations

import json

import pytest

from suite.cli import main
from suite.config.compose import compose_config, to_object
from suite.plan.cost import evaluate
from suite.plan.layout import Job, Layout, check_layout, parse_layout
from suite.plan.search import search

GPT13B = ["recipe=gpt13b", "cluster=h100-80g", "cluster.nodes=4"]


def _job(*overrides: str) -> Job:
    return Job.from_config(to_object(compose_config(list(overrides))))


@pytest.fixture(scope="module")
def gpt13b_search():
    job = _job(*GPT13B)
    return job, search(job)


def test_ranked_layouts_are_valid_fit_and_sorted(gpt13b_search):
    job, result = gpt13b_search
    assert result.ranked and result.too_big and result.invalid
    times = [c.time.total for c in result.ranked]
    assert all(b >= a / 1.0011 for a, b in zip(times, times[1:]))  # sorted, up to the 0.1% tie band
    for cost in result.ranked[:50]:
        check_layout(job, cost.layout)
        assert cost.memory.fits and cost.layout.world == job.world == 32
    assert all(not c.memory.fits for c in result.too_big)


def test_the_winner_beats_the_recipes_own_layout(gpt13b_search):
    job, result = gpt13b_search
    recipe = Layout(
        sharding=2, stage=1, tp=8, sp=True, pp=2, micro_batch=1, recompute="full"
    )  # recipes/recipe/gpt13b
    check_layout(job, recipe)
    assert result.best.time.total <= evaluate(job, recipe).time.total


def test_cli_table_json_and_explain_agree(capsys):
    assert main(["plan", *GPT13B, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["ranked"][0]
    assert best["fits"] and out["world"] == 32 and out["overrides"].startswith("parallel.dp=")
    assert main(["plan", *GPT13B, "--explain", best["layout"], "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["time_s"]["total"] == pytest.approx(best["time_s"]["total"])
    assert one["memory_gib"]["total"] == pytest.approx(best["memory_gib"]["total"])
    assert main(["plan", *GPT13B]) == 0
    text = capsys.readouterr().out
    assert best["layout"] in text and "winner" in text and "MFU" in text
    assert main(["plan", *GPT13B, f"--explain={best['layout']}"]) == 0
    assert "pipeline bubble" in capsys.readouterr().out


def test_explain_names_the_collectives_a_link_runs_slower(capsys):
    """The cpu preset's gloo factors (cluster.collective_efficiency) show beside the link they slow;
    a GPU preset's links, at 1.0 throughout, show bare."""
    assert main(["plan", "recipe=gpt-tiny", "cluster=cpu", "--explain", "sh2z3-mb2"]) == 0
    links = capsys.readouterr().out.splitlines()[-1]
    assert (
        links.startswith("links: sharding 2 ranks on")
        and "(1.4 GB/s; all_gather x0.52; reduce_scatter x0.39)" in links
    )
    # half a core per process: the links run at half their bandwidth, and the job line says why
    assert (
        main(["plan", "recipe=gpt-tiny", "cluster=cpu", "cluster.time_share=0.5", "--explain", "sh2z3-mb2"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert "0.5 of a core per process: time-shared" in lines[0] and "(0.7 GB/s; all_gather" in lines[-1]
    assert main(["plan", *GPT13B, "--explain", "tp8sp-pp4-mb1"]) == 0
    links = capsys.readouterr().out.splitlines()[-1]
    assert "tp 8 ranks on nvlink" in links and " x" not in links


def test_help_names_the_keys_and_clusters(capsys):
    assert main(["plan", "--help"]) == 0
    text = capsys.readouterr().out
    assert "cluster.nodes" in text and "h100-80g" in text and "--explain" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["cluster=h100"], "cluster='h100' is not a known cluster (did you mean"),
        (["cluster.nodes=0"], "cluster.nodes=0 must be a positive integer"),
        (["cluster.nodez=2"], "unknown key 'cluster.nodez'"),
        ([*GPT13B, "--explain", "tp8-qq"], "cannot read 'qq'"),
        ([*GPT13B, "--explain", "tp3-mb1"], "uses 3 devices but the cluster has 32"),
        ([*GPT13B, "--explain", "tp8sp-pp4-mb512"], "1f1b needs at least parallel.pp=4 micro-batches"),
        ([*GPT13B, "--explain"], "--explain needs a value"),
        ([*GPT13B, "--explainn=x"], "unknown flag --explainn=x"),
        (["recipe=gpt175b", "cluster=cpu"], "the smallest cpu cluster it fits is cluster.nodes="),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    code = main(["plan", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_nothing_fits_names_the_smallest_cluster(capsys):
    assert main(["plan", "recipe=gpt6.7b", "cluster=a100-40g", "cluster.devices_per_node=1"]) == 2
    err = capsys.readouterr().err
    assert "no layout of gpt6.7b fits 1 x 1 a100-40g" in err and "cluster.nodes=" in err


def test_cpu_cluster_overlaps_no_communication():
    job = _job("recipe=gpt-tiny", "cluster=cpu")
    cost = evaluate(job, Layout(dp=2, micro_batch=8))
    assert not job.cluster.comm_overlap and cost.time.data > 0  # the gradient all-reduce is exposed
    gpu = _job("recipe=gpt-tiny", "cluster=cpu", "cluster.comm_overlap=true")
    assert evaluate(gpu, Layout(dp=2, micro_batch=8)).time.data < cost.time.data


GPT175B_ONE_NODE = ["recipe=gpt175b", "cluster=a100-80g", "cluster.nodes=1"]


def test_offload_beyond_the_nodes_host_memory_fits_nowhere(capsys):
    """Issue 39: one 8 x A100-80G node ranked first a ZeRO-3 offload layout whose ranks' host state
    is ~5.2 TiB against the node's 2 TiB. Now nothing fits, and the one line says it is host memory."""
    assert main(["plan", *GPT175B_ONE_NODE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "no layout of gpt175b fits 1 x 8 a100-80g (77.2 GiB usable per device, 2048 GiB host memory" in err
    assert "fits the devices (17.9 GiB) but not host memory: 2602 GiB of host memory per node > 2048" in err
    assert "the smallest a100-80g cluster it fits is cluster.nodes=2" in err


def test_explain_shows_the_host_memory_an_offloaded_layout_needs(capsys):
    assert main(["plan", *GPT175B_ONE_NODE, "--explain", "sh4z3off-cp2-mb1"]) == 0
    out = capsys.readouterr().out
    assert (
        "host memory per node (its 8 ranks' offloaded state): 5203.6 GiB of 2048 (cluster.host_memory_gib): "
        "does NOT fit: the search drops this layout" in out
    )
    job = _job(*GPT175B_ONE_NODE)
    memory = evaluate(job, parse_layout("sh4z3off-cp2-mb1")).memory
    assert memory.fits_device and not memory.fits_host and not memory.fits


def test_ranked_offload_layouts_fit_their_nodes_host_memory():
    """Two nodes: offload fits, and every ranked layout's host state fits its node's 2 TiB; the
    layouts dropped for host memory alone are counted in the table's second line."""
    job = _job("recipe=gpt175b", "cluster=a100-80g", "cluster.nodes=2")
    result = search(job, recompute=("full",), micro_batches=(1, 2))
    offloaded = [c for c in result.ranked if c.layout.offload]
    assert offloaded and all(c.memory.host * 8 <= 2048 * 2**30 for c in offloaded)
    assert any(c.memory.fits_device and not c.memory.fits_host for c in result.too_big)


def test_offload_prices_the_host_link_and_the_hosts_adamw():
    """FSDP2's CPUOffloadPolicy copies each micro-batch's parameter shard up before every gather
    (twice at stage 3) and the reduced fp32 gradient shard down, over cluster.host_bandwidth_gbs;
    AdamW then runs on the host, over the node's memory bandwidth shared by its 8 ranks. With
    nothing overlapped (comm_overlap=false) the host link's part is exactly those bytes."""
    job = _job("recipe=gpt13b", "cluster=h100-80g", "cluster.nodes=1", "cluster.comm_overlap=false")
    layout = parse_layout("sh8z3off-mb1-full")
    cost = evaluate(job, layout)
    c, shard, m = job.cluster, cost.params_per_device, cost.micro_batches
    per_micro_batch = (2 * shard * job.param_bytes + shard * job.reduce_bytes) / (c.host_bandwidth_gbs * 1e9)
    assert cost.time.offload == pytest.approx(m * per_micro_batch, rel=1e-6) and cost.time.offload > 1.0
    adamw = shard * (2 * 8 + 3 * job.param_bytes) / (c.host_memory_bandwidth_gbs * 1e9 / c.devices_per_node)
    assert cost.time.optimizer == pytest.approx(adamw, rel=1e-6)
    on_device = evaluate(job, parse_layout("sh8z3-mb1-full"))
    assert on_device.time.offload == 0 and cost.time.total > on_device.time.total + cost.time.offload * 0.99
