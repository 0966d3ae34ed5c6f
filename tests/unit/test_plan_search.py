"""`suite plan` end to end in process: the search's invariants, the CLI's table, --json, --explain,
--help, and one-line errors (exit 2, no traceback) for bad input."""

from __future__ import annotations

import json

import pytest

from suite.cli import main
from suite.config.compose import compose_config, to_object
from suite.plan.cost import evaluate
from suite.plan.layout import Job, Layout, check_layout
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
