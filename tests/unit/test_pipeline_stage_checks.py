"""`suite run` checks every stage's command before any stage runs or any folder moves.

Without `_check_stage_args` the embedded pipeline would pretrain for minutes and then fail at the
`sft` stage on a misspelt key (or train it for 3 steps more than asked with a key the verb ignores);
these tests see an exit code of 2, the stage named, and no run folder created (nor an existing one
touched)."""

from __future__ import annotations

import shlex

import pytest

from suite.cli import main


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("sft.train.max_stepz=3", "stage 'sft' (suite finetune): unknown key 'train.max_stepz'"),
        ("sft.train.max_steps=abc", "stage 'sft' (suite finetune): train.max_steps: Value 'abc'"),
        (
            "int8.optim.lr=0.1",
            "stage 'int8' (suite quantize): int8.optim.lr=0.1: suite quantize does not read optim; "
            "drop int8.optim.lr=",
        ),
    ],
)
def test_a_bad_stage_override_stops_the_run_before_anything_runs(tmp_path, capsys, override, said):
    folder = tmp_path / "pipeline"
    assert main(["run", "pipeline=embedded", f"run.dir={folder}", override]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1
    assert not folder.exists()


def test_an_existing_pipeline_folder_is_left_as_it_was(tmp_path, capsys):
    folder = tmp_path / "pipeline"
    (folder / "pretrain").mkdir(parents=True)
    (folder / "pretrain" / "kept.txt").write_text("earlier work")
    before = sorted(p.name for p in folder.rglob("*"))
    assert (
        main(["run", "pipeline=embedded", f"run.dir={folder}", "--overwrite", "eval-sft.eval.num_sample=5"])
        == 2
    )
    assert "unknown key 'eval.num_sample'" in capsys.readouterr().err
    assert sorted(p.name for p in folder.rglob("*")) == before


def test_the_command_suggested_for_an_unfinished_stage_is_the_same_pipeline_from_it(tmp_path, capsys):
    """`--only two` when `two` reads `one`, which has not run: the refusal's command (read by
    tests/suggested_fix.py) names the recipe file, run.dir and the stage override as typed (it used
    to say `pipeline=<name>`, which names no file, and dropped run.dir), and composes to the same
    stages, run from `one`."""
    from suite.pipeline.recipe import load_pipeline
    from suite.pipeline.runner import Run
    from tests.suggested_fix import ways_on

    recipe = tmp_path / "my pipe.yaml"
    recipe.write_text(
        "stages:\n"
        "  one: {verb: generate, args: [ckpt=/nowhere, prompt=hi]}\n"
        "  two: {verb: generate, args: [ckpt=/nowhere, 'prompt=${stage:one}']}\n"
    )
    typed = [f"pipeline={recipe}", f"run.dir={tmp_path / 'out'}", "two.generate.max_new_tokens=2"]
    assert main(["run", *typed, "--only", "two"]) == 2
    assert not (tmp_path / "out").exists()  # a refusal writes nothing (it left pipeline.json, report.md)
    (line,) = capsys.readouterr().err.splitlines()
    (way,) = ways_on(line)
    (command,) = way.commands
    argv = shlex.split(command)
    assert argv[:2] == ["suite", "run"] and argv[-2:] == ["--from", "one"], line
    suggested, original = load_pipeline(argv[2:-2]), load_pipeline(typed)
    assert [s.argv() for s in suggested.stages] == [s.argv() for s in original.stages]
    assert Run(suggested, start="one", only=None).selected == {"one", "two"}


def test_an_override_of_a_section_the_stage_does_not_read_names_the_keys_to_type(tmp_path, capsys):
    """`int8.optim.lr=1e-3` on a quantize stage: the line used to say `drop optim.lr=` (the stage's
    key, not the one typed: dropping it leaves the override in place). It names the override as typed
    and, as the other way on, the stage int8 reads, which trains (where a learning rate takes
    effect); each way, applied as tests/suggested_fix.py reads it, composes."""
    from suite.pipeline.recipe import load_pipeline
    from tests.suggested_fix import ways_on

    recipe = tmp_path / "pipe.yaml"
    recipe.write_text(
        "stages:\n"
        "  sft: {verb: finetune, args: [model.init_from=/nowhere]}\n"
        "  int8: {verb: quantize, args: ['ckpt=${stage:sft}', compress=int8]}\n"
    )
    typed = [f"pipeline={recipe}", f"run.dir={tmp_path / 'out'}", "int8.optim.lr=1e-3"]
    assert main(["run", *typed]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "drop int8.optim.lr=" in line and "sft.optim.lr=1e-3" in line, line
    dropped, moved = ways_on(line)
    assert dropped.apply(typed) == typed[:2]
    pipeline = load_pipeline(moved.apply(typed))
    assert "optim.lr=1e-3" in pipeline.stage("sft", "test").args
    assert not any("optim" in a for a in pipeline.stage("int8", "test").args)
    assert not (tmp_path / "out").exists()
