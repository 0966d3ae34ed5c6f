"""`suite run pipeline=<name>`: a model's whole life (prepare, pretrain, finetune, distill, quantize,
prune, export, eval) as one resumable job (docs/pipeline.md).

recipe.py reads the pipeline recipe (recipes/pipeline/<name>.yaml); runner.py runs each stage as a
subprocess of the same CLI, skips finished stages whose outputs verify, resumes the rest, checks the
quality gates; outputs.py fingerprints what a stage wrote and reads its figures; report.py writes
report.md and report.png. Nothing here imports a trainer: every stage is its own process.
"""

from __future__ import annotations

from suite.folders import OVERWRITE


def cmd_run(overrides: list[str], flags: set[str]) -> int:
    # deferred: suite --help imports this package (for cmd_run); the runner, and through it the launcher
    # and the model sources, load only when a pipeline runs
    from suite.pipeline.recipe import load_pipeline
    from suite.pipeline.runner import Run

    def flag(name: str) -> str | None:
        return next((f.split("=", 1)[1] for f in flags if f.startswith(f"{name}=")), None)

    pipeline = load_pipeline(overrides)
    return Run(pipeline, start=flag("--from"), only=flag("--only"), overwrite=OVERWRITE in flags).run()
