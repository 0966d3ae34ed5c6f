"""train.param_dtype=bf16: bf16 parameters and gradients, fp32 master weights and AdamW state.

In-process (one tiny model, a few steps): the loss follows the autocast run, the masters and the
optimizer state are fp32, checkpoints hold the fp32 masters, and a resumed run continues exactly.
"""

from __future__ import annotations

import pytest
import torch

from suite.config.compose import compose_config, to_object
from suite.config.errors import ConfigError
from suite.data.batch import Batch
from suite.models import build_model, materialize
from suite.parallel.parallelize import parallelize
from suite.preflight import validate
from suite.runtime import resolve_auto, resolve_precision
from suite.train import checkpoint as ckpt
from suite.train.master_weights import MasterWeightOptimizer
from suite.train.optim import optimizer_for
from suite.train.step import TrainStep, training_loss
from suite.train.trainer import autocast_factory
from tests.helpers import TINY_MODEL

CPU = torch.device("cpu")
WIDE_LLAMA = [
    "model.family=llama",
    "model.hidden_size=512",
    "model.num_heads=8",
    "model.tie_embeddings=false",
]
STEPS = 5


def _config(*overrides: str):
    cfg = to_object(
        resolve_auto(compose_config(["recipe=gpt-tiny", *TINY_MODEL, "train.device=cpu", *overrides]))
    )
    return cfg, validate(cfg, needs_data=False)


def _build(param_dtype: str):
    cfg, dims = _config("train.precision=bf16", f"train.param_dtype={param_dtype}", "optim.lr=1e-2")
    model = build_model(cfg.model, "meta")
    precision = resolve_precision(cfg.train, CPU)
    placement = parallelize(model, cfg, dims, CPU, precision)
    materialize(placement.model, CPU, cfg.train.seed)
    optimizer = optimizer_for(placement, cfg.optim)
    autocast = autocast_factory(CPU, precision)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss_fn = training_loss(placement.model, False)
    return TrainStep(placement, optimizer, loss_fn, autocast, scaler), optimizer, autocast


def _batches(count: int) -> list[Batch]:
    """Two random batches in turn (random tokens: what can be learned is those batches)."""
    gen = torch.Generator().manual_seed(0)
    pair = [Batch.from_windows(torch.randint(0, 512, (4, 33), generator=gen)) for _ in range(2)]
    return [pair[i % 2] for i in range(count)]


def _train(parallel, optimizer, autocast, batches) -> list[float]:
    losses = []
    for batch in batches:
        loss = parallel.forward_backward([batch])
        parallel.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def runs():
    batches = _batches(STEPS)
    autocast_run = _build("fp32")
    master_run = _build("bf16")
    return batches, _train(*autocast_run, batches), master_run, _train(*master_run, batches)


def test_loss_follows_the_autocast_run(runs):
    _, autocast_losses, _, master_losses = runs
    assert master_losses[-1] < master_losses[0] - 0.1  # it trains
    for a, b in zip(autocast_losses, master_losses):
        assert abs(a - b) < 0.03 * abs(a), (autocast_losses, master_losses)


def test_params_are_bf16_masters_and_state_fp32(runs):
    _, _, (parallel, optimizer, _), _ = runs
    assert isinstance(optimizer, MasterWeightOptimizer)
    assert {p.dtype for p in parallel.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in optimizer.masters} == {torch.float32}
    for state in optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    for p, m in zip(optimizer.params, optimizer.masters):  # the bf16 params are the rounded masters
        assert torch.equal(p, m.to(torch.bfloat16))
    tied = parallel.model.output.weight is parallel.model.tok_embeddings.weight
    assert tied and len(optimizer.masters) == len({id(p) for p in parallel.model.parameters()})


def test_checkpoint_holds_fp32_masters_and_resumes_exactly(tmp_path):
    batches = _batches(4)
    parallel, optimizer, autocast = _build("bf16")
    _train(parallel, optimizer, autocast, batches[:2])
    folder = ckpt.save_checkpoint(tmp_path, 2, parallel.model, optimizer, {"step": 2}, "{}\n")
    expected = _train(parallel, optimizer, autocast, batches[2:])

    cfg, _ = _config()
    fp32_model = materialize(build_model(cfg.model, "meta"), CPU, seed=99)
    ckpt.load_model_weights(folder, fp32_model)  # what generate / export read: the masters, in fp32
    fresh, fresh_optimizer, _ = _build("bf16")
    state = ckpt.load_checkpoint(folder, fresh.model, fresh_optimizer)
    assert state["step"] == 2
    names = dict(fp32_model.named_parameters(remove_duplicate=False))
    for name, master in fresh_optimizer.names.items():
        assert names[name].dtype == torch.float32 and torch.equal(names[name], master)
    assert _train(fresh, fresh_optimizer, autocast, batches[2:]) == expected
    for a, b in zip(optimizer.masters, fresh_optimizer.masters):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.param_dtype=bf16"], "needs train.precision=bf16"),
        (["train.precision=bf16", "train.param_dtype=fp16"], "use one of: fp32, bf16"),
        (["train.precision=bf16", "train.param_dtype=bf16", "finetune.method=lora"], "would be rounded"),
    ],
)
def test_bad_combinations_are_one_line_errors(overrides, words):
    with pytest.raises(ConfigError) as err:
        _config(*overrides)
    assert words in str(err.value) and "train.param_dtype" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], False),  # gpt-tiny's width: eager
        (["train.precision=bf16", *WIDE_LLAMA], True),
        (["train.precision=bf16", "model.hidden_size=512", "model.num_heads=8"], False),  # gpt: eager
        ([*WIDE_LLAMA], True),  # fp32 on CPU too: same speed, less memory
        (["train.precision=bf16", "train.compile=false", *WIDE_LLAMA], False),
        (["train.compile=true"], True),
    ],
)
def test_compile_auto_picks_wide_llama_models(overrides, expected):
    from suite.parallel.parallelize import compile_enabled

    cfg, dims = _config(*overrides)
    assert compile_enabled(cfg, dims, CPU, resolve_precision(cfg.train, CPU)) is expected


def test_compile_bad_value_is_a_one_line_error():
    with pytest.raises(
        ConfigError, match="train.compile='sometimes' is not supported; use auto, true or false"
    ):
        _config("train.compile=sometimes")
