"""A refused output place names a folder to type instead (suite.output_paths.instead), and that
folder passes the same check: read as tests/suggested_fix.py reads any refusal and applied to the
refused argument. Each used to print a placeholder (`out=<a new or empty folder>`, `run.dir=<a folder
you can write>`, `data.path=<new folder>`) that no check could take."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

import suite.cli.verbs  # noqa: F401 (registers the verbs: a pipeline's stages are verbs)
from suite.cli import main
from suite.config.compose import compose_config, to_object
from suite.config.errors import ConfigError
from suite.data.checks import check_data
from suite.export.checks import check_export_out
from suite.output_paths import check_run_dir, instead
from suite.pipeline.recipe import load_pipeline
from suite.report.build import _out_folder
from tests.helpers import TINY_MODEL
from tests.suggested_fix import ways_on


def _export(value: str) -> None:
    check_export_out(value)


def _report(value: str) -> None:
    _out_folder(value)


def _run_dir(value: str) -> None:
    check_run_dir(value)


CHECKS = {"export": ("out", _export), "report": ("out", _report), "pretrain": ("run.dir", _run_dir)}


@pytest.fixture
def places(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing.txt").write_text("a file the user keeps\n")
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "notes.txt").write_text("unrelated\n")
    return tmp_path


@pytest.mark.parametrize(
    ("verb", "value"),
    [
        ("export", "/proc/suite-export"),
        ("export", "{tmp}/existing.txt"),
        ("export", "{tmp}/nonempty"),
        ("report", "/proc/suite-report"),
        ("report", "{tmp}/existing.txt"),
        ("pretrain", "/proc/suite-run"),
        ("pretrain", "{tmp}/existing.txt"),
        ("pretrain", ""),
    ],
)
def test_a_refused_output_place_names_one_that_passes(places, verb, value):
    value = value.replace("{tmp}", str(places))
    key, check = CHECKS[verb]
    with pytest.raises(ConfigError) as refused:
        check(value)
    line = str(refused.value)
    assert "<" not in line, line
    (way,) = ways_on(line)
    (fixed,) = way.apply([f"{key}={value}"])
    new = fixed.split("=", 1)[1]
    check(new)  # passes the check that refused the old one
    assert Path(new).resolve() != Path(value).resolve() if value else new


def test_instead_is_beside_the_folder_or_in_the_current_one(places):
    assert instead(places / "nonempty") == places / "nonempty-2"
    (places / "nonempty-2").mkdir()
    assert instead(places / "nonempty") == places / "nonempty-3"
    assert instead("/proc/suite-x") == Path("suite-x")  # nothing can be made in /proc: the current folder
    (places / "suite-x").mkdir()
    assert instead("/proc/suite-x") == Path("suite-x-2")


def test_a_pipeline_run_dir_that_cannot_be_written_names_one_that_can(places):
    recipe = places / "pipe.yaml"
    recipe.write_text("stages:\n  one: {verb: generate, args: [ckpt=/nowhere, prompt=hi]}\n")
    typed = [f"pipeline={recipe}", "run.dir=/proc/suite-pipeline"]
    with pytest.raises(ConfigError) as refused:
        load_pipeline(typed)
    (way,) = ways_on(str(refused.value))
    assert load_pipeline(way.apply(typed)).dir == Path("suite-pipeline")


def test_a_data_file_as_data_path_gets_the_prepare_command_that_makes_its_folder(places, capsys):
    """data.path=FILE: the line's `suite prepare ...` command, run as printed, makes the folder the
    line then passes as data.path=, which the same check takes (it said data.path=<new folder>)."""
    corpus = places / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "Line {i}: the station cafe opens at {i}."}}\n' for i in range(40)))
    argv = [*TINY_MODEL, f"data.path={corpus}"]
    with pytest.raises(ConfigError) as refused:
        check_data(to_object(compose_config(argv)))
    line = str(refused.value)
    assert "<" not in line, line
    (way,) = ways_on(line)
    (command,) = way.commands
    assert main(shlex.split(command)[1:]) == 0
    check_data(to_object(compose_config(way.apply(argv))))


def test_overwriting_the_current_folder_suggests_a_folder_of_its_own(tmp_path, monkeypatch):
    """train.overwrite=true never moves the current folder aside; the refusal names a folder that is
    free and that the move then accepts. Fails if the suggestion is a placeholder (runs/<name>) or a
    folder that already holds something."""
    from suite.folders import move_aside

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "out").mkdir(parents=True)
    (tmp_path / "runs" / "out" / "x").write_text("x")
    with pytest.raises(ConfigError) as caught:
        move_aside(Path("."))
    suggested = Path(str(caught.value).rsplit("run.dir=", 1)[1])
    assert suggested == tmp_path / "runs" / "out-2" and not suggested.exists(), caught.value
    suggested.mkdir()
    assert move_aside(suggested).name == "out-2.old-1"
