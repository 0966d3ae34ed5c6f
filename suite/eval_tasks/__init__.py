"""lm-evaluation-harness tasks shipped with suite (one folder per task: YAML + data), read offline.

`suite eval harness=<name>` hands this folder to lm_eval's TaskManager as include_path; the same
folder works with lm_eval's own CLI: `lm_eval --include_path <this folder> --tasks suite_tiny_mc`.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent


def shipped_tasks() -> list[str]:
    """The names of the tasks in this folder (each <name>/<name>.yaml)."""
    return sorted(p.parent.name for p in TASKS_DIR.glob("*/*.yaml") if p.stem == p.parent.name)
