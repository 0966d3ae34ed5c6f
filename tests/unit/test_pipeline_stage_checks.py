"""`suite run` checks every stage's command before any stage runs or any folder moves.

Without `_check_stage_args` the embedded pipeline would pretrain for minutes and then fail at the
`sft` stage on a misspelt key (or train it for 3 steps more than asked with a key the verb ignores);
these tests see an exit code of 2, the stage named, and no run folder created (nor an existing one
touched)."""

from __future__ import annotations

import pytest

from suite.cli import main


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("sft.train.max_stepz=3", "stage 'sft' (suite finetune): unknown key 'train.max_stepz'"),
        ("sft.train.max_steps=abc", "stage 'sft' (suite finetune): train.max_steps: Value 'abc'"),
        (
            "int8.optim.lr=0.1",
            "stage 'int8' (suite quantize): optim.lr=0.1: suite quantize does not read optim",
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
