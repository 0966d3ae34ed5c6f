"""Finetuning a Mixture-of-Experts model (full and LoRA) at expert parallelism matches one process.

The base is a `suite pretrain recipe=moe-tiny` run (TINY_MODEL-sized: 2 layers, 8 experts, top-2,
dropless; 2 steps), finetuned with `model.init_from=<run.dir>` on a generated reverse-3 task:

    full / lora            1 process (the references)
    full-ep2 / lora-ep2    2 gloo processes, parallel.dp=2 parallel.ep=2: each rank holds 4 experts
                           (and, for LoRA, those experts' adapters), tokens travel by all_to_all

Every step's loss and gradient norm, the step-1 gradients and every parameter's update match the
reference within 1e-4 (tests/helpers.py: assert_equivalent), and the layout that ran is the one
asked for. The SFT loss includes the router's balance and z-losses as pretraining's does (checked
against a recomputation here), and LoRA adapts attention and every expert (per-expert factors,
sharded with the experts) while the base and the router stay frozen.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.test_finetune import TINY_FT
from tests.helpers import (
    TINY_MODEL,
    assert_equivalent,
    assert_layout,
    final_weights,
    initial_weights,
    merged,
    run_suite,
    summary,
    train_losses,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MOE = ["recipe=moe-tiny", *TINY_MODEL, "model.num_kv_heads=2", "model.moe_ffn_hidden_size=64"]
# every step's update is measurable (no warm-up in a 3-step run); step-1 gradients saved
CHECKED = merged(TINY_FT, ["finetune.eval_samples=0", "sched.warmup_steps=1", "train.save_grads_step=1"])
LORA = ["finetune.method=lora", "finetune.lora.rank=4"]
EP2 = ["parallel.dp=2", "parallel.ep=2"]
RUNS = {"full": [], "full-ep2": EP2, "lora": LORA, "lora-ep2": [*LORA, *EP2]}


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory, tiny_data) -> Path:
    run_dir = tmp_path_factory.mktemp("ftmoe") / "base"
    run_suite(
        "pretrain",
        *MOE,
        f"data.path={tiny_data}",
        f"run.dir={run_dir}",
        "train.max_steps=2",
        "train.save_every=2",
        "train.eval_every=2",
        "parallel.micro_batch_size=4",
        "parallel.global_batch_size=8",
        check=True,
    )
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, moe_base):
    root = tmp_path_factory.mktemp("ftmoe")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            overrides = RUNS[name]
            nproc = 2 if "parallel.ep=2" in overrides else 1
            run_dir = root / name
            run_suite(
                "finetune",
                f"model.init_from={moe_base}",
                f"run.dir={run_dir}",
                *CHECKED,
                *overrides,
                f"launch.nproc_per_node={nproc}",
                timeout=300,
                check=True,
            )
            done[name] = run_dir
        return done[name]

    return get


def first_step_loss(run_dir: Path) -> tuple[float, float]:
    """(step 1's SFT loss recomputed here, its router part): per micro-batch, the summed
    cross-entropy over assistant tokens divided by the global batch's target count, plus the MoE
    layers' weighted balance + z-losses divided by the number of micro-batches (pretraining's rule)."""
    from suite.config.compose import load_saved_config
    from suite.data import load_tokenizer
    from suite.data.batch import IGNORE_INDEX
    from suite.data.sft import SFTBatches, SFTDataset
    from suite.finetune.data import sft_options
    from suite.model_source import ModelSource
    from suite.models.moe import moe_aux_loss
    from suite.train.loss import cross_entropy

    cfg = load_saved_config(run_dir / "config.yaml")
    tokenizer = load_tokenizer(run_dir)
    data = SFTDataset.build(
        str(run_dir / "task" / "train.jsonl"), tokenizer, sft_options(cfg, tokenizer.chat_template)
    )
    p = cfg.parallel
    batches = SFTBatches(data, p.micro_batch_size, p.global_batch_size, seed=cfg.train.seed).next_step()
    model = ModelSource.parse(cfg.model.init_from, "model.init_from").load_model().train()
    targets = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
    ce = aux = 0.0
    with torch.no_grad():
        for b in batches:
            ce += float(cross_entropy(model(b.tokens, **b.model_kwargs()), b.labels, "sum")) / targets
            aux += float(moe_aux_loss(model)) / len(batches)
    return ce + aux, aux


def test_full_sft_of_moe_at_ep2_matches_single_process(runs):
    """Full finetuning (router, experts, attention) at ep=2: losses, gradient norms, step-1 gradients
    and updates equal one process's; the logged loss is cross-entropy plus the router losses."""
    single, ep2 = runs("full"), runs("full-ep2")
    assert_layout(ep2, 2, EP2)
    assert_equivalent(single, ep2)
    loss, aux = first_step_loss(single)
    logged = train_losses(single)[1]
    assert aux > 1e-3 * loss  # large enough that leaving the router losses out would show
    assert abs(logged - loss) <= 1e-5 * loss, (logged, loss, aux)
    start, final = initial_weights(single), final_weights(single)
    assert not torch.equal(
        start["layers.0.feed_forward.router.weight"], final["layers.0.feed_forward.router.weight"]
    )


def test_lora_sft_of_moe_at_ep2_matches_single_process(runs):
    """LoRA on attention and on every expert (default targets: w1/w2/w3 name the stacked expert
    weights): at ep=2 the expert adapters are sharded with the experts, and training matches one
    process; the base (experts, router, attention) stays bit for bit frozen."""
    from safetensors.torch import load_file

    single, ep2 = runs("lora"), runs("lora-ep2")
    assert_layout(ep2, 2, [*LORA, *EP2])
    params = summary(ep2)["layout"]["ranks"][0]["params"]
    for factor in ("lora_a", "lora_b"):
        for weight in ("w1", "w2", "w3"):
            assert (
                params[f"layers.*.feed_forward.experts.{factor}.{weight}"]
                == "edp:Replicate(),ep:Shard(dim=0)"
            )
    assert_equivalent(single, ep2)

    start, final = initial_weights(single), final_weights(single)
    for name, value in start.items():
        if ".lora_" not in name:
            assert torch.equal(value, final[name]), f"base weight {name} moved"
    adapters = load_file(str(ep2 / "lora" / "lora.safetensors"))  # gathered from both ep ranks
    b = adapters["layers.0.feed_forward.experts.lora_b.w2"]
    assert b.shape == (8, 64, 4)  # [experts, hidden, rank]: every expert, not one rank's half
    # (layer 0's experts all get tokens in these 3 steps; one of layer 1's gets none and stays put)
    assert all(float(b[e].abs().max()) > 0 for e in range(8)), "an expert's adapter never trained"
    assert torch.equal(b, final_weights(ep2)["layers.0.feed_forward.experts.lora_b.w2"])


def test_task_accuracy_under_ep_with_bf16_autocast(tmp_path, moe_base):
    """The in-training greedy task evaluation runs at ep=2 under bf16 autocast too: the dense layers
    compute in bf16 through the data-parallel policy while the experts, outside it, keep fp32
    weights (the run used to stop there with a dtype mismatch)."""
    from tests.helpers import read_metrics

    run_dir = tmp_path / "bf16-ep2"
    overrides = [*LORA, *EP2, "train.precision=bf16"]
    run_suite(
        "finetune",
        f"model.init_from={moe_base}",
        f"run.dir={run_dir}",
        *merged(CHECKED, ["finetune.eval_samples=2", "train.max_steps=1", "train.eval_every=1"]),
        *overrides,
        "launch.nproc_per_node=2",
        timeout=300,
        check=True,
    )
    assert_layout(run_dir, 2, overrides)
    evals = [r for r in read_metrics(run_dir) if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1] and all(0.0 <= r["val_accuracy"] <= 1.0 for r in evals)
