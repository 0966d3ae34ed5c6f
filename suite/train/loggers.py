"""Where metrics go: the console (rich progress bar), metrics.jsonl, wandb (offline by default) or
TensorBoard (log=tensorboard); at the end, report.md and its plots (suite.report)."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"}
# credential shapes recognised anywhere in a value: Hugging Face, GitHub, OpenAI-style API tokens
SECRET_PATTERN = re.compile(
    r"\b(hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|sk-[A-Za-z0-9_-]{20,})"
)


class JsonlWriter:
    """Append-only metrics file; on resume it drops records past the resumed step."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.exists():
            self._keep_up_to(resume_step)
        elif resume_step is None and path.exists():
            path.unlink()
        self.file = path.open("a")

    def _keep_up_to(self, step: int) -> None:
        """Rewrite the file with the records of steps <= `step`. A last line that is not whole JSON
        is dropped: a full disk (a short write) or a kill can cut the line being written."""
        lines = [line for line in self.path.read_text().splitlines() if line]
        if lines:
            try:
                json.loads(lines[-1])
            except ValueError:
                lines.pop()
        kept = [line for line in lines if json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def rewind(self, step: int) -> None:
        """Drop the records past `step` (a loss-spike rollback went back to it)."""
        self.file.close()
        self._keep_up_to(step)
        self.file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _secret_name(name: str) -> bool:
    """`wandb_api_key`, `HF_TOKEN`, `db-password`: a word of the name says credential (whole words,
    so `tokenizer` and `max_new_tokens` are not)."""
    return any(word in SECRET_WORDS for word in re.split(r"[^a-z0-9]+", name.lower()))


def _known_secrets() -> list[str]:
    """Values of this process's environment variables named like credentials (WANDB_API_KEY,
    HF_TOKEN, ...): wherever they turn up (an `${oc.env:...}` in a recipe), they are scrubbed."""
    return sorted(
        (v for k, v in os.environ.items() if _secret_name(k) and len(v) >= 8), key=len, reverse=True
    )


def scrub_text(text: str) -> str:
    """`text` with every known secret value and credential-shaped token replaced by ***."""
    for secret in _known_secrets():
        text = text.replace(secret, "***")
    return SECRET_PATTERN.sub("***", text)


def scrub_secrets(config: Any) -> Any:
    """A copy of `config` (dicts, lists, scalars) safe to write: values under credential-named keys
    become ***, and so does any string holding a known secret or a credential-shaped token."""
    if isinstance(config, dict):
        return {
            key: "***"
            if _secret_name(str(key)) and isinstance(value, str) and value
            else scrub_secrets(value)
            for key, value in config.items()
        }
    if isinstance(config, list | tuple):
        return [scrub_secrets(value) for value in config]
    if isinstance(config, str):
        return scrub_text(config)
    return config


def scrub_yaml(text: str) -> str:
    """A resolved config's YAML as it may be written to disk (run folder, checkpoints)."""

    config = OmegaConf.to_container(OmegaConf.create(text))
    clean = scrub_secrets(config)
    return text if clean == config else OmegaConf.to_yaml(OmegaConf.create(clean))


class MetricsLogger:
    """Rank 0's view of training: progress bar, one console line per log step, JSONL, wandb, TensorBoard."""

    def __init__(
        self, run_dir: Path, config: dict[str, Any], log_cfg, total_steps: int, start_step: int, resumed: bool
    ):
        self.console = Console(stderr=False)
        self.run_dir, self.log_cfg = run_dir, log_cfg
        self.jsonl = JsonlWriter(run_dir / "metrics.jsonl", start_step if resumed else None)
        self.progress = None
        if log_cfg.progress:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()
        self.wandb_run = None
        if log_cfg.wandb and log_cfg.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            # deferred: wandb (seconds to import) loads only when log.wandb is on
            import wandb

            self.wandb_run = wandb.init(
                project=scrub_text(log_cfg.wandb_project),
                dir=str(run_dir),
                mode=log_cfg.wandb_mode,
                config=scrub_secrets(config),
                name=scrub_text(run_dir.name),
                resume="allow",
                id=_wandb_id(run_dir),
            )
        self.tensorboard = None
        if log_cfg.tensorboard:
            self.tensorboard = TensorBoardWriter(run_dir / "tensorboard", start_step if resumed else None)

    def print(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def log(self, record: dict[str, Any]) -> None:
        record = scrub_secrets(record)
        self.jsonl.write(record)
        if self.wandb_run is not None:
            metrics = {k: v for k, v in record.items() if k != "step" and v is not None}
            self.wandb_run.log(metrics, step=record["step"])
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        self.print(" | ".join(_fmt(k, v) for k, v in record.items()))

    def rewind(self, step: int) -> None:
        self.jsonl.rewind(step)
        if self.tensorboard is not None:
            self.tensorboard.rewind(step)
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def advance(self, step: int, loss: float | None) -> None:
        if self.progress is not None:
            status = f"loss {loss:.4f}" if loss is not None else ""
            self.progress.update(self.task, completed=step, status=status)

    def finish(self) -> None:
        """The run reached its last step: report.md + plots in the run folder (log.report), kept by
        wandb as an artifact. Never raises: a report that fails is one warning line."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if not self.log_cfg.report:
            return
        # deferred: the report (matplotlib) loads only when training ends with log.report on
        from suite.report import report_at_end

        written = report_at_end(self.run_dir, self.print)
        if written is not None and self.wandb_run is not None:
            _wandb_artifact(self.wandb_run, *written, self.print)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


class TensorBoardWriter:
    """The numeric metrics of each record as TensorBoard scalars (torch's SummaryWriter), same names as
    metrics.jsonl. A resume or a rollback to step N drops the events logged past N (purge_step)."""

    def __init__(self, folder: Path, resume_step: int | None):
        # deferred: tensorboard loads only with log=tensorboard
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=record["step"])
        self.writer.flush()

    def rewind(self, step: int) -> None:
        # deferred: tensorboard loads only with log=tensorboard
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=str(self.folder), purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


def _wandb_artifact(run, report: Path, plots: list[Path], say) -> None:
    """report.md and its plots as one wandb artifact of type `report` (logged offline too, synced later)."""
    try:
        # deferred: wandb (seconds to import) loads only when log.wandb is on
        import wandb

        artifact = wandb.Artifact(f"report-{run.id}", type="report")
        artifact.add_file(str(report), name=report.name)
        for plot in plots:
            artifact.add_file(str(plot), name=f"plots/{plot.name}")
        run.log_artifact(artifact)
    except Exception as exc:  # noqa: BLE001 (the report is on disk; wandb keeping a copy is a bonus)
        say(f"warning: wandb did not take the report as an artifact ({type(exc).__name__}: {exc})")


def _wandb_id(run_dir: Path) -> str:
    """A stable run id per run folder, so a resumed run continues the same wandb run."""
    id_file = run_dir / ".wandb_id"
    if id_file.exists():
        return id_file.read_text().strip()

    run_id = uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    return run_id


def _fmt(key: str, value: Any) -> str:
    if value is None:  # e.g. mfu where no peak applies
        return f"{key} n/a"
    if isinstance(value, float):
        if key in ("lr",):
            return f"{key} {value:.2e}"
        if key in ("tokens_per_s",):
            return f"{key} {value:,.0f}"
        return f"{key} {value:.4f}"
    return f"{key} {value}"
