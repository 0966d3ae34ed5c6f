"""One rule for every folder the suite writes (issue 39, item 1): a second command into a folder that
holds another verb's, source's or settings' output is refused in one line (exit 2, the folder byte
for byte as it was), naming the difference, a new folder and the overwrite switch; the switch moves
the old content aside (`<folder>.old-<N>`, whole) and writes the new. Readers read a folder's
`latest`. And a quantize report describes the checkpoint on disk (issue 39, item 5).

Two tiny pretraining runs (a, b: the same architecture and tokenizer, other seeds) are the sources.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import TINY_MODEL, run_suite

TRAIN = [
    "train.max_steps=2",
    "train.save_every=2",
    "train.eval_every=2",
    "train.eval_batches=1",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=2",
]
REPORT = ["compress.eval_batches=1", "compress.decode_tokens=2", "compress.calib_samples=4"]
FT = [
    "recipe=sft-tiny",
    "log.wandb=false",
    "log.progress=false",
    "log.report=false",
    "data.seq_len=64",
    "finetune.data.task=reverse-3",
    "finetune.data.num_train=16",
    "finetune.data.num_eval=4",
    "finetune.eval_samples=1",
    "train.eval_every=2",
    "train.precision=fp32",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=2",
]


def ok(*args: str):
    proc = run_suite(*args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        out[name] = root / name
        ok(
            "pretrain",
            *TINY_MODEL,
            *TRAIN,
            f"data.path={tiny_data}",
            f"run.dir={out[name]}",
            f"train.seed={seed}",
        )
    return out


def test_quantize_report_describes_the_checkpoint_on_disk(runs, tmp_path):
    """compress.skip=[] on a tied model: the head is the embedding, which stays as it is on disk; the
    report said parameters grew 1.39x and the reloaded logits differed by 0.011."""
    q = tmp_path / "tied"
    proc = ok(
        "quantize",
        f"ckpt={runs['a']}",
        "compress=int8",
        "compress.skip=[]",
        f"run.dir={q}",
        *REPORT,
        "--json",
    )
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["reload_max_abs_diff"] == 0.0
    assert report["after"]["params"] == report["before"]["params"]
    assert report["skipped_layers"] == ["output"] and report["all_quantized"]


def test_quantize_commits_through_the_one_commit(monkeypatch, tmp_path):
    """suite.train.checkpoint.commit (manifest, fsync, rename, atomic `latest`) writes every checkpoint."""
    from suite.compress import quantize
    from suite.config.schema import ModelConfig
    from suite.models import build_model, materialize
    from suite.train import checkpoint

    calls = []
    real = checkpoint.commit
    monkeypatch.setattr(checkpoint, "commit", lambda *a: (calls.append(a), real(*a))[1])
    model = materialize(
        build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, vocab_size=64)), "cpu", seed=0
    )
    final = quantize._write_checkpoint(tmp_path, 3, model, {"method": "none"}, "model: {}\n")
    assert [c[1:] for c in calls] == [(final, 3)]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_3\n" and checkpoint.verify(
        final
    ) is None


def test_readers_read_latest_not_the_highest_step(runs, tmp_path):
    """A step folder beside the one `latest` names (a leftover, never committed last) is not read."""
    from suite.sources import ModelSource

    run = tmp_path / "run"
    shutil.copytree(runs["a"], run)
    shutil.copytree(run / "checkpoints" / "step_2", run / "checkpoints" / "step_9")
    assert ModelSource.parse(str(run)).folder == run / "checkpoints" / "step_2"
