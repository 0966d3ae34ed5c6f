"""What `suite --help` and `suite <verb> --help` print, from the verb registry (suite.verb): each
verb's summary and its help with examples (run as written by tests/e2e/test_docs_commands.py)."""

from __future__ import annotations

from suite.config.compose import known_options
from suite.verb import SECTIONS, VERBS, Verb

USAGE_HEAD = "usage: suite <verb> [key=value ...] [group=option ...] [--json]"
USAGE_TAIL = """Run `suite <verb> --help` for the keys a verb reads. Every default lives in the recipes;
`suite config list` shows them, `suite config show` prints a resolved config.

Every folder a verb writes holds one thing and records what made it: the same command continues
it, another one is refused (exit 2, the folder untouched); --overwrite (train.overwrite=true)
moves the old content aside to <folder>.old-<N> first."""


def usage() -> str:
    """`suite --help`: every registered verb's summary, by section, then by name."""
    rows = sorted(VERBS.values(), key=lambda v: (SECTIONS.index(v.section), v.name))
    verbs = "\n".join(f"  {v.name:10s} {v.summary}" for v in rows)
    return f"{USAGE_HEAD}\n\nverbs:\n{verbs}\n\n{USAGE_TAIL}"


def verb_help(verb: Verb) -> str:
    """A verb's --help (the recipe list is the one `suite config list` shows, never a stale copy)."""
    text = verb.help.replace("{recipes}", "|".join(known_options("recipe")))
    text = text.replace("{pipelines}", ", ".join(known_options("pipeline")))
    if "{compress_" in text:  # suite quantize's methods, listed from their registry
        # deferred: the compression registry imports torch (seconds), needed only when this help is shown
        from suite.models.compression import help_lines, names

        text = text.replace("{compress_methods}", help_lines()).replace("{compress_names}", "|".join(names()))
    return text.replace("{clusters}", "|".join(known_options("cluster")))
