"""Repository-wide safety properties: no unpickling of untrusted files, no secrets in anything a run writes."""

from __future__ import annotations

import ast
from pathlib import Path

from suite.train.loggers import scrub_secrets, scrub_yaml
from tests.helpers import TINY_MODEL, run_suite, suite_env

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("suite", "bench", "scripts") for p in (REPO / folder).rglob("*.py"))


def _calls(tree: ast.AST, dotted: str):
    module, attr = dotted.rsplit(".", 1)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
            value = node.func.value
            if isinstance(value, ast.Name) and value.id == module:
                yield node


def test_torch_load_always_uses_weights_only():
    offenders = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        for call in _calls(tree, "torch.load"):
            flags = {kw.arg: kw.value for kw in call.keywords}
            ok = isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True
            if not ok:
                offenders.append(f"{path.relative_to(REPO)}:{call.lineno}")
    assert not offenders, f"torch.load without weights_only=True at {offenders}"
    assert SOURCES, "no sources scanned"


def test_no_pickle_or_remote_code():
    offenders = []
    for path in SOURCES:
        text = path.read_text()
        tree = ast.parse(text, filename=str(path))
        for node in ast.walk(tree):
            remote = isinstance(node, ast.keyword) and node.arg == "trust_remote_code"
            if remote and not (isinstance(node.value, ast.Constant) and node.value.value is False):
                offenders.append(f"{path.relative_to(REPO)}:{node.value.lineno} trust_remote_code")
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n in ("pickle", "dill", "cloudpickle") for n in names):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports pickle")
    assert not offenders, offenders


def test_secret_looking_values_are_scrubbed():
    config = {"log": {"wandb_api_key": "abc123", "wandb_project": "suite"}, "hf_token": "hf_x", "lr": 1e-3}
    clean = scrub_secrets(config)
    assert clean["log"]["wandb_api_key"] == "***" and clean["hf_token"] == "***"
    assert clean["log"]["wandb_project"] == "suite" and clean["lr"] == 1e-3


def test_secret_names_are_whole_words_and_paths_are_kept():
    config = {
        "data": {"tokenizer": "/data/tokenizer.json"},
        "generate": {"max_new_tokens": 8},
        "api-key": "x",
    }
    clean = scrub_secrets(config)
    assert clean["data"]["tokenizer"] == "/data/tokenizer.json" and clean["generate"]["max_new_tokens"] == 8
    assert clean["api-key"] == "***"


def test_known_and_token_shaped_secrets_are_scrubbed_anywhere(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    config = {
        "run": {"name": "run-0123456789abcdef0123456789abcdef01234567"},  # from ${oc.env:WANDB_API_KEY}
        "sources": [{"path": "hub://hf_abcdefghijklmnopqrstuvwxyz0123/x"}],
        "lr": 1e-3,
    }
    clean = scrub_secrets(config)
    assert clean == {"run": {"name": "run-***"}, "sources": [{"path": "hub://***/x"}], "lr": 1e-3}
    yaml = scrub_yaml("run:\n  name: hf_abcdefghijklmnopqrstuvwxyz0123\nlr: 0.001\n")
    assert "hf_abc" not in yaml and "lr: 0.001" in yaml


HF_TOKEN = "hf_" + "Secret0123456789" * 2
WANDB_KEY = "0123456789abcdef" * 2 + "01234567"


def test_no_file_a_run_writes_holds_a_secret(tmp_path, tiny_data):
    """A recipe that pulls credentials into fields (`${oc.env:...}`), with them in the environment:
    config.yaml (run folder and checkpoint), metrics, summary, wandb's offline files and the
    console output hold none of them."""
    run_dir = tmp_path / "run"
    proc = run_suite(
        "pretrain",
        *[a for a in TINY_MODEL if not a.startswith("log.wandb")],
        f"data.path={tiny_data}",
        f"run.dir={run_dir}",
        "train.max_steps=2",
        "train.save_every=2",
        "train.eval_batches=1",
        "parallel.micro_batch_size=4",
        "parallel.global_batch_size=8",
        "log.wandb=true",
        "run.name=${oc.env:HF_TOKEN}",
        "log.wandb_project=p-${oc.env:WANDB_API_KEY}",
        env=suite_env(HF_TOKEN=HF_TOKEN, WANDB_API_KEY=WANDB_KEY, WANDB_MODE="offline"),
        check=True,
    )
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"config.yaml", "metrics.jsonl", "summary.json", "trainer_state.pt"} <= {p.name for p in written}
    assert any("wandb" in p.parts for p in written)
    for secret in (HF_TOKEN, WANDB_KEY):
        assert secret not in proc.stdout + proc.stderr
        leaks = [str(p) for p in written if secret.encode() in p.read_bytes()]
        assert not leaks, f"{secret[:6]}... written to {leaks}"
    assert "name: '***'" in (run_dir / "config.yaml").read_text()
