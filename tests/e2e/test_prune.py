"""`suite prune`: a smaller dense model whose kept weights are the source's own, that every verb reads.

A tiny GPT and a tiny Llama (GQA, SwiGLU) pretrained for a few steps by the CLI are pruned by 25% of
their MLP channels and one of their four layers. The pruned model equals, at the level of logits, the
source model with the same channels zeroed and the same block skipped (the slicing is exact); the
importance ranks a block that was made the identity last; it exports to Hugging Face with
transformers' logits within 1e-4 of the suite's; `suite generate` reads it; bad input is one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_MODEL, export_and_compare, merged, run_suite

LLAMA = ["recipe=llama-tiny", "model.num_kv_heads=2", "model.ffn_hidden_size=128"]


@pytest.fixture(scope="module", params=["gpt", "llama"])
def source(request, tmp_path_factory, tiny_data) -> Path:
    run = tmp_path_factory.mktemp("prune") / request.param
    family = LLAMA if request.param == "llama" else []
    run_suite(
        "pretrain", *merged(family, TINY_MODEL, ["model.num_layers=4"]), f"data.path={tiny_data}", f"run.dir={run}",
        "train.max_steps=6", "train.save_every=6", "train.eval_every=6", "parallel.global_batch_size=8",
        "parallel.micro_batch_size=4", check=True,
    )  # fmt: skip
    return run


def prune(source: Path, out: Path, *extra: str) -> dict:
    run_suite(
        "prune", f"ckpt={source}", f"run.dir={out}", "compress.calib_samples=8", "compress.eval_batches=2",
        "compress.decode_tokens=2", *extra, "--json", check=True,
    )  # fmt: skip
    return json.loads((out / "report.json").read_text())


def test_pruned_model_is_the_source_with_channels_and_a_block_removed(source, tmp_path):
    from suite.infer.generate import load_for_inference

    report = prune(source, tmp_path / "pruned", "prune.ffn=0.25", "prune.layers=1")
    full, _, _ = load_for_inference(source)
    small, _, _ = load_for_inference(tmp_path / "pruned")
    width, kept_width = report["ffn_hidden_size"]
    assert kept_width == int(round(width * 0.75)) and len(report["layers_kept"]) == 3
    assert small.cfg.num_layers == 3 and small.cfg.ffn_hidden_size == kept_width
    # the same computation in the full model: the dropped block skipped, the dropped channels zeroed
    dropped = next(i for i in range(4) if i not in report["layers_kept"])
    with torch.no_grad():
        for new, old in enumerate(report["layers_kept"]):
            ff_small, ff_full = small.layers[str(new)].feed_forward, full.layers[str(old)].feed_forward
            keep = torch.tensor(
                [
                    any(torch.equal(ff_full.w2.weight[:, c], col) for col in ff_small.w2.weight.t())
                    for c in range(width)
                ]
            )
            assert int(keep.sum()) == kept_width
            ff_full.w2.weight[:, ~keep] = 0.0  # a zeroed channel contributes nothing to the block
        full.layers[str(dropped)].forward = lambda x, *args, **kwargs: x
        ids = torch.randint(0, small.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        assert (small(ids) - full(ids)).abs().max() <= 1e-5
    assert report["after"]["params"] < report["before"]["params"]
    assert export_and_compare(tmp_path / "pruned", tmp_path / "hf") <= 1e-4
    out = run_suite(
        "generate", f"ckpt={tmp_path / 'pruned'}", "prompt=The", "generate.max_new_tokens=4", check=True
    )
    assert out.returncode == 0


def test_a_pruned_model_heals_by_distillation_from_its_source(source, tmp_path, tiny_data):
    from tests.helpers import run_config, train_losses

    prune(source, tmp_path / "pruned", "prune.ffn=0.25", "prune.layers=1")
    healed = tmp_path / "healed"
    run_suite(
        "distill", f"distill.teacher={source}", f"model.init_from={tmp_path / 'pruned'}", f"data.path={tiny_data}",
        f"run.dir={healed}", "data.seq_len=32", "train.precision=fp32", "train.max_steps=3", "train.save_every=3",
        "train.eval_every=3", "train.log_every=1", "parallel.global_batch_size=8", "parallel.micro_batch_size=4", "log.wandb=false",
        "log.progress=false", check=True,
    )  # fmt: skip
    assert run_config(healed).model.num_layers == 3 and len(train_losses(healed)) == 3


def test_a_block_made_the_identity_is_pruned_first(source, tmp_path):
    """The depth importance (1 - cos(input, output)) is measured, not assumed: zero a block's output
    projections in the source and that block is the one dropped."""
    from suite.compress.prune import importance
    from suite.config.schema import ModelConfig
    from suite.data.batch import Batch
    from suite.models import build_model, materialize

    cfg = ModelConfig(num_layers=4, hidden_size=32, num_heads=4, vocab_size=64, max_seq_len=16)
    model = materialize(build_model(cfg), "cpu", seed=1).eval()
    with torch.no_grad():
        for proj in (model.layers["2"].attention.wo, model.layers["2"].feed_forward.w2):
            proj.weight.zero_()
            proj.bias.zero_()
    rows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    channels, layers = importance(model, [Batch.from_windows(rows)])
    assert int(torch.argmin(layers)) == 2 and float(layers[2]) < 1e-6
    assert len(channels) == 4 and channels[0].shape == (cfg.hidden_size * 4,)


@pytest.mark.parametrize(
    "extra,words",
    [
        ([], ["nothing to prune"]),
        (["prune.ffn=1.0"], ["prune.ffn=1.0"]),
        (["prune.layers=4"], ["prune.layers=4"]),
        (["prune.heads=0.25"], ["prune.heads=0.25", "not"]),
    ],
)
def test_bad_prune_input_is_one_line(source, tmp_path, extra, words):
    out = tmp_path / "bad"
    proc = run_suite("prune", f"ckpt={source}", f"run.dir={out}", *extra)
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err)
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not (out / "checkpoints").exists()
