"""Built-in SFT tasks with a measurable skill, generated offline and deterministically.

Families (N = digits; a bare kind name means its default N):

    reverse-N   "Reverse the digits of 48213." -> "31284"      numbers of 3..N digits (default N=6)
    sort-N      "Sort the digits of 48213." -> "12348"          numbers of 3..N digits (default N=6)
    addition-N  "What is 482 + 377?" -> "859"                   both operands exactly N digits (default 3)

Digits are single tokens for the suite's tokenizer, so these are token-level skills. Multi-digit
addition with the answer written most-significant digit first is the hard stretch task (carry
look-ahead is slow to learn at gpt-tiny's size); reversal is the default: the `sft-tiny` recipes
teach it to gpt-tiny on a CPU within the 15-minute budget (figures in docs/benchmarks.md).
DEFAULT_TASK is what the built-in finetuning recipe uses.

Why numbers start at three digits: there are only 90 two-digit numbers, and a 200-question held-out
split (digit counts uniform) takes about 30 of them out of training, so the model can only memorise
the other 60 and gets the held-out ones wrong: finetuning runs plateaued at ~87% exact match with
every miss a two-digit number (measured, docs/benchmarks.md). From three digits on (900 numbers
and up) the held-out questions test the skill, not recall.

Splits: the held-out questions are the first `num_eval` distinct questions the seeded generator
draws, the training questions the next `num_train`; no question appears in both (for addition,
a + b and b + a count as the same question). The eval split therefore does not depend on
`num_train`. Files are JSONL in the `messages` shape (a user turn, an assistant turn), which
suite.data.sft reads like any other chat data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from suite.config.errors import ConfigError

DEFAULT_TASK = "reverse-6"
DEFAULT_DIGITS = {"reverse": 6, "sort": 6, "addition": 3}
MIN_DIGITS = {"reverse": 3, "sort": 3, "addition": 1}
MAX_DIGITS = 12
TRAIN_FILE = "train.jsonl"
EVAL_FILE = "eval.jsonl"


@dataclass(frozen=True)
class Task:
    """A generator of (key, question, answer) triples; `key` identifies a question up to symmetry."""

    name: str
    description: str
    draw: Callable[[np.random.Generator], tuple[object, str, str]]
    capacity: int  # number of distinct keys the generator can produce
    max_answer_chars: int

    def normalize(self, text: str) -> str:
        return text.strip()


def _number(rng: np.random.Generator, low_digits: int, high_digits: int) -> str:
    """A number whose digit count is uniform in [low_digits, high_digits] (no leading zero)."""
    d = int(rng.integers(low_digits, high_digits + 1))
    return str(int(rng.integers(0 if d == 1 else 10 ** (d - 1), 10**d)))


def _addition(n: int) -> Task:
    def draw(rng: np.random.Generator) -> tuple[object, str, str]:
        a, b = int(_number(rng, n, n)), int(_number(rng, n, n))
        return (min(a, b), max(a, b)), f"What is {a} + {b}?", str(a + b)

    values = 10**n - (10 ** (n - 1) if n > 1 else 0)
    return Task(f"addition-{n}", f"add two {n}-digit numbers", draw, values * (values + 1) // 2, n + 1)


def _digits_task(kind: str, n: int) -> Task:
    question, answer = {
        "reverse": ("Reverse the digits of {}.", lambda x: x[::-1]),
        "sort": ("Sort the digits of {}.", lambda x: "".join(sorted(x))),
    }[kind]

    def draw(rng: np.random.Generator) -> tuple[object, str, str]:
        x = _number(rng, MIN_DIGITS[kind], n)
        return x, question.format(x), answer(x)

    what = "reverse" if kind == "reverse" else "sort (ascending)"
    return Task(
        f"{kind}-{n}",
        f"{what} the digits of a {MIN_DIGITS[kind]}- to {n}-digit number",
        draw,
        10**n - 10 ** (MIN_DIGITS[kind] - 1),
        n,
    )


_NAME = re.compile(r"^(reverse|sort|addition)(?:-(\d+))?$")


def list_tasks() -> list[str]:
    """Names `get_task` accepts."""
    names = list(DEFAULT_DIGITS)
    for kind in DEFAULT_DIGITS:
        names += [f"{kind}-{n}" for n in range(MIN_DIGITS[kind], MAX_DIGITS + 1)]
    return names


def get_task(name: str) -> Task:
    match = _NAME.match(str(name))
    kind = match.group(1) if match else ""
    n = int(match.group(2) or DEFAULT_DIGITS[kind]) if match else 0
    if not match or not MIN_DIGITS[kind] <= n <= MAX_DIGITS:
        raise ConfigError(
            f"task={name!r} is not a built-in task; use reverse-N or sort-N (N = {MIN_DIGITS['reverse']}..{MAX_DIGITS}) or "
            f"addition-N (N = 1..{MAX_DIGITS}); default {DEFAULT_TASK}"
        )
    return _addition(n) if kind == "addition" else _digits_task(kind, n)


def as_messages(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def generate_task(
    name: str, num_train: int, num_eval: int, seed: int = 0
) -> tuple[list[list[dict[str, str]]], list[list[dict[str, str]]]]:
    """(train, eval) conversations, deterministic in (name, num_train, num_eval, seed), disjoint."""
    task = get_task(name)
    if num_train < 0 or num_eval < 0:
        raise ConfigError(f"num_train={num_train} and num_eval={num_eval} must be >= 0")
    wanted = num_train + num_eval
    if wanted > task.capacity // 2:
        raise ConfigError(
            f"task {task.name} has only {task.capacity:,} distinct questions; num_train + num_eval = {wanted:,} "
            f"must stay below half of that; use more digits or fewer samples"
        )
    rng = np.random.default_rng([seed, 0x5F7])
    seen: set[object] = set()
    rows: list[list[dict[str, str]]] = []
    while len(rows) < wanted:
        key, question, answer = task.draw(rng)
        if key in seen:
            continue
        seen.add(key)
        rows.append(as_messages(question, answer))
    return rows[num_eval:], rows[:num_eval]


def write_task(
    name: str, out_dir: str | Path, num_train: int, num_eval: int, seed: int = 0
) -> dict[str, Path]:
    """Write train.jsonl and eval.jsonl ({"messages": [...]} per line) into out_dir; return their paths."""
    train, held_out = generate_task(name, num_train, num_eval, seed)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / TRAIN_FILE, "eval": out / EVAL_FILE}
    for split, rows in (("train", train), ("eval", held_out)):
        tmp = paths[split].with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows), encoding="utf-8")
        tmp.replace(paths[split])
    return paths


def score(name: str, prediction: str, reference: str) -> bool:
    """Exact match after stripping surrounding whitespace."""
    task = get_task(name)
    return task.normalize(prediction) == task.normalize(reference)
