"""One training run as a report sees it: its metrics.jsonl records and the config it ran with."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from suite import user_files
from suite.config.errors import ConfigError

TRAINED_BY = "pretrain, finetune or distill"


@dataclass
class RunMetrics:
    """A run folder's metrics (one dict per logged step) and its resolved config (a plain dict)."""

    path: Path
    label: str
    records: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` where it was logged as a finite number."""
        steps, values = [], []
        for record in self.records:
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                steps.append(int(record["step"]))
                values.append(float(value))
        return steps, values

    def has(self, key: str) -> bool:
        return bool(self.series(key)[0])

    def last(self, key: str) -> float | None:
        values = self.series(key)[1]
        return values[-1] if values else None

    def setting(self, dotted: str) -> Any:
        """A config value by its dotted key (`model.name`), None where the config lacks it."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


def _records(path: Path) -> list[dict[str, Any]]:
    """The whole JSON lines of metrics.jsonl that carry a step (a killed run may leave a cut line)."""
    out = []
    text = user_files.read_bytes(path, "suite report").decode("utf-8", errors="replace")
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return out


def _config(path: Path) -> dict[str, Any]:
    """config.yaml as plain data; {} where it is missing or unreadable (the plots need only metrics)."""
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # noqa: BLE001 (a hand-edited or foreign config: report without it)
        return {}
    return data if isinstance(data, dict) else {}


def load_run(path: str | Path, label: str | None = None) -> RunMetrics:
    """The run in folder `path`; a ConfigError (one line) where it is not a training run's folder."""
    folder = Path(path).expanduser()
    named = f"'{path}'"
    if not folder.exists():
        raise ConfigError(
            f"suite report: {named} does not exist; pass a run folder (run.dir of a {TRAINED_BY} run)"
        )
    if not folder.is_dir():
        raise ConfigError(
            f"suite report: {named} is a file, not a run folder; pass the run.dir of a {TRAINED_BY} run"
        )
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        what = "a run folder without" if (folder / "config.yaml").is_file() else "not a run folder: it has no"
        raise ConfigError(
            f"suite report: {named} is {what} metrics.jsonl; suite report reads the run.dir of a {TRAINED_BY} "
            "run that has logged at least one step"
        )
    records = _records(metrics)
    if not records:
        raise ConfigError(
            f"suite report: {named} has no metrics yet ({metrics} holds no step); run it until it logs a "
            "step (train.log_every), then report"
        )
    return RunMetrics(folder, label or str(path), records, _config(folder / "config.yaml"))
