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

from tests.e2e.test_run_folders import assert_one_line, snapshot
from tests.helpers import TINY_MODEL, run_config, run_suite
from tests.suggested_fix import ways_on

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


def files(folder: Path) -> dict[str, tuple[str, int, int]]:
    return {k: v for k, v in snapshot(folder).items() if k != "."}


def refused_then_moved(folder: Path, refused: list[str], expected: list[str], new: bool = False) -> Path:
    """`refused` is one line naming `expected`, the folder untouched, and the two ways on, each as
    something to type (tests/suggested_fix.py reads them as a user would): a new folder (run too
    with `new`: the old folder stays as it is) and the overwrite switch, which, run as printed, moves
    the whole old content to <folder>.old-1; any further way offered runs as printed too. Returns
    <folder>.old-1."""
    before = snapshot(folder)
    line = assert_one_line(run_suite(*refused, timeout=300), 2, *expected)
    assert snapshot(folder) == before  # byte for byte, mtimes included
    elsewhere, overwrite, *further = ways_on(line)
    (value,) = [a.split("=", 1)[1] for a in elsewhere.args]
    assert Path(value).parent == folder.parent and not Path(value).exists(), line
    if new:
        ok(*elsewhere.apply(refused))
        assert snapshot(folder) == before and Path(value).is_dir()
    assert overwrite.flags == ["--overwrite"] or overwrite.args == ["train.overwrite=true"], line
    proc = ok(*overwrite.apply(refused))
    moved = folder.with_name(f"{folder.name}.old-1")
    assert "moved the previous" in proc.stdout and str(moved) in proc.stdout, proc.stdout
    assert files(moved) == {k: v for k, v in before.items() if k != "."}  # the old content, whole
    for way in further:
        ok(*way.apply(refused))
    return moved


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


def test_quantize_of_another_model_is_refused_then_moved_aside(runs, tmp_path):
    q = tmp_path / "q"
    ok("quantize", f"ckpt={runs['a']}", "compress=int8", f"run.dir={q}", *REPORT)
    ok("quantize", f"ckpt={runs['a']}", "compress=int8", f"run.dir={q}", *REPORT)  # the same again: continues
    argv = ["quantize", f"ckpt={runs['b']}", "compress=int4", f"run.dir={q}", *REPORT]
    moved = refused_then_moved(
        q, argv, ["run.dir=", "compress.method: int8 there, int4 now", "source:", "--overwrite"]
    )
    assert [p.name for p in (q / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_2"]
    assert json.loads((q / "made_by.json").read_text())["settings"]["compress.method"] == "int4"
    assert json.loads((moved / "made_by.json").read_text())["settings"]["compress.method"] == "int8"
    proc = ok("generate", f"ckpt={q}", "prompt=The ", "generate.max_new_tokens=2")
    assert str(q / "checkpoints" / "step_2") in proc.stderr


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


def test_prune_with_another_plan_is_refused_then_moved_aside(runs, tmp_path):
    p = tmp_path / "p"
    base = ["prune", f"ckpt={runs['a']}", f"run.dir={p}", *REPORT]
    ok(*base, "prune.ffn=0.25")
    refused_then_moved(p, [*base, "prune.ffn=0.5"], ["prune.ffn: 0.25 there, 0.5 now", "--overwrite"])
    assert json.loads((p / "made_by.json").read_text())["settings"]["prune.ffn"] == 0.5


def test_distill_resumed_with_another_teacher_is_refused_then_moved_aside(runs, tmp_path, tiny_data):
    d = tmp_path / "d"
    argv = ["distill", *TINY_MODEL, *TRAIN, f"data.path={tiny_data}", f"run.dir={d}", "train.max_steps=1"]
    ok(*argv, f"distill.teacher={runs['a']}")
    again = [*argv, f"distill.teacher={runs['b']}", "train.max_steps=2"]
    refused_then_moved(d, again, ["distill.teacher:", "train.overwrite=true", "run.dir="])
    assert run_config(d).distill.teacher == str(runs["b"])


def test_finetune_resumed_from_another_base_is_refused_then_moved_aside(runs, tmp_path):
    f = tmp_path / "f"
    ok(
        "finetune",
        *FT,
        f"model.init_from={runs['a']}",
        f"run.dir={f}",
        "train.max_steps=1",
        "train.save_every=1",
    )
    again = [
        "finetune",
        *FT,
        f"model.init_from={runs['b']}",
        f"run.dir={f}",
        "train.max_steps=2",
        "train.save_every=1",
    ]
    refused_then_moved(f, again, ["model.init_from:", "train.overwrite=true", "run.dir="])
    assert run_config(f).model.init_from == str(runs["b"])


def test_export_into_another_format_or_source_is_refused_then_moved_aside(runs, tmp_path):
    e = tmp_path / "e"
    ok("export", f"ckpt={runs['a']}", "format=gguf", f"out={e}")
    before = snapshot(e)
    for argv, named in (
        (["export", f"ckpt={runs['a']}", "format=onnx", f"out={e}"], "export.format: gguf there, onnx now"),
        (["export", f"ckpt={runs['b']}", "format=gguf", f"out={e}"], "source:"),
    ):
        assert_one_line(run_suite(*argv), 2, "export.out=", named, "--overwrite")
        assert snapshot(e) == before
    argv = ["export", f"ckpt={runs['a']}", "format=hf", f"out={e}"]
    refused_then_moved(e, argv, ["export.format: gguf there, hf now"])
    assert not list(e.glob("*.gguf"))
    assert not any(
        name.endswith(".gguf") for name in json.loads((e / "export_manifest.json").read_text())["files"]
    )


def test_report_into_another_run_is_refused_then_moved_aside(runs, tmp_path):
    other = tmp_path / "other-run"
    shutil.copytree(runs["b"], other)
    argv = ["report", str(runs["a"]), f"out={other}"]
    refused_then_moved(other, argv, ["out=", "report", "--overwrite"], new=True)
    assert (other / "report.md").is_file()
    r = tmp_path / "r"
    ok("report", str(runs["a"]), f"out={r}")
    ok("report", str(runs["a"]), f"out={r}")  # the same report again: rewritten
    before = snapshot(r)
    assert_one_line(
        run_suite("report", str(runs["a"]), str(runs["b"]), f"out={r}"), 2, "source:", "--overwrite"
    )
    assert snapshot(r) == before


def _pipeline(folder: Path, name: str, ckpt: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    args = json.dumps([f"ckpt={ckpt}", "prompt=The", "generate.max_new_tokens=2", "generate.temperature=0"])
    path.write_text(f"stages:\n  say-{name}:\n    verb: generate\n    args: {args}\n")
    return path


def test_another_pipeline_into_a_pipeline_folder_is_refused_then_moved_aside(runs, tmp_path):
    out = tmp_path / "pipe"
    ok("run", f"pipeline={_pipeline(tmp_path / 'recipes', 'one', runs['a'])}", f"run.dir={out}")
    argv = ["run", f"pipeline={_pipeline(tmp_path / 'recipes', 'two', runs['b'])}", f"run.dir={out}"]
    refused_then_moved(out, argv, ["run.dir=", "pipeline: one there, two now", "--overwrite"])
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["logs", "say-two"]
    # the same pipeline with a stage's command changed: that stage (a result, not a training run) is
    # rerun from scratch, its old folder moved aside beside it, whole, never deleted
    before = files(out / "say-two")
    proc = ok(*argv, "say-two.generate.max_new_tokens=3", "--overwrite")
    assert "say-two changed since it finished" in proc.stdout and "say-two.old-1" in proc.stdout, proc.stdout
    assert files(out / "say-two.old-1") == before
    assert files(out / "say-two") != before and (out / "say-two" / "result.json").is_file()


def test_readers_read_latest_not_the_highest_step(runs, tmp_path):
    """A step folder beside the one `latest` names (a leftover, never committed last) is not read."""
    from suite.model_source import ModelSource

    run = tmp_path / "run"
    shutil.copytree(runs["a"], run)
    shutil.copytree(run / "checkpoints" / "step_2", run / "checkpoints" / "step_9")
    assert ModelSource.parse(str(run)).folder == run / "checkpoints" / "step_2"


def test_align_resumed_with_another_method_is_refused_then_moved_aside(runs, tmp_path):
    """`suite align` (DPO, then SimPO into the same folder): the method defines the run."""
    from suite.align.pairs import task_pairs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in task_pairs("reverse-3", 8)))
    al = tmp_path / "al"
    argv = [
        "align",
        *[a for a in FT if not a.startswith(("recipe=", "finetune."))],
        f"model.init_from={runs['a']}",
        f"align.data={pairs}",
        "align.num_eval=2",
        f"run.dir={al}",
        "train.save_every=1",
    ]
    ok(*argv, "train.max_steps=1")
    again = [*argv, "align.method=simpo", "train.max_steps=2"]
    refused_then_moved(
        al, again, ["align.method: checkpoint dpo, now simpo", "train.overwrite=true", "run.dir="]
    )
    assert run_config(al).align.method == "simpo"


def test_prepare_into_other_prepared_data_is_refused_then_moved_aside(tmp_path):
    """`suite prepare` again into its data.path: nothing to do with the same config (the folder as it
    was), refused with another vocabulary, then moved aside by --overwrite."""
    d = tmp_path / "d"
    argv = ["prepare", f"data.path={d}", "data.max_corpus_mb=0.3", f"data.cache_dir={tmp_path / 'cache'}"]
    ok(*argv, "data.vocab_size=300")
    before = snapshot(d)
    assert "nothing to do" in ok(*argv, "data.vocab_size=300").stdout and snapshot(d) == before
    refused_then_moved(
        d, [*argv, "data.vocab_size=400"], ["data.vocab_size: 300 there, 400 now", "--overwrite"]
    )
    assert json.loads((d / "meta.json").read_text())["vocab_size"] == 400
