"""`suite inspect`: the verb added as the docs' example of one module plus one registry line.

It must tell the truth about a folder without loading a model: a checkpoint whose file was changed
after it was written is reported broken and the resume point moves to the one before it (a verb
that trusted `latest` or skipped the manifests would report step 2); a quantize output names its
verb and source (one that read only checkpoints' fingerprints would call it a pretrain run)."""

from __future__ import annotations

import json

from tests.helpers import run_suite


def test_inspect_reads_what_made_a_folder_and_verifies_its_checkpoints(tmp_path, tiny_data):
    run = tmp_path / "run"
    common = [f"data.path={tiny_data}", "model.vocab_size=512", "log.wandb=false", "log.report=false"]
    run_suite("pretrain", f"run.dir={run}", "train.max_steps=2", "train.save_every=1", *common, check=True)

    found = json.loads(run_suite("inspect", str(run), "--json", check=True).stdout)
    assert found["kind"] == "run" and found["made_by"] == "pretrain"
    assert [c["name"] for c in found["checkpoints"] if c["verified"]] == ["step_1", "step_2"]
    assert found["resumes_from"] == "step_2" and found["identity"]["optim.name"] == "adamw"
    assert found["model"]["vocab_size"] == 512

    weights = next(
        p for p in (run / "checkpoints" / "step_2").rglob("*") if p.is_file() and p.suffix == ".distcp"
    )
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit pattern changed, the size kept: only the checksum tells
    weights.write_bytes(bytes(data))
    found = json.loads(run_suite("inspect", str(run), "--json", check=True).stdout)
    assert [c["verified"] for c in found["checkpoints"]] == [True, False]
    assert found["resumes_from"] == "step_1" and found["latest"] == "step_2"
    text = run_suite("inspect", str(run), check=True).stdout
    assert "broken: step_2" in text and "a resume continues from: step_1" in text

    out = tmp_path / "int8"
    run_suite("quantize", f"ckpt={run}", "compress=int8", f"run.dir={out}", *common[:1], check=True)
    found = json.loads(run_suite("inspect", str(out), "--json", check=True).stdout)
    assert found["made_by"] == "quantize" and found["settings"]["compress.method"] == "int8"
    assert str(run / "checkpoints" / "step_1") in found["source"]


def test_inspect_refuses_in_one_line(tmp_path):
    proc = run_suite("inspect", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "holds no record" in proc.stderr
    proc = run_suite("inspect", str(tmp_path), "train.max_steps=3")
    assert proc.returncode == 2 and "inspect takes one folder and no keys" in proc.stderr
