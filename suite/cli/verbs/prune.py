"""`suite prune`: MLP channels and layers removed by activation importance, with a before/after report."""

from __future__ import annotations

from suite.cli.common import _compose_with_ckpt, _explicit_dir, _report_compression
from suite.folders import OVERWRITE
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    cfg, _ = _compose_with_ckpt(overrides, "runs/gpt-tiny prune.ffn=0.25")
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.compress.prune import run_prune

    return _report_compression(run_prune(cfg, _explicit_dir(overrides)), "pruned", flags)


HELP = """usage: suite prune ckpt=<run.dir|checkpoint dir> [prune.ffn=FRACTION] [prune.heads=FRACTION]
       [prune.hidden=FRACTION] [prune.layers=COUNT] [run.dir=OUT] [--json]

Structured pruning into a smaller dense model of the same family (Minitron-style importance from
activations on compress.calib_samples sequences of the run's data; an hf:/gguf: source: data.path,
data.sources or the embedded corpus, in its own tokenizer): prune.ffn removes that fraction of
every MLP's channels (least mean |activation| at the down projection's input), prune.heads that
fraction of every layer's attention heads (scored at the output projection's input; with grouped KV
heads each group keeps the same number of its query heads, or whole groups go), prune.hidden that fraction of the
embedding channels everywhere (scored at the norms' outputs), prune.layers the blocks that change their
input least (1 - cosine similarity of a block's input and output). Heal the result with
`suite distill distill.teacher=<ckpt> model.init_from=<run.dir>` or `suite finetune`.

Writes: <run.dir>/ (default <ckpt run>-pruned): config.yaml, checkpoints/step_0/, the tokenizer,
report.json (parameters, bytes, held-out perplexity, task exact match for a finetuned run, before and
after). Every verb reads it (generate, eval, export, finetune, distill); a GPT with pruned heads does
not export (GPT-2's HF config has no head size of its own). See docs/compression.md.

Examples:
  suite prune ckpt=runs/gpt-tiny prune.ffn=0.25
  suite prune ckpt=runs/gpt-tiny prune.ffn=0.5 prune.layers=1 run.dir=runs/gpt-tiny-half
  suite prune ckpt=runs/gpt-tiny prune.heads=0.5 prune.hidden=0.25 run.dir=runs/gpt-tiny-narrow"""


VERB = register(
    Verb(
        name="prune",
        summary="remove MLP channels and layers by activation importance: suite prune ckpt=runs/gpt-tiny prune.ffn=0.25",
        help=HELP,
        run=run,
        unused=("export", "distill", "optim", "sched", "recompute", "cluster", "eval", "align"),
        section="compress",
        flags=(OVERWRITE,),
        composes=True,
        stage_output="checkpoint",
        output_key="run.dir",
    )
)
