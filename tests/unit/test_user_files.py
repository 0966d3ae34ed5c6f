"""suite.user_files: every way a user's file can be wrong is one ConfigError line naming the file, the
line or byte, and a fix that works; valid files read as before."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
from pathlib import Path

import pytest

from suite import user_files
from suite.config.errors import ConfigError
from suite.config.schema import DataSourceConfig
from suite.data.sft import iter_sft_rows
from suite.data.streams import read_source
from suite.output_paths import check_output_folder, check_replaceable
from tests.suggested_fix import ways_on

ROWS = [{"text": "café au lait"}, {"text": "naïve résumé"}, {"text": "plain"}]


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, ConfigError)
    return message


def _latin1_jsonl(path: Path) -> Path:
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS).encode("latin-1"))
    return path


def _run_fix(message: str) -> None:
    """Run the shell command a message suggests (`iconv ...`), as a user would (tests/suggested_fix.py)."""
    (way,) = ways_on(message)
    for command in way.commands:
        subprocess.run(command, shell=True, check=True)


# ---- encodings ---------------------------------------------------------------------------------------
def test_latin1_jsonl_names_line_and_byte_and_the_iconv_fix_works(tmp_path):
    path = _latin1_jsonl(tmp_path / "rows.jsonl")
    with pytest.raises(ConfigError) as err:
        list(user_files.json_lines(path, "data.sources[0]"))
    message = _one_line(err)
    assert message.startswith(f"data.sources[0]: '{path}' is not UTF-8 text (line 1, byte 13: 0xe9)")
    assert "iconv -f latin1 -t utf-8" in message
    _run_fix(message)
    fixed = tmp_path / "rows.utf8.jsonl"
    assert [r for _, r in user_files.json_lines(fixed)] == ROWS


def test_a_bad_byte_further_down_is_located_in_the_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = '{"text": "fine"}\n'
    path.write_bytes(good.encode() * 2 + b'{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=rf"line 3, byte {2 * len(good) + 13}: 0xe9"):
        list(user_files.json_lines(path))


def test_windows_text_gets_cp1252_and_the_fix_works(tmp_path):
    path = tmp_path / "book.txt"
    text = "\u201cquoted\u201d \u2014 caf\u00e9\n"
    path.write_bytes(text.encode("cp1252"))
    with pytest.raises(ConfigError) as err:
        user_files.read_text(path, "data.sources[0]")
    message = _one_line(err)
    assert "iconv -f cp1252 -t utf-8" in message
    _run_fix(message)
    assert user_files.read_text(tmp_path / "book.utf8.txt") == text


def test_gzipped_jsonl_reads_and_its_encoding_fix_works(tmp_path):
    good = tmp_path / "ok.jsonl.gz"
    with gzip.open(good, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in ROWS)
    assert [r for _, r in user_files.json_lines(good)] == ROWS
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(_latin1_jsonl(tmp_path / "x.jsonl").read_bytes()))
    with pytest.raises(ConfigError) as err:
        list(user_files.json_lines(bad))
    _run_fix(_one_line(err))
    assert [r for _, r in user_files.json_lines(tmp_path / "bad.utf8.jsonl.gz")] == ROWS


def test_a_leading_bom_is_not_an_invalid_json_line(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\n")
    assert list(user_files.json_lines(path)) == [(1, ROWS[0])]


# ---- formats and junk --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "name", "expected"),
    [
        (random.Random(0).randbytes(20_000), "junk.txt", "holds binary data, not text"),
        (b"\x00" * 100, "zeros.txt", "a NUL byte at byte 0"),
        (b"PAR1\x15\x04\x15\x10", "table.txt", "is a Parquet file; copy it to that name with `cp"),
        (
            gzip.compress(b'{"text": "a"}\n', mtime=0),
            "rows.jsonl",
            "gzip-compressed; copy it to that name with `cp",
        ),
        ("text".encode("utf-16"), "wide.txt", "UTF-16 text; re-encode it as UTF-8 with `iconv -f utf-16"),
        (b"PK\x03\x04rest", "archive.jsonl", "a zip archive"),
    ],
    ids=["random-bytes", "nul-bytes", "parquet", "gzip", "utf-16", "zip"],  # the same on every xdist worker
)
def test_binary_and_other_formats_are_named(tmp_path, content, name, expected):
    path = tmp_path / name
    path.write_bytes(content)
    read = user_files.read_text if name.endswith(".txt") else lambda p, w: list(user_files.json_lines(p, w))
    with pytest.raises(ConfigError) as err:
        read(path, "data.sources[0]")
    message = _one_line(err)
    assert f"'{path}'" in message and expected in message


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"just some text\n", "is not a Parquet file (no Parquet header); it looks like text"),
        (b'{"text": "a"}\n', "it looks like JSON, read as .jsonl"),
        (b"", "is empty (0 bytes)"),
        (b"\x00\x01\x02\x03" * 64, "convert it to Parquet"),
    ],
)
def test_a_parquet_that_is_not_parquet(tmp_path, content, expected):
    path = tmp_path / "table.parquet"
    path.write_bytes(content)
    for read in (user_files.parquet_columns, user_files.read_parquet):
        with pytest.raises(ConfigError) as err:
            read(path, "data.sources[0]")
        assert f"data.sources[0]: '{path}'" in _one_line(err) and expected in str(err.value)


def test_a_cut_parquet_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "table.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS * 50), path)
    assert user_files.read_parquet(path).to_pylist() == ROWS * 50
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConfigError, match="is not a readable Parquet file"):
        user_files.read_parquet(path)


def test_missing_and_folder_paths(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        user_files.read_text(tmp_path / "nope.txt")
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        list(user_files.json_lines(tmp_path))


def test_invalid_json_file_names_line_and_column(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[\n  {"a": 1},\n  {"a": }\n]\n')
    with pytest.raises(ConfigError, match=r"line 3, column 9"):
        user_files.read_json(path)


# ---- YAML ----------------------------------------------------------------------------------------------
def test_yaml_syntax_error_is_file_line_column(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text("stages:\n  pretrain:\n    args: [a=1, b\n")
    with pytest.raises(ConfigError) as err:
        user_files.read_yaml(path, "pipeline recipe")
    message = _one_line(err)
    assert f"{path}:4:1:" in message and "starts at 3:11" in message
    path.write_text("run: {dir: x}\nstages:\n  a: {args: ['x=${stage:b}']}\n")
    assert user_files.read_yaml(path) == {"run": {"dir": "x"}, "stages": {"a": {"args": ["x=${stage:b}"]}}}


# ---- sources: empty, datasets folders ------------------------------------------------------------------
def test_an_empty_source_is_refused_by_name(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path=.*holds no text: '.*empty.txt' is empty"):
        read_source(DataSourceConfig(path=str(tmp_path / "empty.txt")), 0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"SFT source '.*empty.jsonl' holds no rows"):
        list(iter_sft_rows(str(tmp_path / "empty.jsonl")))


def test_a_saved_datasets_folder_is_a_source(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert read_source(DataSourceConfig(path=str(tmp_path / "one")), 0) == [r["text"] for r in ROWS]
    chats = [{"prompt": "Q", "response": "A"}]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(chats)})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert [r for _, r in iter_sft_rows({"path": str(tmp_path / "dict"), "split": "train"})] == chats
    with pytest.raises(ConfigError, match=r"has no split 'test' \(splits: train\)"):
        read_source(DataSourceConfig(path=str(tmp_path / "dict"), split="test"), 0)
    for shard in (tmp_path / "one").glob("*.arrow"):
        shard.unlink()
    with pytest.raises(ConfigError, match=r"is a `datasets` folder that does not load \(.*arrow"):
        read_source(DataSourceConfig(path=str(tmp_path / "one")), 0)


# ---- where the suite writes ------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
def test_unwritable_places_are_tried_not_guessed(tmp_path):
    with pytest.raises(
        ConfigError, match=r"data.path='/proc/suite-x' cannot be created: /proc is not writable"
    ):
        check_replaceable("data.path", "/proc/suite-x", "give another folder")
    with pytest.raises(ConfigError, match=r"out='/proc' is not writable"):
        check_output_folder("out", "/proc", "give another folder")
    assert check_replaceable("data.path", str(tmp_path / "new" / "data"), "x") == tmp_path / "new" / "data"
    assert sorted(tmp_path.iterdir()) == []  # the tries leave nothing behind


def test_a_chat_template_file_in_latin1_is_one_line(tmp_path):
    from types import SimpleNamespace

    from suite.data.chat import resolve_chat_template

    path = tmp_path / "tpl.jinja"
    path.write_bytes("{% for m in messages %}« {{ m.content }} »{% endfor %}".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"chat template: '.*tpl.jinja' is not UTF-8 text"):
        resolve_chat_template(SimpleNamespace(chat_template=None), str(path))


def test_a_cut_or_false_gzip_is_named(tmp_path):
    whole = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in ROWS * 200))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError, match=r"'.*cut.jsonl.gz' is cut short or corrupt after line \d+"):
        list(user_files.json_lines(tmp_path / "cut.jsonl.gz"))
    (tmp_path / "plain.jsonl.gz").write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ConfigError, match=r"is not a readable gzip file .*`cp .*\.jsonl`"):
        list(user_files.json_lines(tmp_path / "plain.jsonl.gz"))
