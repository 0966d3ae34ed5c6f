"""`suite inspect <folder>`: what a folder the suite wrote holds, what made it, and whether it is whole.

Every folder a verb writes records what made it (suite.folders): a training run in its checkpoints'
fingerprint.json, an export in export_manifest.json, quantize/prune/report/run in made_by.json, a
prepared corpus in meta.json; an HF folder has its config.json. This verb reads those records and
checks what can be checked without loading a model (every checkpoint against its manifest), so a
person handed a folder can tell what it is before running anything on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from suite.cli.common import _report
from suite.config.errors import ConfigError
from suite.folders import RECORD, read_record
from suite.verb import Verb, register

EXPORT_MANIFEST = "export_manifest.json"  # suite.export.manifest.MANIFEST_FILE
PIPELINE_RECORD = "pipeline.json"  # suite.pipeline.runner.RECORD, before made_by.json


def run(overrides: list[str], flags: set[str]) -> int:
    if len(overrides) != 1 or "=" in overrides[0]:
        raise ConfigError(
            "inspect takes one folder and no keys, e.g. suite inspect runs/gpt-tiny "
            f"(got {' '.join(overrides) or 'nothing'})"
        )
    folder = Path(overrides[0]).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{overrides[0]} is not a folder; pass a run, checkpoint, export or data folder")
    found = describe(folder)
    return _report(flags, found, "\n".join(_lines(found)))


def describe(folder: Path) -> dict[str, Any]:
    """{path, kind, made_by, ...}: the first record the folder holds, read as the verb wrote it."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.train import checkpoint as ckpt
    from suite.train.run_folder import saved_fingerprint

    out: dict[str, Any] = {"path": str(folder.resolve())}
    record = read_record(folder)
    if (folder / ckpt.MANIFEST).is_file():  # one checkpoint: <run.dir>/checkpoints/step_<N>
        problem = ckpt.verify(folder)
        fingerprint = saved_fingerprint(folder) or {}
        return out | {
            "kind": "checkpoint",
            "made_by": fingerprint.get("verb"),
            "step": ckpt.checkpoint_step(folder),
            "verified": problem is None,
            **({"problem": problem} if problem else {}),
            "model": _model(folder),
            "identity": _identity(fingerprint),
        }
    if ckpt.checkpoint_root(folder).is_dir():  # a training run, or a quantize / prune output
        return out | _run_folder(folder, record)
    if (folder / EXPORT_MANIFEST).is_file():
        manifest = json.loads((folder / EXPORT_MANIFEST).read_text())
        return out | {
            "kind": "export",
            "made_by": "export",
            "format": manifest.get("format"),
            "precision": manifest.get("precision"),
            "source": manifest.get("source"),
            "model": manifest.get("model"),
            "files": manifest.get("files"),
            "verification": manifest.get("verification"),
        }
    if record is not None or (folder / PIPELINE_RECORD).is_file():
        made = record or {"verb": "run", "settings": {}}
        return out | {
            "kind": "output",
            "made_by": made.get("verb"),
            "source": made.get("source"),
            "settings": made.get("settings"),
        }
    if (folder / "meta.json").is_file() and (folder / "tokenizer.json").is_file():
        meta = json.loads((folder / "meta.json").read_text())
        return out | {"kind": "prepared data", "made_by": "prepare", "data": meta}
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
        weights = sorted(p.name for p in folder.glob("*.safetensors"))
        return out | {
            "kind": "hugging face folder",
            "made_by": None,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "files": {name: (folder / name).stat().st_size for name in weights},
        }
    raise ConfigError(
        f"{folder} holds no record the suite reads: a run folder (checkpoints/), a checkpoint "
        f"(manifest.json), an export ({EXPORT_MANIFEST}), a verb's output ({RECORD}), prepared data "
        "(meta.json) or a Hugging Face folder (config.json)"
    )


def _run_folder(folder: Path, record: dict[str, Any] | None) -> dict[str, Any]:
    """A folder with checkpoints/: every checkpoint verified, the newest good one's identity."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.train import checkpoint as ckpt
    from suite.train.run_folder import saved_fingerprint

    steps = []
    for step_folder in ckpt.list_checkpoints(folder):
        problem = ckpt.verify(step_folder)
        steps.append(
            {
                "name": step_folder.name,
                "verified": problem is None,
                **({"problem": problem} if problem else {}),
            }
        )
    newest = ckpt.latest_checkpoint(folder, log=lambda _: None)
    fingerprint = (saved_fingerprint(newest) if newest is not None else None) or {}
    summary_file = folder / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    made = record or {}
    return {
        "kind": "run" if record is None else "output",
        "made_by": made.get("verb") or fingerprint.get("verb"),
        "source": made.get("source"),
        "settings": made.get("settings"),
        "checkpoints": steps,
        "latest": None if ckpt.named_latest(folder) is None else ckpt.named_latest(folder).name,
        "resumes_from": None if newest is None else newest.name,
        "model": None if newest is None else _model(newest),
        "identity": _identity(fingerprint),
        "summary": summary,
    }


def _model(checkpoint: Path) -> dict[str, Any] | None:
    """The shapes of the model a checkpoint holds, from its config.yaml (no weights read)."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.export.manifest import model_summary
    from suite.model_source import ModelSource

    try:
        return model_summary(ModelSource(str(checkpoint), "inspect", checkpoint, False).model_config())
    except (ConfigError, OSError, ValueError):  # a checkpoint from before config.yaml, or an unreadable one
        return None


def _identity(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The keys a resume must match, without the architecture's long list (`model.name` names it)."""
    return {
        k: v
        for k, v in fingerprint.items()
        if k != "verb"
        and (not k.startswith("model.") or k in ("model.name", "model.family", "model.init_from"))
    }


def _lines(found: dict[str, Any]) -> list[str]:
    made = f", made by suite {found['made_by']}" if found.get("made_by") else ""
    lines = [f"{found['path']}: {found['kind']}{made}"]
    if "step" in found:
        lines.append(
            f"  step {found['step']}, " + ("verified" if found["verified"] else f"BROKEN: {found['problem']}")
        )
    if found.get("checkpoints") is not None:
        good = [s["name"] for s in found["checkpoints"] if s["verified"]]
        bad = [f"{s['name']} ({s['problem']})" for s in found["checkpoints"] if not s["verified"]]
        lines.append(f"  checkpoints: {', '.join(good) or 'none that verify'}; latest: {found['latest']}")
        lines += [f"  broken: {b}" for b in bad]
        lines.append(
            f"  a resume continues from: {found['resumes_from'] or 'nothing (no checkpoint verifies)'}"
        )
    for key in ("format", "precision", "model_type", "architectures", "source"):
        if found.get(key) is not None:
            lines.append(
                f"  {key}: {json.dumps(found[key]) if isinstance(found[key], dict | list) else found[key]}"
            )
    for key in ("identity", "settings", "data", "model", "verification", "files", "summary"):
        if found.get(key):
            lines.append(f"  {key}:")
            lines += [
                f"    {k}: {json.dumps(v) if isinstance(v, list) else v}"
                for k, v in found[key].items()
                if not isinstance(v, dict)  # the run's layout and memory detail: in --json
            ]
    return lines


HELP = """usage: suite inspect <folder> [--json]

What a folder the suite wrote holds and how it was made, read from its own records, loading no
model: a training run (its checkpoints, each verified against its manifest; the one a resume would
continue from; the keys a resume must match: model, optimizer, tokenizer, the models it started or
learned from; its summary), one checkpoint, an export (format, source checkpoint and step, the
self-check's logits error), a quantize / prune / report / run output (the verb, its source and
settings), a prepared corpus, or a Hugging Face folder.

Examples:
  suite inspect runs/gpt-tiny
  suite inspect runs/gpt-tiny --json"""

VERB = register(
    Verb(
        name="inspect",
        summary="what a run, checkpoint, export or data folder holds and how it was made: suite inspect runs/gpt-tiny",
        help=HELP,
        run=run,
        section="tools",
    )
)
