"""Recipes compose, defaults come from the schema, and bad input becomes one clear ConfigError."""

from __future__ import annotations

import pytest

from suite.config.compose import SHIPPED_RECIPES, compose_config, known_options, to_object
from suite.config.errors import ConfigError
from suite.preflight import validate
from suite.runtime import resolve_auto
from tests.suggested_fix import ways_on

GROUPS = sorted(p.name for p in SHIPPED_RECIPES.iterdir() if p.is_dir() and not p.name.startswith("_"))
EVERY_OPTION = [(g, p.stem) for g in GROUPS for p in sorted((SHIPPED_RECIPES / g).glob("*.yaml"))]
# pipeline recipes are not training configs: `suite run` reads them (suite.pipeline.recipe)
TRAINING_OPTIONS = [(g, o) for g, o in EVERY_OPTION if g != "pipeline"]
PIPELINES = [o for g, o in EVERY_OPTION if g == "pipeline"]


@pytest.mark.parametrize(("group", "option"), TRAINING_OPTIONS, ids=[f"{g}={o}" for g, o in TRAINING_OPTIONS])
def test_every_recipe_file_composes(group, option):
    cfg = compose_config([f"{group}={option}"])
    assert cfg.model.num_layers >= 1


@pytest.mark.parametrize("name", PIPELINES)
def test_every_pipeline_recipe_loads(name, tmp_path):
    """Each stage's verb, args and ${stage:NAME} references resolve (nothing runs)."""
    from suite.cli.verbs import VERBS  # the verb registry the pipeline reads, as `suite run` has it
    from suite.pipeline.recipe import load_pipeline

    assert VERBS
    pipeline = load_pipeline([f"pipeline={name}", f"run.dir={tmp_path / name}"])
    assert PIPELINES and len(pipeline.stages) >= 2


@pytest.mark.parametrize(("group", "option"), EVERY_OPTION, ids=[f"{g}={o}" for g, o in EVERY_OPTION])
def test_every_recipe_file_starts_with_its_launch_command(group, option):
    lines = (SHIPPED_RECIPES / group / f"{option}.yaml").read_text().splitlines()
    comments = [line for line in lines[:4] if line.startswith("#")]
    assert any("suite " in line for line in comments), f"{group}/{option}.yaml lacks a launch command comment"


def test_defaults_are_gpt_tiny_on_the_embedded_corpus():
    cfg = to_object(compose_config([]))
    assert cfg.model.name == "gpt-tiny" and cfg.data.path is None
    assert cfg.run.dir == "runs/gpt-tiny"
    validate(cfg)


@pytest.mark.parametrize(
    ("recipe", "hidden", "layers", "heads"),
    [
        ("gpt345m", 1024, 24, 16),
        ("gpt1.3b", 2048, 24, 16),
        ("gpt6.7b", 4096, 32, 32),
        ("gpt13b", 5120, 40, 40),
        ("gpt175b", 12288, 96, 96),
    ],
)
def test_standard_gpt_sizes(recipe, hidden, layers, heads):
    cfg = to_object(compose_config([f"recipe={recipe}", "data.path=/nonexistent"]))
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == (hidden, layers, heads)
    dims = validate(cfg, needs_data=False)
    assert dims.world_size == cfg.launch.nnodes * cfg.launch.nproc_per_node


def test_overrides_after_recipe_win():
    cfg = to_object(compose_config(["recipe=gpt13b", "model.num_layers=2", "train.max_steps=7"]))
    assert cfg.model.num_layers == 2 and cfg.train.max_steps == 7 and cfg.model.hidden_size == 5120


def test_recipe_from_a_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "# @package _global_\ndefaults:\n  - override /model: llama-tiny\ntrain:\n  max_steps: 3\n"
    )
    cfg = to_object(compose_config([f"recipe={path}"]))
    assert cfg.model.family == "llama" and cfg.train.max_steps == 3 and cfg.recipe_name == "mine"


def test_user_recipes_folder_searched_first(tmp_path, monkeypatch):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "gpt-tiny.yaml").write_text("# @package _global_\ntrain:\n  max_steps: 11\n")
    monkeypatch.setenv("SUITE_RECIPES", str(tmp_path))
    assert "gpt-tiny" in known_options("recipe")
    assert to_object(compose_config(["recipe=gpt-tiny"])).train.max_steps == 11


BAD_INPUTS = [
    (["recipe=gpt14b"], "not a known recipe"),
    (["model=gpt-huge"], "not a known model"),
    (["model.num_layer=3"], "did you mean 'model.num_layers'"),
    (["trian.max_steps=3"], "unknown key 'trian.max_steps'"),
    (["train.max_steps=abc"], "train.max_steps"),
    (["model.num_heads=3"], "not divisible by model.num_heads=3"),
    (["model.head_dim=0"], "model.head_dim=0 must be a positive integer"),
    (["recipe=llama-tiny", "model.head_dim=9"], "model.head_dim=9 must be even for RoPE"),
    (["parallel.tp=3", "launch.nproc_per_node=3"], "does not divide model.num_heads=4"),
    (["parallel.tp=2"], "world size"),
    (
        ["parallel.global_batch_size=12", "parallel.micro_batch_size=8"],
        "not divisible by parallel.micro_batch_size",
    ),
    (["data.path=/does/not/exist"], "data.path='/does/not/exist' does not exist"),
    (["train.precision=fp4"], "train.precision='fp4' is not supported"),
    (["data.seq_len=4096"], "exceeds model.max_seq_len"),
    (["parallel.pp=8", "launch.nproc_per_node=8"], "exceed model.num_layers"),
    (["parallel.sp=true"], "parallel.sp=true needs parallel.tp > 1"),
    (["parallel.dp=auto", "parallel.sharding=auto"], "at most one degree may be 'auto'"),
    (["parallel.sharding_stage=4", "parallel.sharding=2", "launch.nproc_per_node=2"], "sharding_stage=4"),
    (["max_steps"], "is not an override"),
    (["recompute.granularity=some"], "recompute.granularity='some' is not supported"),
    (["launch.nproc_per_node=4:2"], "the minimum 4 exceeds the maximum 2"),
    (["launch.nproc_per_node=two"], "use an integer like 4, or an elastic range min:max"),
    (
        ["launch.nproc_per_node=2:4", "parallel.sharding=4", "parallel.micro_batch_size=4"],
        "may shrink the job to 2 processes, but there: parallel degrees sharding=4 multiply to 4",
    ),
    (
        [
            "launch.nproc_per_node=2:4",
            "parallel.sharding=auto",
            "launch.nnodes=2",
            "parallel.micro_batch_size=2",
        ],
        "an elastic process range works on one node",
    ),
    (["train.spike_factor=0.5"], "train.spike_factor=0.5 must be above 1"),
    (["parallel.ep=2", "parallel.dp=2", "launch.nproc_per_node=2"], "model.num_experts=0"),
    (["recipe=moe-tiny", "model.top_k=9"], "model.top_k=9 must be between 1 and model.num_experts=8"),
    (
        [
            "recipe=moe-tiny",
            "parallel.ep=3",
            "parallel.dp=6",
            "parallel.micro_batch_size=1",
            "parallel.global_batch_size=12",
            "launch.nproc_per_node=6",
        ],
        "parallel.ep=3 does not divide model.num_experts=8",
    ),
    (
        ["recipe=moe-tiny", "parallel.ep=4", "parallel.dp=2", "launch.nproc_per_node=2"],
        "parallel.ep=4 does not divide the data-parallel ranks",
    ),
    (
        ["recipe=moe-tiny", "parallel.tp=2", "model.moe_ffn_hidden_size=127", "launch.nproc_per_node=2"],
        "parallel.tp=2 does not divide the expert MLP width (model.moe_ffn_hidden_size) 127",
    ),
    (
        [
            "recipe=moe-tiny",
            *("parallel.ep=2", "parallel.sharding=2", "parallel.offload=true"),
            *("parallel.ep_dispatch=hierarchical", "launch.nproc_per_node=2"),
        ],
        "parallel.ep_dispatch=hierarchical with parallel.offload=true is not supported",
    ),
    (["recipe=moe-tiny", "model.capacity_factor=0"], "model.capacity_factor=0"),
    (["recipe=moe-tiny", "model.moe_layers=[7]"], "names layer 7"),
    (["recipe=moe-tiny", "model.moe_every=5"], "no layer is MoE"),
    (["train.keep_host_memory=always"], "train.keep_host_memory='always' is not supported; use auto"),
    (["parallel.fsdp_backward_prefetch=0"], "parallel.fsdp_backward_prefetch=0: use counts of blocks"),
    (  # several processes offload sharded state; one process offloads all of it (ZeRO-Offload)
        ["parallel.offload=true", "parallel.dp=2", "launch.nproc_per_node=2"],
        "it needs parallel.sharding>1 with parallel.sharding_stage 2 or 3 (got sharding=1",
    ),
    (
        ["parallel.fsdp_forward_prefetch=1", "parallel.dp=2", "launch.nproc_per_node=2"],
        "need parallel.sharding>1 with parallel.sharding_stage 2 or 3",
    ),
    (  # 0 used to mean "as many as num_heads" without a word (issue 39)
        ["model.num_kv_heads=0"],
        "model.num_kv_heads=0 is not a head count; use null (as many as model.num_heads=4) or a divisor of it (1, 2, 4)",
    ),
    (["recipe=llama-tiny", "model.num_kv_heads=-2"], "model.num_kv_heads=-2 is not a head count"),
    (
        ["finetune.lora.alpha=-16"],
        "finetune.lora.alpha=-16.0 must be positive (the adapters' update is scaled by",
    ),
    (["finetune.lora.alpha=0"], "finetune.lora.alpha=0.0 must be positive"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate(to_object(compose_config(overrides)))
    message = str(info.value)
    assert expected in message, message
    assert "\n" not in message


def test_a_head_size_of_its_own_builds_heads_that_do_not_divide_the_width():
    """model.head_dim: 3 heads of 24 on a width of 64 (a pruned model's shape) validate and build."""
    from suite.models import build_model

    cfg = to_object(
        compose_config(
            ["recipe=llama-tiny", "model.num_heads=3", "model.num_kv_heads=1", "model.head_dim=24"]
        )
    )
    validate(cfg)
    attention = build_model(cfg.model).layers["0"].attention
    assert attention.wq.weight.shape == (72, cfg.model.hidden_size) and attention.wo.weight.shape == (
        cfg.model.hidden_size,
        72,
    )


def test_an_elastic_range_lists_the_world_sizes_the_degrees_fit():
    from suite.parallel.dims import elastic_world_sizes

    overrides = ["launch.nproc_per_node=1:4", "parallel.sharding=auto", "parallel.micro_batch_size=4"]
    cfg = to_object(compose_config([*overrides, "parallel.global_batch_size=16"]))
    assert validate(cfg).sharding == 4  # the parent validates at the maximum
    assert validate(cfg, world=2).sharding == 2  # a worker of a shrunken attempt at its own world
    assert elastic_world_sizes(cfg) == [4, 2, 1]  # 3 ranks x micro-batch 4 do not divide 16


def test_auto_precision_is_resolved_at_compose_time(monkeypatch):
    """`auto` never reaches the trainer: bf16 where oneDNN runs bf16 natively, fp32 where it would emulate
    (train.precision and optim.muon_ns_dtype)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert resolve_auto(compose_config(["train.precision=auto"])).train.precision == "bf16"
    assert resolve_auto(compose_config(["optim=muon"])).optim.muon_ns_dtype == "bf16"  # Newton-Schulz too
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert resolve_auto(compose_config(["train.precision=auto"])).train.precision == "fp32"
    assert resolve_auto(compose_config(["optim=muon"])).optim.muon_ns_dtype == "fp32"
    assert resolve_auto(compose_config(["optim.muon_ns_dtype=bf16"])).optim.muon_ns_dtype == "bf16"
    assert (
        resolve_auto(compose_config(["train.precision=fp16"])).train.precision == "fp16"
    )  # explicit values stay


def test_emulated_low_precision_is_recognised(monkeypatch):
    """The trainer warns when bf16/fp16 on this CPU would be emulated (~100x slower than fp32 on AVX2 alone)."""
    import torch

    from suite.runtime import emulates_low_precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    assert emulates_low_precision(cpu, "bf16") and emulates_low_precision(cpu, "fp16")
    assert not emulates_low_precision(cpu, "fp32") and not emulates_low_precision(cuda, "bf16")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert not emulates_low_precision(cpu, "bf16") and emulates_low_precision(cpu, "fp16")


def test_auto_attention_is_resolved_at_compose_time(monkeypatch):
    """The explicit score matrix for bf16/fp16 on CPU at training lengths; sdpa for fp32, GPUs, long sequences."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bf16 = ["train.precision=bf16", "train.device=cpu"]
    assert resolve_auto(compose_config(bf16)).model.attention == "explicit"
    assert resolve_auto(compose_config([*bf16, "data.seq_len=4096"])).model.attention == "sdpa"
    assert resolve_auto(compose_config(["train.precision=fp32"])).model.attention == "sdpa"
    assert (
        resolve_auto(compose_config(["train.precision=bf16", "train.device=cuda"])).model.attention == "sdpa"
    )
    assert (
        resolve_auto(compose_config([*bf16, "model.attention=sdpa"])).model.attention == "sdpa"
    )  # explicit values stay


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("model.name=a b,c", "a b,c"), ("model.name=it's", "it's"), ("model.name=x=y,z", "x=y,z")],
)
def test_an_unreadable_value_says_how_to_quote_it_and_the_quoted_form_works(typed, meant):
    """Hydra's grammar message alone ("token recognition error", a silent sweep on a comma) does not
    say what to type; the refusal does, and what it suggests (the argument inside its double quotes,
    as the shell hands it over) composes to the value meant. Without `_check_syntax` the comma case
    is a sweep Hydra rejects with "Ambiguous value" and the quote case a lexer error, no suggestion."""
    with pytest.raises(ConfigError, match="single quotes inside double quotes") as info:
        compose_config([typed])
    (way,) = ways_on(str(info.value))  # what the shell passes for "key='...'" (tests/suggested_fix.py)
    assert compose_config(way.apply([typed])).model.name == meant


def test_an_unfinished_list_is_refused_saying_to_write_it_whole():
    with pytest.raises(ConfigError, match="write the list or mapping whole"):
        compose_config(["data.sources=[{path: x"])
