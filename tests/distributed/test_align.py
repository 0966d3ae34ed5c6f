"""`suite align` (DPO) under parallel layouts equals one process, and LoRA-DPO keeps one copy of the
base weights.

- dp=2 and sharding=2 (FSDP2, stage 3): every step's loss and gradient norm, the step-1 gradients
  and the weight updates equal the single-process run's (tests/helpers.py: assert_equivalent), the
  layout asked for is the one that ran (assert_layout). The pairs are built from a built-in task
  (its right answer against a corrupted one, suite.align.pairs.task_pairs); a pair's two
  conversations share a micro-batch, and the loss is a mean over the global batch's pairs.
- LoRA-DPO's reference is the policy with its adapters off: a trainer built in this process holds
  one model and one copy of each base weight, where full DPO holds two (its frozen reference).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from suite.align.pairs import task_pairs
from tests.e2e.test_finetune import tiny_base
from tests.helpers import assert_equivalent, assert_layout, read_metrics, run_suite

STEPS = 3
TINY_ALIGN = [
    "log.wandb=false",
    "log.progress=false",
    "log.report=false",
    "data.seq_len=64",
    f"train.max_steps={STEPS}",
    f"train.eval_every={STEPS}",
    f"train.save_every={STEPS}",
    "train.log_every=1",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=4",
    "align.num_eval=4",
    "optim.lr=1e-3",
    "train.precision=fp32",
    # every step's update is measurable (no warm-up in a 3-step run); step-1 gradients saved
    "sched.warmup_steps=1",
    "train.save_grads_step=1",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data) -> Path:
    return tiny_base(tmp_path_factory.mktemp("align") / "base-hf", tiny_data)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("align") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in task_pairs("reverse-3", 20)))
    return path


def align_args(run_dir: Path, base: Path, pairs: Path, *extra: str) -> list[str]:
    return [f"model.init_from=hf:{base}", f"align.data={pairs}", f"run.dir={run_dir}", *TINY_ALIGN, *extra]


def align(run_dir: Path, base: Path, pairs: Path, *extra: str) -> Path:
    run_suite("align", *align_args(run_dir, base, pairs, *extra), check=True)
    return run_dir


@pytest.fixture(scope="module")
def single(tmp_path_factory, base, pairs) -> Path:
    return align(tmp_path_factory.mktemp("align") / "single", base, pairs)


@pytest.mark.parametrize(
    "layout",
    [["parallel.dp=2"], ["parallel.sharding=2", "parallel.sharding_stage=3"]],
    ids=["dp2", "sharding2-stage3"],
)
def test_dpo_layout_matches_single_process(tmp_path, base, pairs, single, layout):
    run = align(tmp_path / "layout", base, pairs, *layout, "launch.nproc_per_node=2")
    assert_layout(run, 2, [*TINY_ALIGN, *layout])
    assert_equivalent(single, run)
    first = next(r for r in read_metrics(run) if r.get("step") == 1)
    # policy == reference at step 1: every implicit reward is 0 and the loss is log 2
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0
    assert abs(first["loss"] - 0.6931471805599453) < 1e-6
    last = next(r for r in read_metrics(single) if r.get("step") == STEPS)
    assert last["rewards/margin"] != 0.0 and 0.0 <= last["rewards/accuracy"] <= 1.0


def _trainer(tmp_path: Path, base: Path, pairs: Path, *extra: str):
    """A single-process align trainer built here (no step runs), as the verb's rank builds it."""
    import suite.cli.verbs  # noqa: F401 (registers the verbs: align's default recipe)
    from suite.align import method
    from suite.cli.common import _compose
    from suite.cli.training import with_base_model, with_default_recipe
    from suite.preflight import validate
    from suite.train.trainer import Trainer

    overrides = with_default_recipe("align", align_args(tmp_path, base, pairs, *extra))
    raw, cfg = _compose(overrides)
    raw, cfg = with_base_model(raw, overrides)
    dims = validate(cfg, needs_data=False)
    return Trainer(cfg, dims, OmegaConf.to_yaml(raw), method(cfg.align.method)(cfg))


def _copies_of(weight: torch.Tensor) -> int:
    """Distinct storages alive in this process that hold `weight`'s values."""
    found = set()
    for obj in gc.get_objects():
        same_kind = type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.shape == weight.shape
        if same_kind and torch.equal(obj.detach(), weight):
            found.add(obj.untyped_storage().data_ptr())
    return len(found)


def test_lora_dpo_holds_one_copy_of_the_base_weights(tmp_path, base, pairs):
    from suite.align.reference import AdapterOffReference, FrozenReference
    from suite.models.transformer import Transformer

    def models_alive() -> int:
        return sum(type(o) is Transformer for o in gc.get_objects())

    gc.collect()
    before = models_alive()
    full = _trainer(tmp_path / "full", base, pairs)
    embedding = full.model.tok_embeddings.weight.detach().clone()
    assert isinstance(full.runner.method_loss.reference, FrozenReference)
    assert models_alive() - before == 2 and _copies_of(embedding) == 3  # policy, reference, this clone
    del full
    gc.collect()
    lora = _trainer(tmp_path / "lora", base, pairs, "align.lora=true", "finetune.lora.rank=4")
    assert isinstance(lora.runner.method_loss.reference, AdapterOffReference)
    assert models_alive() - before == 1 and _copies_of(embedding) == 2  # the policy's, this clone
    base_params = [p for n, p in lora.model.named_parameters() if "lora_" not in n]
    assert not any(p.requires_grad for p in base_params)
