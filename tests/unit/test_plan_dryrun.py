"""The dry run (`suite pretrain ... --dry-run`): each preset placed by the real `parallelize` on the
meta device under a fake process group of up to 1024 ranks holds exactly the parameters the cost
model counts for that rank, under at least five layouts (FSDP's uneven pieces, tp, pp with virtual
stages, HSDP, ZeRO-1, ep, MoE under tp and pp)."""

from __future__ import annotations

import pytest

from suite.cli import main
from suite.config.compose import compose_config, known_options, to_object
from suite.config.errors import ConfigError
from suite.parallel.dims import ParallelDims
from suite.plan.dryrun import coordinates, dry_run, predicted_numel, worst_rank

DENSE = [  # (world, parallel overrides); the global batch follows the data ranks and pp
    (8, {"sharding": 8, "sharding_stage": 3}),
    (16, {"tp": 2, "sp": True, "sharding": 8, "sharding_stage": 2}),
    (32, {"tp": 2, "pp": 2, "dp": 2, "sharding": 4, "sharding_stage": 3}),
    (64, {"tp": 4, "pp": 2, "vpp": 2, "pp_schedule": "interleaved_1f1b", "sharding": 8, "sharding_stage": 1}),
    (256, {"tp": 2, "pp": 4, "dp": 32}),
    (1024, {"tp": 4, "pp": 4, "sharding": 64, "sharding_stage": 3}),
]
MOE = [
    (8, {"sharding": 8, "sharding_stage": 3}),
    (16, {"sharding": 16, "sharding_stage": 2, "ep": 2}),
    (8, {"dp": 8, "ep": 8}),
    (16, {"dp": 4, "sharding": 4, "sharding_stage": 3, "ep": 4}),
    (1024, {"sharding": 1024, "sharding_stage": 3, "ep": 8}),
    # expert-tensor-parallel: experts split on their ffn dim, alone and under ep
    (16, {"tp": 2, "sp": True, "sharding": 8, "sharding_stage": 3}),
    (32, {"tp": 2, "dp": 2, "sharding": 8, "sharding_stage": 2, "ep": 4}),
    # MoE layers inside pipeline stages, each stage with its own expert groups
    (16, {"pp": 2, "sharding": 8, "sharding_stage": 3, "ep": 4}),
    (32, {"tp": 2, "pp": 2, "dp": 2, "sharding": 4, "sharding_stage": 2, "ep": 2}),
]


def _config(model: str, world: int, parallel: dict, *extra: str):
    data = world // (parallel.get("tp", 1) * parallel.get("pp", 1))
    overrides = [
        f"model={model}",
        "train.precision=bf16",
        "data.seq_len=128",
        "model.max_seq_len=2048",
        *extra,
    ]
    overrides += [f"parallel.{k}={str(v).lower()}" for k, v in parallel.items()]
    overrides += [
        "parallel.micro_batch_size=1",
        f"parallel.global_batch_size={data * 2 * parallel.get('pp', 1)}",
    ]
    overrides += [f"launch.nproc_per_node={world}", "train.compile=false"]
    cfg = to_object(compose_config(overrides))
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.validate(cfg.parallel, cfg.model)
    dims.validate_run(cfg)
    return cfg, dims


@pytest.mark.slow  # ~60 dry runs, up to 1024 ranks each
@pytest.mark.parametrize("model", known_options("model"))
def test_dry_run_parameters_equal_the_cost_model(model):
    layouts = MOE if to_object(compose_config([f"model={model}"])).model.num_experts else DENSE
    checked = 0
    for world, parallel in layouts:
        try:
            cfg, dims = _config(model, world, parallel)
        except ConfigError:
            continue  # a layout this model cannot take (e.g. heads that tp does not divide)
        ranks = {0, worst_rank(cfg, dims), world - 1}
        for rank in ranks:
            result = dry_run(cfg, dims, rank)
            assert result["params"] == result["params_predicted"], (model, world, parallel, rank)
        checked += 1
    assert checked >= 5, f"{model}: only {checked} layouts apply"


@pytest.mark.parametrize("tied", [False, True])
def test_multi_token_prediction_modules_are_counted_on_the_last_stage(tied):
    """The MTP modules (and, with an untied head, the embedding copy they read) sit on the pipeline's
    last stage, their blocks split by tp: the cost model's count equals the placed model's on every
    pipeline rank. Leaving them out of suite.plan.params (as before) misses the last rank by the
    modules' ~100k parameters; counting the embedding copy beside a tied head counts it twice."""
    extra = ("model.num_mtp_layers=1", f"model.tie_embeddings={str(tied).lower()}")
    for world, parallel in [(2, {"pp": 2}), (8, {"pp": 2, "tp": 2, "sp": True, "sharding": 2, "ep": 2})]:
        cfg, dims = _config("deepseek-tiny", world, parallel, *extra)
        for rank in (0, world - 1):
            result = dry_run(cfg, dims, rank)
            assert result["params"] == result["params_predicted"], (parallel, rank, result)


def test_coordinates_are_the_meshes_row_major_order():
    cfg, dims = _config("gpt-tiny", 32, {"tp": 2, "pp": 2, "dp": 2, "sharding": 4, "sharding_stage": 3})
    assert coordinates(dims, 0) == {"pp": 0, "dp": 0, "sharding": 0, "cp": 0, "tp": 0}
    assert coordinates(dims, 31) == {"pp": 1, "dp": 1, "sharding": 3, "cp": 0, "tp": 1}
    assert coordinates(dims, 2) == {"pp": 0, "dp": 0, "sharding": 1, "cp": 0, "tp": 0}
    # FSDP's torch.chunk pieces: 1024-way sharding of 256-row norms leaves the last ranks nothing there
    cfg, dims = _config("gpt-tiny", 1024, {"tp": 4, "pp": 4, "sharding": 64, "sharding_stage": 3})
    assert predicted_numel(cfg, dims, 0) > predicted_numel(cfg, dims, 1023)


def test_cli_dry_run_json_and_bad_rank(capsys):
    argv = ["pretrain", "recipe=gpt-tiny", "parallel.tp=2", "parallel.sharding=2", "launch.nproc_per_node=4"]
    assert main([*argv, "--dry-run", "--rank", "3", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["equal"] and out["rank"] == 3 and out["world_size"] == 4
    assert main([*argv, "--dry-run", "--rank", "9"]) == 2
    assert "--rank 9 is not a rank of this job" in capsys.readouterr().err


def test_report_names_fp32_masters_only_for_low_precision_parameters():
    from suite.plan.dryrun import report

    for param_dtype, masters in (("fp32", False), ("bf16", True)):
        cfg, dims = _config("gpt-tiny", 2, {"sharding": 2, "sharding_stage": 3})
        cfg.train.param_dtype = param_dtype
        text = report(dry_run(cfg, dims, 0))
        assert ("fp32 masters of bf16 weights" in text) == masters, text
        assert "AdamW moments" in text
