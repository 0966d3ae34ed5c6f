"""metrics.jsonl on resume: records past the resumed step are dropped, and a last line cut short (a
full disk's short write, a kill) does not stop the resume."""

from __future__ import annotations

import json

from suite.train.loggers import JsonlWriter


def test_resume_drops_later_records_and_a_cut_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s, "loss": 6.0 - s / 10}) + "\n" for s in range(1, 8))
    path.write_text(whole + '{"step": 8, "lo')  # the line of step 8 was being written
    writer = JsonlWriter(path, resume_step=5)
    writer.write({"step": 6, "loss": 5.5})
    writer.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
