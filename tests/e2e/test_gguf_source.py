"""`ckpt=gguf:<file>` refused in one line (exit 2, no traceback) when the file cannot be a model:
not a GGUF file, a damaged one (truncated inside its tensor data), an architecture no model family
maps, a missing file. The reading itself is checked on the suite's own exports
(tests/e2e/test_export_gguf.py) and on a real checkpoint (tests/e2e/test_real_model.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.forked_cli import ForkedCLI
from tests.helpers import suite_env


def _gguf(path: Path, arch: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((64, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_gguf_sources_are_one_line(tmp_path):
    (tmp_path / "text.gguf").write_text("not a gguf file, just text\n" * 8)
    whole = _gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(whole[: len(whole) - 4096])
    _gguf(tmp_path / "bert.gguf", "bert")
    cases = {
        "text.gguf": "not a readable GGUF file (GGUF magic invalid)",
        "truncated.gguf": "not a readable GGUF file",
        "bert.gguf": "is a 'bert' GGUF; importable GGUF architectures: gpt2, llama, qwen3",
        "missing.gguf": "no such file; give gguf:<a .gguf file>",
    }
    cli = ForkedCLI(suite_env())
    try:
        for name, expected in cases.items():
            for argv in (["generate", f"ckpt=gguf:{tmp_path / name}", "prompt=hi"],):
                proc = cli.run(argv, tmp_path)
                lines = [line for line in proc.stderr.splitlines() if line.strip()]
                assert proc.returncode == 2, (argv, proc.stderr)
                assert len(lines) == 1 and lines[0].startswith("error: "), (argv, proc.stderr)
                assert expected in lines[0], (argv, lines[0])
    finally:
        cli.close()
