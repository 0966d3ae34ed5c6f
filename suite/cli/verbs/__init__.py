"""The verbs of `suite`, one module each; importing this package registers them all (suite.verb).

Adding a verb: a module here that builds a `suite.verb.Verb` and passes it to `register`, and its
name on the line below (docs/architecture.md, "Adding a verb"). The modules keep the engine (the
trainer, the exporters, the planner) out of their top-level imports: the command line imports every
verb to list them, and only the verb that runs should pay for its engine.
"""

from suite.cli.verbs import (  # noqa: F401 (the registry line: importing a verb module registers it)
    align,
    chat,
    config,
    distill,
    eval,
    export,
    finetune,
    generate,
    inspect,
    plan,
    prepare,
    pretrain,
    prune,
    quantize,
    report,
    run,
)
from suite.verb import VERBS

__all__ = ["VERBS"]
