"""Every `suite ...` command in README.md's code blocks and in each verb's `--help` examples runs as written.

Commands run in order in one working directory (the README's first `suite pretrain` makes the
runs/gpt-tiny that its `suite generate` reads), through the real CLI entry point in a forked child
(tests/forked_cli.py), shrunk to a few steps by overrides appended after the command's own:
steps, batch, width and depth, the embedded corpus' size. What a command demonstrates (its
recipe, data, vocabulary and sequence length, its parallel layout) is kept as written. `/data/`
in the README stands for a folder of the test's own text files (`corpus/` in the --help examples). Commands that cannot run here
are listed in SKIPPED with the reason.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from suite.align.pairs import task_pairs
from suite.cli.help import verb_help
from suite.cli.verbs import VERBS
from tests.conftest import write_tiny_corpus
from tests.forked_cli import ForkedCLI
from tests.helpers import REPO, suite_env

pytestmark = pytest.mark.slow

TRAIN = [
    "train.max_steps=2",
    "train.save_every=2",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.compile=false",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=4",
    "log.wandb=false",
    "log.progress=false",
]
DATA = ["data.max_corpus_mb=0.3", "data.val_fraction=0.1", "data.cache_dir={cwd}/cache"]
MODEL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=null",
    "model.moe_ffn_hidden_size=null",
]
SHRINK = {
    "pretrain": [*TRAIN, *DATA, *MODEL],
    "finetune": [
        *TRAIN,
        *DATA,
        "finetune.data.num_train=64",
        "finetune.data.num_eval=8",
        "finetune.eval_samples=2",
    ],
    "distill": [*TRAIN, *DATA, *MODEL],
    "align": [*TRAIN, *DATA, "align.num_eval=4"],
    "eval": ["eval.num_samples=2"],
    "prepare": DATA,
    "generate": ["generate.max_new_tokens=4"],
    "chat": ["generate.max_new_tokens=4"],
    "quantize": ["compress.eval_batches=1", "compress.decode_tokens=4", "compress.calib_samples=4"],
    "prune": ["compress.eval_batches=1", "compress.decode_tokens=4", "compress.calib_samples=4"],
}
FT_DATA = ["finetune.data.num_train=64", "finetune.data.num_eval=8", "finetune.eval_samples=2"]
SHRINK["run"] = [  # pipeline=embedded: <stage>.<key>=<value> shrinks each of its stages
    *(f"pretrain.{a}" for a in [*TRAIN, *DATA, *MODEL]),
    *(f"sft.{a}" for a in [*TRAIN, *DATA, *FT_DATA]),
    *(f"student.{a}" for a in [*TRAIN, *DATA, *FT_DATA]),
    *(f"int8.{a}" for a in [*SHRINK["quantize"], "compress.task_samples=2"]),
    *(f"{s}.eval.num_samples=2" for s in ("eval-sft", "eval-int8", "eval-student", "eval-hf")),
    *(f"{s}.eval.max_tokens=500" for s in ("perplexity-sft", "perplexity-int8")),
    "generate-onnx.generate.max_new_tokens=4",
]
SKIPPED = {
    "suite pretrain recipe=./my13b.yaml": "the 13B recipe asks for 4 nodes x 8 GPUs (and a data.path)",
}


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        commands += [line.strip() for line in block.splitlines() if line.strip().startswith("suite ")]
    return commands


# the verbs whose --help examples run, in an order where each finds what an earlier one wrote
HELP_ORDER = (
    "pretrain",
    "prepare",
    "finetune",
    "align",
    "distill",
    "eval",
    "generate",
    "export",
    "quantize",
    "prune",
    "config",
    "plan",
    "chat",
    "report",
    "run",
    "inspect",
)


def _help_commands() -> list[str]:
    commands = []
    for name in HELP_ORDER:
        verb = VERBS[name]
        text = verb_help(verb)
        assert "\nExamples:\n" in text, f"`suite {verb.name} --help` has no Examples: section"
        block = text.split("\nExamples:\n", 1)[1]
        commands += [line.strip() for line in block.splitlines() if line.strip().startswith("suite ")]
    return commands


def _unique(commands: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each command once: one that README.md and a --help show alike (comments aside) runs once."""
    seen, kept = set(), []
    for where, command in commands:
        key = tuple(shlex.split(command, comments=True))
        if key not in seen:
            seen.add(key)
            kept.append((where, command))
    return kept


COMMANDS = _unique([("README.md", c) for c in _readme_commands()] + [("--help", c) for c in _help_commands()])


def _argv(command: str, cwd: Path) -> list[str]:
    words = shlex.split(command.replace("/data/", f"{cwd}/readme-data/"), comments=True)
    assert words[0] == "suite", command
    verb = words[1]
    return words[1:] + [a.replace("{cwd}", str(cwd)) for a in SHRINK.get(verb, [])]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("docs")
    data = cwd / "data"
    data.mkdir()
    write_tiny_corpus(cwd / "corpus")
    write_tiny_corpus(cwd / "readme-data")
    rows = [
        {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i} said"}]}
        for i in range(200)
    ]
    (data / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = task_pairs("reverse-3", 40)  # suite align's examples: right answers against corrupted ones
    (data / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (data / "prompt.txt").write_text("The module (from a file)\n")
    (data / "prompts.txt").write_text("The module\nA longer prompt about the suite\n\nIt\n")
    cli = ForkedCLI(suite_env())
    yield cli, cwd
    cli.close()


def test_every_verb_shows_examples_and_every_recipe():
    assert set(HELP_ORDER) == set(VERBS)  # a new verb's examples run too
    assert all("\nExamples:\n" in verb_help(verb) for verb in VERBS.values())
    from suite.config.compose import known_options

    pretrain_help = verb_help(VERBS["pretrain"])
    assert all(name in pretrain_help for name in known_options("recipe"))


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[f"{w}: {c[:70]}" for w, c in COMMANDS])
def test_documented_command_runs(workdir, where, command):
    cli, cwd = workdir
    if command in SKIPPED:
        pytest.skip(SKIPPED[command])
    proc = cli.run(_argv(command, cwd), cwd=cwd, timeout=300, out=cwd.parent / "out")
    assert proc.returncode == 0, f"{where}: `{command}` exited {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
