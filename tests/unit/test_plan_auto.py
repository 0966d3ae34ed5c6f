"""parallel=auto (suite.plan.auto) and the fit check of `suite pretrain` (suite.plan.fit), in process:
the layout chosen for the launched world, what is written into the config, the walk past layouts
the trainer refuses, and when a recipe is (and is not) stopped for memory."""

from __future__ import annotations

import json

import pytest
import torch

from suite.cli.common import _compose
from suite.config.errors import ConfigError
from suite.plan.auto import PARALLEL_KEYS, choose_layout
from suite.plan.cost import GIB
from suite.plan.fit import FIT_MARGIN, check_fits, estimate_fit, plan_command
from suite.preflight import validate
from tests.helpers import TINY_MODEL

TINY = [*TINY_MODEL, "data.vocab_size=512", "train.device=cpu", "parallel=auto"]


def _raw(*overrides: str):
    return _compose([*TINY, *overrides])[0]


@pytest.fixture(scope="module")
def world4():
    return choose_layout(_raw("launch.nproc_per_node=4", "parallel.global_batch_size=16"))


def test_auto_picks_the_fastest_layout_of_the_launched_world_and_writes_it_in(world4):
    layout, cfg = world4.cost.layout, world4.cfg
    assert world4.job.world == layout.world == 4
    assert world4.cost is world4.result.ranked[0] and not world4.refused
    p = cfg.parallel
    assert p.auto is False and p.global_batch_size == 16  # the recipe's global batch stays
    assert (p.dp, p.sharding, p.tp, p.pp, p.cp, p.ep) == (
        layout.dp, layout.sharding, layout.tp, layout.pp, layout.cp, layout.ep,
    )  # fmt: skip
    assert p.micro_batch_size == layout.micro_batch and cfg.recompute.granularity == layout.recompute
    assert 16 % (layout.micro_batch * layout.data_ranks) == 0
    assert validate(cfg, needs_data=False, writes_run=False).world_size == 4
    assert world4.raw.parallel.sharding == p.sharding  # the config.yaml a run writes shows it


def test_the_line_names_the_layout_why_and_where_the_table_is(world4, tmp_path):
    path = world4.write(tmp_path / "run")
    line = world4.line(str(path))
    assert "\n" not in line and world4.cost.layout.name in line and str(path) in line
    assert "fastest of" in line and "next shape" in line
    saved = json.loads(path.read_text())
    assert saved["chosen"]["layout"] == world4.cost.layout.name
    assert saved["ranked"][0]["layout"] == world4.cost.layout.name and saved["world"] == 4
    assert "recompute=" in saved["chosen_overrides"]


def test_a_small_global_batch_leaves_the_rest_of_the_world_to_model_parallelism():
    choice = choose_layout(_raw("launch.nproc_per_node=4", "parallel.global_batch_size=2"))
    layout = choice.cost.layout
    assert layout.world == 4 and layout.data_ranks <= 2 and 2 % (layout.micro_batch * layout.data_ranks) == 0


def test_layouts_the_trainer_refuses_are_passed_over(world4):
    first = world4.result.ranked[0].layout.name

    def refuse_first(cfg):
        pc = world4.cost.layout.parallel_config(16)
        same = all(getattr(cfg.parallel, k) == getattr(pc, k) for k in PARALLEL_KEYS)
        if same and cfg.recompute.granularity == world4.cost.layout.recompute:
            raise ConfigError("not this one")

    raw = _raw("launch.nproc_per_node=4", "parallel.global_batch_size=16")
    choice = choose_layout(raw, validate_fn=refuse_first)
    assert choice.refused == [(first, "not this one")] and choice.cost.layout.name != first
    assert "1 faster refused by the trainer, e.g. " + first in choice.line("x")

    def refuse_all(cfg):
        raise ConfigError("never")

    with pytest.raises(ConfigError, match="the trainer refuses the .* fastest .* never"):
        choose_layout(raw, validate_fn=refuse_all)


def test_auto_refuses_what_it_cannot_plan():
    with pytest.raises(ConfigError, match="elastic"):
        choose_layout(_raw("launch.nproc_per_node=2:4"))
    with pytest.raises(ConfigError, match="pass cluster=cpu"):
        choose_layout(_raw("launch.nproc_per_node=2", "cluster=h100-80g"))


def _fit(*overrides: str):
    _, cfg = _compose(["train.device=cpu", *overrides])
    dims = validate(cfg, needs_data=False, writes_run=False)
    return cfg, dims


@pytest.mark.parametrize("recipe", ["gpt-tiny", "llama-tiny", "moe-tiny", "sft-tiny"])
def test_the_tiny_recipes_are_not_stopped(recipe):
    cfg, dims = _fit(f"recipe={recipe}")
    fit = check_fits(cfg, dims, [f"recipe={recipe}"])
    assert fit is not None and not fit.clearly_too_big and fit.need < 2 * GIB


def test_only_a_clear_excess_stops_a_run(monkeypatch):
    """Just above the memory (within FIT_MARGIN) runs; beyond it, a one-line ConfigError that names
    the smallest cluster of the cluster group and the `suite plan` line for its table."""
    cfg, dims = _fit("recipe=gpt-tiny", "launch.nproc_per_node=2", "parallel=ddp")
    need = estimate_fit(cfg, dims).need
    monkeypatch.setattr("suite.parallel.hosting.available_ram", lambda: 2 * need / (0.5 + FIT_MARGIN / 2))
    assert check_fits(cfg, dims, []).need == need  # need > have, but not clearly: not blocked
    monkeypatch.setattr("suite.parallel.hosting.available_ram", lambda: 2 * need / (2 * FIT_MARGIN))
    with pytest.raises(ConfigError) as caught:
        check_fits(cfg, dims, ["recipe=gpt-tiny", "launch.nproc_per_node=2", "model.num_layers=4"])
    text = str(caught.value)
    assert "\n" not in text and "world size 2" in text and "dp2-mb8" in text
    assert "it needs at least 2 x cpu (cluster=cpu cluster.nodes=1" in text
    assert "`suite plan recipe=gpt-tiny model.num_layers=4 cluster=cpu cluster.nodes=1`" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer: this machine's RAM, the cpu preset")
def test_gpt175b_on_this_machine_names_the_cluster_it_needs():
    cfg, dims = _fit("recipe=gpt175b")
    with pytest.raises(ConfigError, match=r"it needs at least 1024 x cpu \(cluster=cpu cluster.nodes=512"):
        check_fits(cfg, dims, ["recipe=gpt175b"])
    cfg, dims = _fit("recipe=gpt175b", "cluster=h100-80g")
    with pytest.raises(
        ConfigError, match=r"at least \d+ x h100-80g .*`suite plan recipe=gpt175b cluster=h100-80g"
    ):
        check_fits(cfg, dims, ["recipe=gpt175b", "cluster=h100-80g"])


def test_the_plan_command_keeps_what_defines_the_job():
    _, cfg = _compose(["recipe=gpt13b"])
    line = plan_command(
        cfg,
        ["recipe=gpt13b", "model.num_layers=8", "launch.nnodes=2", "run.dir=x", "train.precision=fp32",
         "parallel.tp=2", "parallel.global_batch_size=64", "cluster.nodes=3"],
        5,
    )  # fmt: skip
    assert line == (
        "suite plan recipe=gpt13b model.num_layers=8 train.precision=fp32 parallel.global_batch_size=64 "
        "cluster=cpu cluster.nodes=5"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a CPU run with a GPU cluster group")
def test_a_dry_run_plans_for_the_cluster_group_whatever_this_machine_is():
    raw = _compose(["recipe=gpt13b", "cluster=h100-80g", "parallel=auto"])[0]
    with pytest.raises(ConfigError, match="pass cluster=cpu"):
        choose_layout(raw)  # a real run here would train on this CPU
    choice = choose_layout(raw, here=False)
    assert choice.job.world == choice.cost.layout.world == 32 and choice.job.cluster.memory_gib == 79.1
    assert choice.cfg.parallel.global_batch_size == 1024 and choice.cost.memory.fits


@pytest.mark.parametrize("verb", ["finetune", "distill"])
def test_finetune_and_distill_refuse_auto_in_one_line(verb, capsys):
    from suite.cli import main

    assert main([verb, "parallel=auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: parallel=auto is for suite pretrain; suite {verb}")
