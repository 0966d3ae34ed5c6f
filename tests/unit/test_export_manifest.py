"""suite.export.manifest: the fields every export's export_manifest.json holds, and the config hash."""

from __future__ import annotations

import dataclasses
import json

from suite.config.schema import ModelConfig
from suite.export.manifest import MANIFEST_FILE, config_hash, write_manifest
from suite.model_source import ModelSource
from tests.unit.test_hf_roundtrip import _hf_folder


def test_config_hash_is_stable_and_sees_every_field():
    cfg = ModelConfig(name="m", family="llama", num_layers=2, hidden_size=64, num_heads=4, vocab_size=512)
    assert config_hash(cfg) == config_hash(dataclasses.replace(cfg))
    assert len(config_hash(cfg)) == 64
    assert config_hash(cfg) != config_hash(dataclasses.replace(cfg, norm_eps=1e-6))


def test_write_manifest_records_source_files_and_verification(tmp_path):
    source = ModelSource.parse(f"hf:{_hf_folder(tmp_path / 'src', 'llama', {'eos_token_id': 2})}")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.bin").write_bytes(b"1234")
    (out / "tokenizer.json").write_text("{}")
    path = write_manifest(
        out,
        format="onnx",
        precision="int8",
        source=source,
        files=["model.bin", "tokenizer.json"],
        verification={"max_abs_logits_error": 1e-5},
        extra={"opset": 18},
    )
    assert path == out / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    assert manifest["format"] == "onnx" and manifest["precision"] == "int8" and manifest["opset"] == 18
    assert manifest["files"] == {"model.bin": 4, "tokenizer.json": 2}
    assert manifest["tokenizer_files"] == ["tokenizer.json"]
    assert manifest["source"] == {
        "ckpt": source.text,
        "path": str(source.folder),
        "step": None,
        "hugging_face_folder": True,
        "gguf_file": False,  # a gguf:<file> source (suite/gguf_file.py) says so here
    }
    assert manifest["config_sha256"] == config_hash(source.model_config())
    assert manifest["model"]["family"] == "llama" and manifest["verification"]["max_abs_logits_error"] == 1e-5
