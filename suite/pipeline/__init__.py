"""`suite run pipeline=<name>`: a model's whole life (prepare, pretrain, finetune, distill, quantize,
prune, export, eval) as one resumable job (docs/pipeline.md).

recipe.py reads the pipeline recipe (recipes/pipeline/<name>.yaml); runner.py runs each stage as a
subprocess of the same CLI, skips finished stages whose outputs verify, resumes the rest, checks the
quality gates; outputs.py fingerprints what a stage wrote and reads its figures; report.py writes
report.md and report.png. Nothing here imports a trainer: every stage is its own process.
"""

from __future__ import annotations
