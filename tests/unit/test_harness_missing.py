"""Without lm-evaluation-harness installed, `suite eval harness=...` is one line and exit 2 (the
import is simulated as failing: lm_eval stays an optional dependency)."""

from __future__ import annotations

import sys

from suite.cli import main


def test_missing_lm_eval_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")  # enough for ckpt=hf:<dir> to parse
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    monkeypatch.delitem(sys.modules, "suite.infer.harness", raising=False)
    assert main(["eval", f"ckpt=hf:{tmp_path}", "harness=suite_tiny_mc"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "error: eval.harness needs lm-evaluation-harness: pip install 'suite[harness]' (or lm-eval==0.4.13)"
    ]
    assert "suite.infer.harness" not in sys.modules
