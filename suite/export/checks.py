"""`suite export`'s checks before anything is read or written: the output folder."""

from __future__ import annotations

from pathlib import Path

from suite.config.errors import ConfigError
from suite.outputs import check_output_folder

MARKER = "suite_export.json"  # written into every export folder (suite.export.hf): reusing one is safe


def check_export_out(out: str | None) -> None:
    """export.out as typed (None: the default <run.dir>/export-<format>)."""
    if out is None:
        return
    if not str(out).strip():
        raise ConfigError(
            "export.out is empty; pass out=<a new folder>, or leave out= away for <run.dir>/export-hf"
        )
    check_output_folder(
        "export.out",
        out,
        f"pass out=<a new or empty folder, or an earlier export> instead of '{out}'",
        MARKER,
    )


def check_default_out(out: Path) -> None:
    check_output_folder("export.out", str(out), "pass out=<a new or empty folder>", MARKER)
