"""The checks of `suite generate` and `suite eval` (before any checkpoint is read), and the prompt as typed.

`prompt=` / `generate.prompt=` never go through Hydra's override grammar or interpolation: they are
taken out of the arguments before composing and reach the tokenizer exactly as typed (quotes,
`=`, commas, `${...}`, non-ASCII text, newlines, trailing spaces). `prompt_file=PATH` reads the
prompt from a file, `prompt_file=-` from standard input.
"""

from __future__ import annotations

import sys
from pathlib import Path

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.config.validate import CHOICES
from suite.data.tasks import get_task
from suite.infer.perplexity import check_window
from suite.runtime import check_device

PROMPT_KEYS = ("prompt", "generate.prompt", "+generate.prompt", "++generate.prompt")
PROMPT_FILE_KEYS = ("prompt_file", "generate.prompt_file")


def take_prompt(args: list[str]) -> tuple[list[str], str | None]:
    """The arguments without the prompt ones, and the prompt (None: the recipe's)."""
    rest, given = [], []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key in PROMPT_KEYS + PROMPT_FILE_KEYS:
            given.append((key, value))
        else:
            rest.append(arg)
    if len(given) > 1:
        keys = ", ".join(f"{k}=" for k, _ in given)
        raise ConfigError(f"{keys} all set the prompt; give one prompt= or prompt_file=, not several")
    if not given:
        return rest, None
    key, value = given[0]
    return rest, (_read_prompt_file(value) if key in PROMPT_FILE_KEYS else value)


def _read_prompt_file(value: str) -> str:
    if value == "-":
        return sys.stdin.read()
    path = Path(value).expanduser()
    fix = "give a UTF-8 text file, or prompt_file=- to read standard input"
    if not value:
        raise ConfigError(f"prompt_file is empty; {fix}")
    if path.is_dir():
        raise ConfigError(f"prompt_file='{value}' is a folder; {fix}")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"prompt_file='{value}' does not exist; {fix}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"prompt_file='{value}' is not UTF-8 text (byte {exc.start}); {fix}") from None
    except OSError as exc:
        raise ConfigError(f"prompt_file='{value}' cannot be read ({exc.strerror}); {fix}") from None


def check_generate(cfg: SuiteConfig) -> None:
    g = cfg.generate
    check_device(cfg.train.device)
    if not g.prompt:
        raise ConfigError('generate.prompt is empty; pass prompt="some text" or prompt_file=<file>')
    if g.max_new_tokens < 1:
        raise ConfigError(f"generate.max_new_tokens={g.max_new_tokens} must be a positive integer, e.g. 64")
    if g.temperature < 0:
        raise ConfigError(
            f"generate.temperature={g.temperature} must be >= 0 (0: greedy), e.g. generate.temperature=0.8"
        )
    if g.top_k is not None and g.top_k < 1:
        raise ConfigError(
            f"generate.top_k={g.top_k} must be a positive integer (e.g. 50), or null to sample from every token"
        )
    if g.top_p is not None and not 0.0 < g.top_p <= 1.0:
        raise ConfigError(f"generate.top_p={g.top_p} must be in (0, 1] (1: off), e.g. generate.top_p=0.95")
    if g.dtype not in CHOICES["generate.dtype"]:
        raise ConfigError(
            f"generate.dtype={g.dtype!r} is not supported; use one of: {', '.join(CHOICES['generate.dtype'])}"
        )


def check_eval(cfg: SuiteConfig) -> None:
    e = cfg.eval
    check_device(cfg.train.device)
    for key, value in (("eval.num_samples", e.num_samples), ("eval.max_new_tokens", e.max_new_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be a positive integer, or null for the run's own value")
    if e.metric not in CHOICES["eval.metric"]:
        raise ConfigError(
            f"eval.metric={e.metric!r} is not supported; use one of: {', '.join(CHOICES['eval.metric'])} "
            "(lm-evaluation-harness tasks: harness=<task,...>)"
        )
    if e.harness is not None and e.metric != "accuracy":
        raise ConfigError(
            f"metric={e.metric} and harness={e.harness} ask for two evaluations; pick one: drop harness= for "
            "perplexity, or drop metric= to run the harness tasks"
        )
    if e.batch_size < 1:
        raise ConfigError(f"eval.batch_size={e.batch_size} must be a positive integer, e.g. 8")
    for key, value in (("eval.max_tokens", e.max_tokens), ("eval.limit", e.limit)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be a positive integer, or null for all")
    check_window(e.seq_len, e.stride)
    if e.harness is not None and not str(e.harness).strip(" ,"):
        raise ConfigError("harness= names no task; pass harness=<task,...>, e.g. harness=suite_tiny_mc")
    if e.task and e.metric == "accuracy" and e.harness is None:
        get_task(e.task)  # a one-line error for an unknown name
