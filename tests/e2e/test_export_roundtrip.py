"""`suite export` as a user types it: an HF folder comes back with its own special-token ids and
loads in transformers; a run folder without its tokenizer is one line and exit 2, nothing written."""

from __future__ import annotations

import json
import shutil

from tests.helpers import TINY_MODEL, run_suite
from tests.unit.test_hf_roundtrip import VOCAB, _hf_folder, _ids


def test_hf_folder_with_a_tokenizer_past_the_vocabulary_round_trips(tmp_path):
    """The Qwen2 case of issue 20, through the CLI: the tokenizer's <|endoftext|> is id vocab_size."""
    ids = {"bos_token_id": 11, "eos_token_id": 12, "pad_token_id": None}
    source = _hf_folder(tmp_path / "src", "qwen2", ids, added_eos="<|endoftext|>")
    out = tmp_path / "out"
    proc = run_suite("export", f"ckpt=hf:{source}", f"out={out}", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["out"] == str(out)
    for file in ("config.json", "generation_config.json"):
        assert _ids(out, file) == ids, file
    # transformers loads it (the export checked that too); no id at or past the vocabulary
    assert VOCAB not in _ids(out, "config.json").values()


def test_a_run_folder_without_its_tokenizer_is_one_line_exit_2(tmp_path, tiny_data):
    run = tmp_path / "run"
    run_suite(
        "pretrain",
        *TINY_MODEL,
        f"data.path={tiny_data}",
        f"run.dir={run}",
        "train.max_steps=1",
        "train.eval_every=1",
        "train.eval_batches=1",
        "parallel.micro_batch_size=2",
        "parallel.global_batch_size=2",
        check=True,
        timeout=300,
    )
    shutil.move(run / "tokenizer.json", tmp_path / "tokenizer.json")
    out = tmp_path / "out"
    proc = run_suite("export", f"ckpt={run}", f"out={out}", timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "has no tokenizer.json" in lines[0] and "copy the data folder's tokenizer.json" in lines[0]
    assert not out.exists()
    shutil.move(tmp_path / "tokenizer.json", run / "tokenizer.json")  # put back: it exports, verified
    run_suite("export", f"ckpt={run}", f"out={out}", check=True, timeout=300)
    config = json.loads((out / "config.json").read_text())
    assert all(
        config[k] is None or 0 <= config[k] < 512 for k in ("bos_token_id", "eos_token_id", "pad_token_id")
    )
    assert config["eos_token_id"] is not None
