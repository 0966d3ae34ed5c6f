"""`suite run pipeline=<name>`: a model's whole life as one resumable job (suite/pipeline/)."""

from __future__ import annotations

from suite.folders import OVERWRITE
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.pipeline.recipe import load_pipeline
    from suite.pipeline.runner import Run

    def flag(name: str) -> str | None:
        return next((f.split("=", 1)[1] for f in flags if f.startswith(f"{name}=")), None)

    pipeline = load_pipeline(overrides)
    return Run(
        pipeline, start=flag("--from"), only=flag("--only"), overwrite=OVERWRITE in flags, overrides=overrides
    ).run()


HELP = """usage: suite run pipeline=<name|PATH.yaml> [run.dir=DIR] [<stage>.<key>=<value> ...] [--from STAGE | --only STAGE]

Runs a pipeline recipe (recipes/pipeline/<name>.yaml; shipped: {pipelines}): its stages in order, each
as `suite <verb> <its args>` in a subprocess, into one folder (run.dir, default runs/pipeline-<name>)
with one subfolder per stage. A stage reads an earlier one's output as ${stage:NAME} in its args.
Rerunning the same command skips every stage that finished (its outputs verified: checkpoint manifest,
file sha256) and goes on where it stopped: a killed training stage resumes from its last checkpoint.
--from STAGE reruns that stage and every later one; --only STAGE reruns that stage alone.
<stage>.<key>=<value> adds an override to that stage (it wins over the recipe's), e.g.
pretrain.train.max_steps=100. A failing quality gate (gates: in the recipe) stops the pipeline with
one line naming the gate and the figures, exit 3; a failing stage stops it with that stage's exit code.

Writes: <run.dir>/<stage>/ (each stage's run folder, export or result.json), logs/<stage>.log,
logs/<stage>.done.json (a finished stage's marker), pipeline.json (every stage's command, result
and figures), report.md and report.png (accuracy, perplexity, size, decode tokens/s per stage).
See docs/pipeline.md.

Examples:
  suite run pipeline=embedded
  suite run pipeline=embedded --only eval-int8
  suite run pipeline=embedded --from int8"""


VERB = register(
    Verb(
        name="run",
        summary="a whole lifecycle as one resumable job with a report: suite run pipeline=embedded",
        help=HELP,
        run=run,
        section="tools",
        flags=(OVERWRITE,),
        valued_flags={"--from": "--from int8 (a stage name)", "--only": "--only eval-sft (a stage name)"},
    )
)
