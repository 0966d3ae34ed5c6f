"""One run per run folder: what a checkpoint must share with the config that resumes it.

Every checkpoint holds `fingerprint.json`: the keys that must match to resume it (the model's
architecture, the tokenizer, the optimizer's kind, LoRA's shapes; never the parallel degrees,
since any layout resumes any other's checkpoint). Before a training verb starts any worker, the
parent checks its run folder (`check_run_folder`):

- resuming checkpoints whose fingerprint differs from the config refuses, naming the keys;
- `train.resume=false` on a folder with checkpoints refuses: the new run would mix with the old;
- a folder whose checkpoints all fail their manifests refuses: a new run would write over them;
- `train.overwrite=true` moves whatever the folder holds aside (`<run.dir>.old-<N>`), never
  deleting it, and the run starts clean.

A refusal writes nothing: the run folder stays byte for byte as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from suite import folders
from suite.config.compose import load_saved_config
from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig, SuiteConfig
from suite.models.compression import for_training
from suite.train import checkpoint as ckpt
from suite.verb import VERBS, RunIdentity

FINGERPRINT = ckpt.FINGERPRINT
# model keys that do not change the weights a checkpoint holds (or that name where they came from)
NOT_ARCHITECTURE = {
    "name",
    "init_from",
    "dropout",
    "init_std",
    "attention",
    "document_attention",
    "moe_impl",
    "aux_loss_coef",
    "z_loss_coef",
    "capacity_factor",
}
# the models a run starts from or learns from (of_run): another one is another run, not a resume
SOURCE_KEYS = ("model.init_from:", "distill.teacher:")
ARCHITECTURE = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in NOT_ARCHITECTURE]


def fingerprint(cfg: SuiteConfig, verb: str, tokenizer: Path | None = None) -> dict[str, Any]:
    """The flat {dotted key: value} that a checkpoint of this config must share with its resumer:
    what every run records, then the verb's own keys (suite.verb.RunIdentity.keys)."""
    out: dict[str, Any] = {"verb": verb}
    out |= {f"model.{k}": getattr(cfg.model, k) for k in ARCHITECTURE}
    out["optim.name"] = cfg.optim.name
    # compress=qat-*: learned scales are parameters of the checkpoint, on one grid (checkpoints from
    # before this key have none to compare)
    c = cfg.compress
    out["compress.qat"] = (
        f"compress={c.method} compress.group_size={c.group_size} compress.learn_scales={str(c.learn_scales).lower()}"
        if for_training(c.method) is not None
        else "compress=none"
    )  # as overrides: the refusal tells them back
    out |= _identity(verb).keys(cfg)
    if tokenizer is not None and tokenizer.is_file():
        out["tokenizer"] = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    return json.loads(json.dumps(out))  # plain JSON values, as read back from a checkpoint


def of_run(cfg: SuiteConfig, verb: str, data_dir: Path | None = None) -> dict[str, Any]:
    """The fingerprint of the run a training verb starts: `fingerprint` with its tokenizer and the
    models it starts from or learns from (model.init_from, distill.teacher) as they are on disk, so
    that resuming with another source is refused rather than continued under the new name."""
    identity = _identity(verb)
    out = fingerprint(cfg, verb, identity.tokenizer(cfg, data_dir))
    for key, text in identity.sources(cfg).items():
        if text:
            out[key] = _source_identity(str(text), key)
    return out


def _identity(verb: str) -> RunIdentity:
    """A training verb's run identity (suite.verb); a verb without one records the common keys."""
    return VERBS[verb].run_identity or RunIdentity()


def _source_identity(text: str, key: str) -> str:
    """A source as suite.model_source.ModelSource.parse resolves it (parsed there first, by the verb;
    train sits below sources, so only the folder is found here)."""
    imported = folders.imported_path(text)
    if imported is not None:
        return folders.source_identity(imported, True)
    path = Path(
        text
    ).expanduser()  # the checkpoint itself, or the one its run's `latest` names: no re-hashing
    folder = path if (path / ckpt.MANIFEST).is_file() else ckpt.named_latest(path)
    if folder is None or not (folder / ckpt.MANIFEST).is_file():
        try:
            folder = ckpt.find_checkpoint(text)[0]
        except ConfigError as exc:
            raise ConfigError(f"{key}='{text}': {exc}") from None
    return folders.source_identity(folder, False)


def saved_fingerprint(folder: Path) -> dict[str, Any] | None:
    """A checkpoint's fingerprint; for one written before fingerprints, what its config.yaml tells
    (the architecture, optimizer and LoRA keys; not the tokenizer); for one written before the
    `compress.qat` key, that key from its config.yaml. None when neither is readable."""
    try:
        found = json.loads((folder / FINGERPRINT).read_text())
    except (OSError, ValueError):
        found = None
    if found is not None and "compress.qat" in found:
        return found
    try:
        saved = load_saved_config(folder / "config.yaml")
        written = OmegaConf.load(folder / "config.yaml").get("compress") or {}
    except Exception:  # noqa: BLE001 (an old or hand-edited config: nothing to compare)
        return found
    if "learn_scales" not in written:  # before learned scales: QAT recomputed them at every step, so
        saved.compress.learn_scales = False  # the checkpoint holds none (the schema's default is true)
    recorded = fingerprint(saved, "finetune")  # its finetune keys count only where the config has them too
    if found is not None:
        return found | {"compress.qat": recorded["compress.qat"]}
    del recorded["verb"]
    return recorded


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key: checkpoint X, now Y` for every key both sides know and that differs."""
    out = []
    for key, then in saved.items():
        if key not in now or now[key] == then:
            continue
        if key == "tokenizer":
            out.append("the tokenizer (tokenizer.json) differs from the one the checkpoint trained with")
        else:
            out.append(f"{key}: checkpoint {_show(then)}, now {_show(now[key])}")
    return out


def _show(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if isinstance(value, list) else str(value)


def check_run_folder(cfg: SuiteConfig, verb: str, data_dir: Path | None = None) -> None:
    """Before any worker starts (see the module docstring). Raises ConfigError and writes nothing,
    or moves the old run aside (train.overwrite=true), or returns with nothing to do."""
    run_dir = Path(cfg.run.dir).expanduser()
    named = f"run.dir={cfg.run.dir}"
    other = f"run.dir={folders.new_folder(run_dir)}"  # a new run folder, as the refusals print it
    if cfg.train.overwrite:
        source = str(cfg.model.init_from or "")
        init = (folders.imported_path(source) or Path(source)).expanduser().resolve() if source else None
        if init is not None and run_dir.resolve() in (init, *init.parents):
            raise ConfigError(
                f"model.init_from={cfg.model.init_from} is inside {named}, which train.overwrite=true would "
                f"move aside before its weights are read; pass a new folder, e.g. {other}"
            )
        if cfg.launch.node_rank == 0 and run_dir.is_dir() and any(run_dir.iterdir()):
            moved = move_aside(run_dir)
            print(f"train.overwrite=true: moved the previous run in {run_dir} to {moved}", flush=True)
        return
    _refuse_other_outputs(cfg, run_dir)
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        return
    if not cfg.train.resume:
        steps = ", ".join(p.name for p in found[-3:])
        raise ConfigError(
            f"{named} already holds checkpoints ({steps}) and train.resume=false would mix a new run "
            f"into them; pass train.overwrite=true to move that run aside ({run_dir}.old-N) and start "
            f"clean, or {other} (a new folder)"
        )
    broken: list[str] = []
    newest = ckpt.latest_checkpoint(run_dir, log=broken.append)
    if newest is None:  # a new run would write its step_N over them
        more = f"; and {len(broken) - 3} more" if len(broken) > 3 else ""
        raise ConfigError(
            f"{named} holds checkpoints and none verifies ({'; '.join(broken[:3])}{more}); pass "
            f"train.overwrite=true to move that run aside ({run_dir}.old-N) and start clean, or {other} (a new folder)"
        )
    saved = saved_fingerprint(newest)
    if saved is None:
        return
    changed = differences(saved, of_run(cfg, verb, data_dir))
    qat = any(line.startswith("compress.qat:") for line in changed)
    architecture = any(not line.startswith(SOURCE_KEYS) for line in changed)
    # the model keys that differ: typed with model.init_from they would conflict with its architecture
    drops = "".join(
        f"drop {line.split(':', 1)[0]}= and "
        for line in changed
        if line.startswith("model.") and not line.startswith(SOURCE_KEYS)
    )
    if changed:
        raise ConfigError(
            f"{named} holds a run that this config cannot resume ({'; '.join(changed)}) at {newest}; "
            f"pass {other} (a new folder) to start another run, or train.overwrite=true to move it aside "
            f"({run_dir}.old-N) and start clean"
            + (
                f", or {drops}pass model.init_from={cfg.run.dir} with {other} to start from those "
                "weights (their architecture)"
                if architecture
                else ""
            )
            + (f", or resume it with {saved['compress.qat']}" if qat else "")
        )


def _refuse_other_outputs(cfg: SuiteConfig, run_dir: Path) -> None:
    """A folder another verb wrote (quantize, prune, export, report, pipeline) is no run to resume."""
    for record, verb in ((folders.RECORD, None), ("suite_export.json", "export"), ("pipeline.json", "run")):
        if (run_dir / record).is_file():
            verb = verb or (folders.read_record(run_dir) or {}).get("verb", "another verb")
            raise ConfigError(
                f"run.dir={cfg.run.dir} holds the output of suite {verb} ({record}), not a training run; "
                f"pass run.dir={folders.new_folder(run_dir)} (a new folder), or train.overwrite=true to move it "
                f"aside ({run_dir}.old-N) and start clean"
            )


def move_aside(run_dir: Path) -> Path:
    """Rename `run_dir` to the first free `<run_dir>.old-<N>` beside it; returns the new name."""
    return folders.move_aside(run_dir)
