"""`suite prune`: a smaller dense model whose kept weights are the source's own, that every verb reads.

A tiny GPT and a tiny Llama (GQA, SwiGLU) pretrained for a few steps by the CLI are pruned by 25% of
their MLP channels and one of their four layers. The pruned model equals, at the level of logits, the
source model with the same channels zeroed and the same block skipped (the slicing is exact); the
importance ranks a block that was made the identity last; it exports to Hugging Face with
transformers' logits within 1e-4 of the suite's; `suite generate` reads it; bad input is one line.
Heads: the pruned model equals the source with the dropped heads' attention outputs zeroed, the kept
heads are the most important of each KV group; heads + hidden + MLP channels pruned on the Llama
export with transformers' logits within 1e-4; a GPT with pruned heads runs (generate, eval) but
`suite export` refuses it in one line (GPT-2's config cannot hold the head size).
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
    # no heads or hidden channels pruned: the attention and the widths are the source's, as before
    assert (small.cfg.num_heads, small.cfg.num_kv_heads, small.cfg.hidden_size, small.cfg.head_dim) == (
        full.cfg.num_heads, full.cfg.num_kv_heads, full.cfg.hidden_size, full.cfg.head_dim
    )  # fmt: skip
    assert report["heads_kept"] is None
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
    """Every axis pruned at once (GPT: 3 of 4 heads and 48 of 64 channels, so hidden / heads still
    gives the head size; Llama: 1 query head per KV group and 48 channels, head_dim written)."""
    from tests.helpers import run_config, train_losses

    heads = "prune.heads=0.5" if source.name == "llama" else "prune.heads=0.25"
    prune(source, tmp_path / "pruned", "prune.ffn=0.25", "prune.layers=1", heads, "prune.hidden=0.25")
    healed = tmp_path / "healed"
    run_suite(
        "distill", f"distill.teacher={source}", f"model.init_from={tmp_path / 'pruned'}", f"data.path={tiny_data}",
        f"run.dir={healed}", "data.seq_len=32", "train.precision=fp32", "train.max_steps=3", "train.save_every=3",
        "train.eval_every=3", "train.log_every=1", "parallel.global_batch_size=8", "parallel.micro_batch_size=4", "log.wandb=false",
        "log.progress=false", check=True,
    )  # fmt: skip
    model = run_config(healed).model
    assert model.num_layers == 3 and len(train_losses(healed)) == 3
    assert model.hidden_size == 48 and model.head_dim == (16 if source.name == "llama" else None)


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
    scores = importance(model, [Batch.from_windows(rows)])
    assert int(torch.argmin(scores.layers)) == 2 and float(scores.layers[2]) < 1e-6
    assert len(scores.channels) == 4 and scores.channels[0].shape == (cfg.hidden_size * 4,)


def test_a_silenced_head_and_a_silenced_channel_are_the_least_important():
    """Head and hidden importance are measured: a head whose values are zero gives nothing to the
    output projection (importance 0, pruned first), a channel every norm zeroes likewise."""
    from suite.compress.prune import importance
    from suite.config.schema import ModelConfig
    from suite.data.batch import Batch
    from suite.models import build_model, materialize

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=64, max_seq_len=16)
    model = materialize(build_model(cfg), "cpu", seed=1).eval()
    with torch.no_grad():
        wv = model.layers["1"].attention.wv
        wv.weight[16:24] = 0.0  # head 2 of layer 1 (head_dim 8)
        wv.bias[16:24] = 0.0
        for name, module in model.named_modules():
            if name.endswith("norm"):
                module.weight[5] = 0.0
                module.bias[5] = 0.0
    rows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    scores = importance(model, [Batch.from_windows(rows)])
    assert [s.shape for s in scores.heads] == [(4,), (4,)] and scores.hidden.shape == (32,)
    assert int(torch.argmin(scores.heads[1])) == 2 and float(scores.heads[1][2]) == 0.0
    assert float(scores.heads[0].min()) > 0
    assert int(torch.argmin(scores.hidden)) == 5 and float(scores.hidden[5]) == 0.0


def test_pruned_heads_are_the_most_important_of_each_group_and_exact(source, tmp_path):
    """prune.heads=0.5: GPT (4 heads) keeps 2 per layer, the Llama (4 query heads in 2 KV groups)
    keeps 1 query head of each group and both KV heads. The pruned model computes what the source
    computes with the dropped heads' outputs zeroed (columns of wo), and the heads kept are the
    highest-scoring ones the report lists (per group)."""
    from suite.infer.generate import load_for_inference

    report = prune(source, tmp_path / "pruned", "prune.heads=0.5")
    full, _, _ = load_for_inference(source)
    small, _, _ = load_for_inference(tmp_path / "pruned")
    grouped = source.name == "llama"
    assert report["num_heads"] == [4, 2] and small.cfg.num_heads == 2
    assert small.cfg.hidden_size == 64 and small.cfg.head_dim == 16  # 64 / 2 heads would be 32
    assert small.cfg.num_kv_heads == (2 if grouped else None)
    size = 16
    with torch.no_grad():
        for layer, kept in enumerate(report["heads_kept"]):
            scores = torch.tensor(report["head_importance"][layer])
            groups = [[0, 1], [2, 3]] if grouped else [[0, 1, 2, 3]]
            per = 2 // len(groups)
            for group in groups:  # the kept heads of each group are its top-scoring ones
                mine = [h for h in kept if h in group]
                assert len(mine) == per, (kept, groups)
                best = torch.topk(scores[group], per).indices.tolist()
                assert sorted(group[i] for i in best) == mine, (layer, scores, kept)
            att_small, att_full = small.layers[str(layer)].attention, full.layers[str(layer)].attention
            rows = torch.cat([torch.arange(h * size, (h + 1) * size) for h in kept])
            assert torch.equal(att_small.wq.weight, att_full.wq.weight[rows])
            if grouped:  # every KV head stays
                assert torch.equal(att_small.wk.weight, att_full.wk.weight)
            dropped = torch.ones(4 * size, dtype=torch.bool)
            dropped[rows] = False
            att_full.wo.weight[:, dropped] = 0.0
        ids = torch.randint(0, small.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        assert (small(ids) - full(ids)).abs().max() <= 1e-5


@pytest.mark.parametrize("source", ["llama"], indirect=True)  # GPT: tested below (GPT-2 cannot hold it)
def test_heads_hidden_and_mlp_pruned_llama_exports_to_transformers(source, tmp_path):
    report = prune(source, tmp_path / "pruned", "prune.heads=0.5", "prune.hidden=0.25", "prune.ffn=0.25")
    assert report["num_heads"] == [4, 2] and report["hidden_size"] == [64, 48] and report["head_dim"] == 16
    assert report["after"]["params"] < report["before"]["params"]
    assert export_and_compare(tmp_path / "pruned", tmp_path / "hf") <= 1e-4
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["head_dim"]) == (48, 2, 16)
    run_suite(
        "generate", f"ckpt={tmp_path / 'pruned'}", "prompt=The", "generate.max_new_tokens=4", check=True
    )


@pytest.mark.parametrize("source", ["gpt"], indirect=True)  # the GPT-2 export limitation
def test_a_gpt_with_pruned_heads_runs_in_the_suite_but_does_not_export(source, tmp_path):
    pruned = tmp_path / "pruned"
    report = prune(source, pruned, "prune.heads=0.25")
    assert report["num_heads"] == [4, 3] and report["head_dim"] == 16
    run_suite("generate", f"ckpt={pruned}", "prompt=The", "generate.max_new_tokens=4", check=True)
    run_suite("eval", f"ckpt={pruned}", "task=reverse-4", "eval.num_samples=2", check=True)
    proc = run_suite("export", f"ckpt={pruned}", f"out={tmp_path / 'hf'}")
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err)
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for word in ("model.head_dim=16", "GPT-2", "prune.ffn", "prune.hidden"):
        assert word in err, (word, err)
    assert not (tmp_path / "hf").exists()


def test_a_llama_whose_hidden_size_is_no_multiple_of_its_heads_is_refused_before_export():
    """transformers 5's configs refuse hidden_size % num_attention_heads != 0 even with head_dim set
    (8 heads pruned to 6 at width 256): one line naming the fix, not transformers' traceback."""
    from suite.config.errors import ConfigError
    from suite.config.schema import ModelConfig
    from suite.export.checks import check_hf_exportable

    pruned = ModelConfig(family="llama", hidden_size=256, num_heads=6, num_kv_heads=3, head_dim=32)
    with pytest.raises(ConfigError, match="multiple of the head count") as err:
        check_hf_exportable(pruned)
    assert "hidden 192 for 6 heads of 32" in str(err.value)
    check_hf_exportable(
        ModelConfig(family="llama", hidden_size=192, num_heads=6, num_kv_heads=3, head_dim=32)
    )


def test_whole_kv_groups_go_when_the_fraction_is_whole_groups():
    """8 query heads in 4 KV groups, prune.heads=0.25: 6 heads cannot be shared evenly by 4 groups,
    so the least important group goes with its KV head (num_kv_heads 4 -> 3). The pruned model
    computes what the source computes with that group's query heads zeroed at the output projection."""
    from suite.compress.importance import Importance
    from suite.compress.prune import plan, pruned_config, pruned_state
    from suite.config.schema import ModelConfig, PruneConfig, SuiteConfig
    from suite.models import build_model, materialize

    cfg = ModelConfig(
        family="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=8,
        num_kv_heads=4,
        vocab_size=64,
        max_seq_len=16,
    )
    full = materialize(build_model(cfg), "cpu", seed=3).eval()
    heads = [
        torch.tensor([5.0, 4.0, 1.0, 0.5, 3.0, 3.0, 2.0, 2.0]),
        torch.tensor([1.0, 1.0, 9.0, 9.0, 0.1, 0.2, 4.0, 4.0]),
    ]
    scores = Importance(
        channels=[torch.ones(full.layers["0"].feed_forward.w2.in_features)] * 2,
        heads=heads,
        hidden=torch.ones(64),
        layers=torch.ones(2),
    )
    chosen = plan(SuiteConfig(model=cfg, prune=PruneConfig(heads=0.25)), cfg, scores)
    assert (chosen["heads"], chosen["kv_heads"]) == (6, 3)
    # group scores (L2 of its two heads): layer 0 drops group 1 (heads 2, 3), layer 1 group 2 (heads 4, 5)
    assert [chosen["kept_heads"][i].tolist() for i in (0, 1)] == [[0, 1, 4, 5, 6, 7], [0, 1, 2, 3, 6, 7]]
    small_cfg = pruned_config(cfg, chosen)
    assert (small_cfg.num_heads, small_cfg.num_kv_heads, small_cfg.head_dim) == (6, 3, 8)
    small = materialize(build_model(small_cfg), "cpu", seed=0).eval()
    small.load_state_dict(pruned_state(cfg, full.state_dict(), chosen))
    with torch.no_grad():
        for layer, dropped in (("0", [2, 3]), ("1", [4, 5])):
            for h in dropped:
                full.layers[layer].attention.wo.weight[:, h * 8 : (h + 1) * 8] = 0.0
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        assert (small(ids) - full(ids)).abs().max() <= 1e-5


BAD_INPUT = [  # (family, or None for both; extra overrides; words the error line must hold)
    (None, [], ["nothing to prune"]),
    (None, ["prune.ffn=1.0"], ["prune.ffn=1.0"]),
    (None, ["prune.layers=4"], ["prune.layers=4"]),
    (None, ["prune.heads=1.0"], ["prune.heads=1.0", "[0, 1)"]),
    (None, ["prune.hidden=1"], ["prune.hidden=1", "[0, 1)"]),
    (None, ["prune.hidden=0.999"], ["prune.hidden=0.999", "keeps 0 of 64"]),
    ("gpt", ["prune.heads=0.9"], ["prune.heads=0.9", "keeps 0 of 4", "none would be left"]),
    ("llama", ["prune.heads=0.9"], ["prune.heads=0.9", "none would be left", "prune.heads=0.5 (keeps 2)"]),
    # 3 of 4 query heads cannot be shared evenly by 2 KV groups: the nearest fraction that can
    ("llama", ["prune.heads=0.25"], ["prune.heads=0.25", "2 KV groups", "prune.heads=0.5 (keeps 2)"]),
]


@pytest.mark.parametrize(
    "source,extra,words",
    [
        (f, extra, words)
        for family, extra, words in BAD_INPUT
        for f in ([family] if family else ["gpt", "llama"])
    ],
    indirect=["source"],
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
