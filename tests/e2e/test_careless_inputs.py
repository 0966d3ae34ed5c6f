"""Careless inputs across every verb, each answered in one line on stderr with exit code 2.

Every case goes through the real entry point (`python -m suite`'s `sys.exit(main())`) in its own
process: tests/forked_cli.py imports the CLI once and forks a child per case, so a hundred cases
cost one interpreter start (`test_forked_cli_matches_python_m_suite` checks that the children
answer as `python -m suite` does). Each case runs in a fresh working directory that must be left as
it was (no run folder, no export, nothing that could pass for a result), and the shared run folder
the checkpoint cases read must stay byte-for-byte unchanged.

Placeholders in a case: {run} a trained tiny run folder, {data} a prepared tiny data folder,
{cwd} the case's working directory, {file} an existing regular file there, {bad_yaml} a recipe with
a YAML syntax error (line 3), {no_package} a recipe without `# @package _global_`, {nonempty} a
folder holding an unrelated file, {empty} an empty file, {chat} a chat .jsonl file.

Data files as careless users hand them over (DATA_CASES, in the working directory too): {latin1} a
Latin-1 text .jsonl, {latin1_chat} a Latin-1 chat .jsonl, {fake_parquet} and {fake_chat_parquet}
JSON lines named .parquet, {junk} 20 KB of random bytes named .txt, {bad_pipeline} a
pipeline recipe with a YAML syntax error (a list left open on line 3), {utf16} UTF-16 JSON lines,
{rows} the same rows as UTF-8.

And what the lines suggest works (FIXES): every way on a refusal offers, read by tests/suggested_fix.py
(the one reader of every refusal's advice) and applied to the refused command, runs to exit 0.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.forked_cli import ForkedCLI
from tests.helpers import TINY_MODEL, run_suite, suite_env
from tests.suggested_fix import ways_on

PRE = ["pretrain", "run.dir={cwd}/run", "data.path={data}", *TINY_MODEL]  # pretrain that would train
GEN = ["generate", "ckpt={run}"]
EXP = ["export", "ckpt={run}"]
FT = ["finetune", "model.init_from={run}", "run.dir={cwd}/ft", "log.wandb=false"]
LONG_PROMPT = "word " * 2000

# (argv, a distinctive part of the one line on stderr)
CASES: list[tuple[list[str], str]] = [
    # --- the verb, flags, the override grammar
    (["frobnicate"], "unknown verb 'frobnicate'"),
    (["pretrain", "--fast"], "unknown flag --fast"),
    (["pretrain", "steps"], "argument 'steps' is not an override"),
    (["pretrain", "-v"], "argument '-v' is not an override"),
    (["pretrain", "=5"], "empty key"),
    (["pretrain", "recipe=gpt14b"], "recipe='gpt14b' is not a known recipe (did you mean"),
    (["pretrain", "model=gpt99"], "model='gpt99' is not a known model"),
    (["pretrain", "data=remote"], "data='remote' is not a known data"),
    (["pretrain", "model.num_layer=3"], "did you mean 'model.num_layers'"),
    (["pretrain", "trian.max_steps=3"], "unknown key 'trian.max_steps'"),
    (["pretrain", "train.max_steps=abc"], "train.max_steps"),
    (["pretrain", "train.max_steps=1e3"], "train.max_steps"),
    (["pretrain", "train.resume=maybe"], "train.resume"),
    (["pretrain", "model.num_layers=[1,2]"], "model.num_layers"),
    (["pretrain", "run.dir=${oops}"], "run.dir"),
    (["config", "show", "model.name=a b,c"], "single quotes inside double quotes"),
    (["finetune", "ckpt={run}", "run.dir={cwd}/ft"], "suite finetune does not read ckpt"),
    # --- recipe files
    (["pretrain", "recipe=./missing.yaml"], "recipe='./missing.yaml': no such file"),
    (["pretrain", "recipe={bad_yaml}"], "bad.yaml, line 3"),
    (["pretrain", "recipe={no_package}"], "# @package _global_"),
    (["pretrain", "recipe={cwd}"], "recipe="),
    # --- single values
    ([*PRE, "train.max_steps=0"], "train.max_steps=0 must be a positive integer"),
    ([*PRE, "train.max_steps=-1"], "train.max_steps=-1 must be a positive integer"),
    ([*PRE, "train.save_every=0"], "train.save_every=0"),
    ([*PRE, "train.log_every=-2"], "train.log_every=-2"),
    ([*PRE, "train.eval_batches=0"], "train.eval_batches=0"),
    ([*PRE, "train.precision=fp4"], "train.precision='fp4' is not supported"),
    ([*PRE, "train.precision=fp8", "train.device=cpu"], "train.precision=fp8 needs an NVIDIA GPU"),
    ([*PRE, "train.device=tpu"], "train.device='tpu' is not supported"),
    ([*PRE, "train.device=cuda"], "train.device=cuda"),
    ([*PRE, "train.param_dtype=fp16"], "train.param_dtype='fp16'"),
    ([*PRE, "train.param_dtype=bf16", "train.precision=fp32"], "train.param_dtype"),
    ([*PRE, "train.compile=maybe"], "train.compile='maybe'"),
    ([*PRE, "train.keep_last=-1"], "train.keep_last=-1"),
    ([*PRE, "train.spike_factor=0.5"], "train.spike_factor=0.5"),
    ([*PRE, "train.fault_kill_rank=0"], "train.fault_kill_rank and train.fault_kill_step"),
    ([*PRE, "train.keep_host_memory=sometimes"], "train.keep_host_memory='sometimes'"),
    ([*PRE, "train.collective_timeout_s=0"], "train.collective_timeout_s=0"),
    ([*PRE, "train.num_threads=0"], "train.num_threads=0"),
    ([*PRE, "train.peak_flops=-1"], "train.peak_flops=-1"),
    ([*PRE, "sched.warmup_steps=-5"], "sched.warmup_steps=-5"),
    ([*PRE, "sched.name=step"], "sched.name='step' is not supported"),
    ([*PRE, "sched.min_lr_ratio=2"], "sched.min_lr_ratio=2"),
    ([*PRE, "sched.total_steps=0"], "sched.total_steps=0 must be at least 1"),
    ([*PRE, "optim.lr=0"], "optim.lr=0"),
    ([*PRE, "optim.lr=-1e-3"], "optim.lr=-0.001"),
    ([*PRE, "optim.name=sgd"], "optim.name='sgd' is not supported"),
    ([*PRE, "optim.beta1=1.5"], "optim.beta1=1.5"),
    ([*PRE, "optim.grad_clip=-1"], "optim.grad_clip=-1"),
    ([*PRE, "optim.weight_decay=-0.1"], "optim.weight_decay=-0.1"),
    ([*PRE, "log.wandb_mode=cloud"], "log.wandb_mode='cloud' is not supported"),
    ([*PRE, "model.family=bert"], "model.family='bert' is not a model family"),
    ([*PRE, "model.attention=flash"], "model.attention='flash'"),
    ([*PRE, "model.num_experts=-1"], "model.num_experts=-1"),
    ([*PRE, "model.hidden_size=65"], "model.hidden_size=65"),
    ([*PRE, "model.vocab_size=100"], "model.vocab_size=100"),
    ([*PRE, "model.dropout=1.5"], "model.dropout=1.5"),
    ([*PRE, "model.init_from=/nope"], "model.init_from='/nope'"),
    ([*PRE, "data.seq_len=4096"], "data.seq_len=4096 exceeds model.max_seq_len"),
    ([*PRE, "data.val_fraction=1.5"], "data.val_fraction=1.5"),
    ([*PRE, "data.path=/does/not/exist"], "data.path='/does/not/exist' does not exist"),
    ([*PRE, "data.path={file}"], "is a file"),
    ([*PRE, "data.path={cwd}"], "not a prepared data folder"),
    ([*PRE, "recompute.granularity=some"], "recompute.granularity"),
    # --- the run folder
    ([*PRE, "run.dir="], "run.dir is empty"),
    ([*PRE, "run.dir=/proc/suite-run"], "run.dir='/proc/suite-run'"),
    ([*PRE, "run.dir={file}"], "is a file"),
    ([*PRE, "run.dir={run}", "train.max_steps=1"], "train.max_steps=1 is below step 2"),
    # --- processes and degrees
    ([*PRE, "launch.nproc_per_node=abc"], "launch.nproc_per_node='abc' is not a process count"),
    ([*PRE, "launch.nproc_per_node=4:2"], "the minimum 4 exceeds the maximum 2"),
    ([*PRE, "launch.nproc_per_node=0"], "launch.nproc_per_node=0 must be at least 1"),
    ([*PRE, "launch.nnodes=0"], "launch.nnodes=0"),
    ([*PRE, "launch.backend=mpi"], "launch.backend='mpi' is not supported"),
    ([*PRE, "launch.worker_start=forkserver"], "launch.worker_start='forkserver' is not supported"),
    ([*PRE, "parallel.tp=2"], "world size"),
    ([*PRE, "parallel.micro_batch_size=0"], "parallel.micro_batch_size=0"),
    ([*PRE, "parallel.global_batch_size=6", "parallel.micro_batch_size=4"], "parallel.global_batch_size=6"),
    ([*PRE, "parallel.ep=2", "launch.nproc_per_node=2"], "data-parallel"),
    ([*PRE, "parallel.pp_schedule=zigzag"], "parallel.pp_schedule"),
    # --- align
    (
        ["align", "align.method=ppo"],
        "align.method='ppo' is not a registered method; use one of: dpo, grpo, simpo",
    ),
    (["align", "align.data=null"], "align.data is missing"),
    (["align", "align.data={cwd}/pairs.jsonl"], "does not exist"),
    (["align", "align.data={chat}", "align.label_smoothing=0.7"], "align.label_smoothing=0.7"),
    (["align", "align.data={chat}", "align.pair_samples=4"], "align.pair_samples=4 with align.data="),
    (["align", "align.data={chat}", "model.init_from=null"], "model.init_from is missing"),
    (
        ["align", "align.data={chat}", "parallel.tp=2", "launch.nproc_per_node=2"],
        "parallel.tp=2: suite align runs",
    ),
    (
        ["align", "align.data={chat}", "parallel.pp=2", "launch.nproc_per_node=2"],
        "parallel.pp=2: suite align runs",
    ),
    (
        ["align", "align.data={chat}", "parallel.cp=2", "launch.nproc_per_node=2"],
        "parallel.cp=2: suite align runs",
    ),
    (
        ["align", "align.data={chat}", "parallel.ep=2", "launch.nproc_per_node=2"],
        "parallel.ep=2: suite align runs",
    ),
    # --- finetune
    (["finetune"], "model.init_from='runs/gpt-tiny'"),
    (["finetune", "model.init_from=/nope"], "model.init_from='/nope'"),
    ([*FT, "finetune.method=qlora"], "finetune.method='qlora' is not supported"),
    ([*FT, "finetune.lora.rank=0"], "finetune.lora.rank=0"),
    ([*FT, "finetune.lora.dropout=1.5"], "finetune.lora.dropout=1.5"),
    ([*FT, "finetune.epochs=-1"], "finetune.epochs=-1"),
    ([*FT, "finetune.data.task=reverse-x"], "reverse-x"),
    ([*FT, "finetune.data.truncation=cut"], "finetune.data.truncation='cut'"),
    ([*FT, "finetune.data.sources=[{path: {chat}}]"], "finetune.data.task=null"),
    # --- eval
    (["eval"], "ckpt is missing"),
    (["eval", "ckpt=/nowhere"], "ckpt='/nowhere': neither a run folder"),
    (["eval", "ckpt={run}"], "was not finetuned on a built-in task"),
    (["eval", "ckpt={run}", "task=nope"], "task='nope'"),
    (["eval", "ckpt={run}", "task=reverse-6", "eval.num_samples=0"], "eval.num_samples=0"),
    (["eval", "ckpt={run}", "task=reverse-6", "eval.num_samples=-3"], "eval.num_samples=-3"),
    (["eval", "ckpt={run}", "task=reverse-6", "eval.max_new_tokens=0"], "eval.max_new_tokens=0"),
    (["eval", "ckpt={run}", "metric=bleu"], "eval.metric='bleu' is not supported"),
    (["eval", "ckpt={run}", "metric=perplexity", "harness=suite_tiny_mc"], "pick one"),
    (["eval", "ckpt={run}", "metric=perplexity", "eval.stride=0"], "eval.stride=0 must be a positive"),
    (["eval", "ckpt={run}", "metric=perplexity", "eval.stride=-2"], "eval.stride=-2 must be a positive"),
    (["eval", "ckpt={run}", "metric=perplexity", "eval.seq_len=16", "eval.stride=32"], "is larger than"),
    (["eval", "ckpt={run}", "metric=perplexity", "eval.seq_len=0"], "eval.seq_len=0 must be at least 2"),
    (["eval", "ckpt={run}", "metric=perplexity", "eval.seq_len=128"], "longer than the model's context"),
    (["eval", "ckpt={run}", "metric=perplexity", "eval.max_tokens=0"], "eval.max_tokens=0"),
    (["eval", "ckpt={run}", "metric=perplexity", "eval.data={cwd}/missing.txt"], "does not exist"),
    (["eval", "ckpt={run}", "metric=perplexity", "eval.data={empty}"], "holds 0 token(s)"),
    (["eval", "ckpt={run}", "metric=perplexity", "eval.data={cwd}"], "is a folder"),
    (
        ["eval", "ckpt={run}", "harness=no_such_task"],
        "harness task 'no_such_task' is unknown; shipped with suite",
    ),
    (["eval", "ckpt={run}", "harness=suite_tiny_mc", "eval.limit=0"], "eval.limit=0"),
    # --- prepare
    (["prepare", "data.vocab_size=0"], "data.vocab_size=0"),
    (["prepare", "data.val_fraction=-0.1"], "data.val_fraction=-0.1"),
    (["prepare", "data.sources=[{path: /nope/*.txt}]", "data.path={cwd}/out"], "/nope/*.txt"),
    (["prepare", "data.sources=[{path: {chat}}]", "data.path={file}"], "is a file"),
    (["prepare", "data.tokenizer=/nope/tokenizer.json", "data.path={cwd}/out"], "data.tokenizer='/nope"),
    # --- generate
    (["generate", "prompt=hi"], "ckpt is missing"),
    (["generate", "ckpt=/nowhere"], "ckpt='/nowhere': neither a run folder"),
    ([*GEN, "generate.max_new_tokens=-5"], "generate.max_new_tokens=-5"),
    ([*GEN, "generate.max_new_tokens=0"], "generate.max_new_tokens=0"),
    ([*GEN, "generate.top_k=-3"], "generate.top_k=-3"),
    ([*GEN, "generate.top_k=0"], "generate.top_k=0"),
    ([*GEN, "generate.top_p=2"], "generate.top_p=2"),
    ([*GEN, "generate.top_p=0"], "generate.top_p=0"),
    ([*GEN, "generate.temperature=-1"], "generate.temperature=-1"),
    ([*GEN, "generate.seed=abc"], "generate.seed"),
    ([*GEN, "prompt="], "generate.prompt is empty"),
    ([*GEN, "prompt_file=/nope.txt"], "prompt_file='/nope.txt'"),
    ([*GEN, "prompt_file={cwd}"], "is a folder"),
    ([*GEN, "prompt=hi", "prompt_file={file}"], "prompt= or prompt_file="),
    ([*GEN, f"prompt={LONG_PROMPT}"], "longer than the model's context"),
    ([*GEN, "train.device=cuda"], "train.device=cuda"),
    (["generate", "ckpt={run}/checkpoints/step_7"], "step_7 does not exist"),
    # --- export
    (["export"], "ckpt is missing"),
    (["export", "ckpt=/nowhere"], "ckpt='/nowhere': neither a run folder"),
    ([*EXP, "format=tflite"], "export.format='tflite' is not supported"),
    ([*EXP, "export.dtype=int8"], "export.dtype='int8' is not supported"),
    ([*EXP, "export.max_shard_mb=0"], "export.max_shard_mb=0"),
    ([*EXP, "out={file}"], "is a file"),
    ([*EXP, "out=/proc/suite-export"], "out='/proc/suite-export'"),
    ([*EXP, "out={nonempty}"], "not empty"),
    ([*EXP, "merge_lora=maybe"], "export.merge_lora"),
    ([*EXP, "out="], "export.out is empty"),
    # --- config
    (["config"], "config needs a subcommand"),
    (["config", "frob"], "config subcommand 'frob' is unknown"),
    (["config", "cp", "recipe=gpt99b", "{cwd}/x.yaml"], "recipe='gpt99b' is not a known recipe"),
    (["config", "cp", "recipe=gpt13b"], "config cp needs recipe=NAME and a destination"),
    (["config", "cp", "recipe=gpt13b", "{cwd}/missing/x.yaml"], "no such folder"),
    (["config", "cp", "recipe=gpt13b", "{file}"], "already exists"),
    (["config", "show", "recipe=nope"], "recipe='nope' is not a known recipe"),
    (["config", "show", "model.num_layer=3"], "did you mean 'model.num_layers'"),
    (["config", "list", "extra"], "config list takes no arguments"),
]


def _case_id(argv: list[str]) -> str:
    shown = " ".join(
        a if len(a) < 40 else a[:20] + "..." for a in argv if a not in PRE[1:] or argv[0] != "pretrain"
    )
    return shown.replace("{", "").replace("}", "")


def _snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[str(path.relative_to(folder))] = "dir"
    return out


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    cli = ForkedCLI(suite_env())
    yield cli
    cli.close()


SHARED_TRAIN = [  # how the shared run trained (and how a suggested fix goes on training it)
    "train.save_every=2",
    "train.eval_every=2",
    "train.eval_batches=1",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=2",
]


@pytest.fixture(scope="module")
def shared(forked, tmp_path_factory, tiny_data):
    """A trained tiny run (2 steps), trained through the forked CLI, and its snapshot."""
    root = tmp_path_factory.mktemp("careless")
    run = root / "run"
    args = ["pretrain", *TINY_MODEL, f"data.path={tiny_data}", f"run.dir={run}", "train.max_steps=2"]
    args += SHARED_TRAIN
    proc = forked.run(args, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr
    chat = root / "chat.jsonl"
    chat.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    return {"run": run, "data": tiny_data, "chat": chat, "snapshot": _snapshot(run), "root": root}


CHAT_ROW = {
    "messages": [{"role": "user", "content": "un café ?"}, {"role": "assistant", "content": "oui, très"}]
}
TEXTS = [{"text": f"Ligne {i}: le café de la gare ouvre à {i} heures."} for i in range(40)]
ROWS = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in TEXTS)  # 40 documents as JSON lines
# placeholder -> (file name, text, encoding); {junk} is random bytes
DATA_FILES = {
    "latin1": ("notes.jsonl", ROWS, "latin-1"),
    "latin1_chat": ("chat_latin1.jsonl", json.dumps(CHAT_ROW, ensure_ascii=False) + "\n", "latin-1"),
    "fake_parquet": ("corpus.parquet", ROWS, "utf-8"),
    "fake_chat_parquet": ("chat.parquet", json.dumps(CHAT_ROW) + "\n", "utf-8"),
    "bad_pipeline": ("pipe.yaml", "stages:\n  pretrain:\n    args: [train.max_steps=2, a\n", "utf-8"),
    "utf16": ("notes16.jsonl", ROWS, "utf-16"),
    "rows": ("rows.jsonl", ROWS, "utf-8"),
}


def _data_files(cwd: Path) -> dict[str, str]:
    """The careless data files of DATA_CASES, written into `cwd`: placeholder -> path."""
    out = {}
    for key, (name, text, encoding) in DATA_FILES.items():
        (cwd / name).write_bytes(text.encode(encoding))
        out[key] = str(cwd / name)
    (cwd / "junk.txt").write_bytes(random.Random(39).randbytes(20_000))
    out["junk"] = str(cwd / "junk.txt")
    return out


def _prepare_cwd(cwd: Path) -> dict[str, str]:
    cwd.mkdir(parents=True)
    (cwd / "existing.txt").write_text("an edited file the user keeps\n")
    (cwd / "bad.yaml").write_text("# @package _global_\ntrain:\n  max_steps: [1, 2\n")
    (cwd / "nopkg.yaml").write_text("train:\n  max_steps: 5\n")
    (cwd / "nonempty").mkdir()
    (cwd / "nonempty" / "notes.txt").write_text("unrelated\n")
    (cwd / "empty.txt").write_text("")
    return {
        "cwd": str(cwd),
        "file": str(cwd / "existing.txt"),
        "bad_yaml": str(cwd / "bad.yaml"),
        "no_package": str(cwd / "nopkg.yaml"),
        "nonempty": str(cwd / "nonempty"),
        "empty": str(cwd / "empty.txt"),
        **_data_files(cwd),
    }


def _fill(arg: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


def run_case(forked, shared, tmp_path: Path, argv: list[str], fork: bool = True):
    cwd = tmp_path / "cwd"
    values = {
        **_prepare_cwd(cwd),
        "run": str(shared["run"]),
        "data": str(shared["data"]),
        "chat": str(shared["chat"]),
    }
    argv = [_fill(a, values) for a in argv]
    before = _snapshot(cwd)
    if fork:
        proc = forked.run(argv, cwd=cwd, out=tmp_path / "out", timeout=120)
    else:
        proc = run_suite(*argv, cwd=cwd, timeout=180)
    return proc, before, _snapshot(cwd)


@pytest.mark.parametrize(("argv", "expected"), CASES, ids=[_case_id(a) for a, _ in CASES])
def test_careless_input_answers_in_one_line(forked, shared, tmp_path, argv, expected):
    if "train.device=cuda" in argv:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU: train.device=cuda is no mistake here")
    proc, before, after = run_case(forked, shared, tmp_path, argv)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr}"
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert after == before, "the working directory changed"
    assert _snapshot(shared["run"]) == shared["snapshot"], "the run folder changed"


def test_the_cases_are_distinct_and_many():
    assert len(CASES) >= 80
    assert len({tuple(a) for a, _ in CASES}) == len(CASES)
    verbs = {a[0] for a, _ in CASES}
    assert verbs >= {"pretrain", "finetune", "eval", "prepare", "generate", "export", "config"}


# a grammar error, a value check after composing, a checkpoint verb's check
COMPARED = [["pretrain", "steps"], [*PRE, "sched.warmup_steps=-5"], [*GEN, "generate.top_p=2"]]


def test_forked_cli_matches_python_m_suite(forked, shared, tmp_path):
    for index, argv in enumerate(COMPARED):
        assert any(argv == case for case, _ in CASES)
        forked_proc, _, _ = run_case(forked, shared, tmp_path / f"fork{index}", argv)
        plain, _, _ = run_case(forked, shared, tmp_path / f"plain{index}", argv, fork=False)
        assert (forked_proc.returncode, forked_proc.stdout) == (plain.returncode, plain.stdout)
        assert forked_proc.stderr.replace("fork", "plain") == plain.stderr.replace("fork", "plain")


PROMPTS = [
    "naïve café, 東京 — ünïcode",
    "it's (a) test: a=b, c=d",
    "line one\nline two\n",
    "${env:HOME} and ${oc.env:PATH} stay text",
    "trailing spaces   ",
    "'single' \"double\" [1, 2] {a: b} \\back",
]


@pytest.mark.parametrize("how", ["prompt=", "generate.prompt=", "prompt_file=", "prompt_file=-"])
def test_prompts_are_taken_verbatim(forked, shared, tmp_path, how):
    import json

    prompts = PROMPTS if how == "prompt=" else PROMPTS[1:4]  # the override grammar: every one; else a few
    for i, prompt in enumerate(prompts):
        cwd = tmp_path / f"p{i}"
        cwd.mkdir()
        stdin = None
        if how == "prompt_file=":
            (cwd / "prompt.txt").write_text(prompt, encoding="utf-8")
            arg = f"prompt_file={cwd / 'prompt.txt'}"
        elif how == "prompt_file=-":
            arg, stdin = "prompt_file=-", prompt
        else:
            arg = how + prompt
        argv = ["generate", f"ckpt={shared['run']}", arg, "generate.max_new_tokens=1", "--json"]
        proc = forked.run(argv, cwd=cwd, stdin=stdin)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["prompt"] == prompt
        assert "Traceback" not in proc.stderr


def test_generation_past_the_context_says_where_it_stops(forked, shared, tmp_path):
    argv = ["generate", f"ckpt={shared['run']}", "prompt=The", "generate.max_new_tokens=500"]
    proc = forked.run(argv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "generation stops at the context length" in proc.stderr and "model.max_seq_len=64" in proc.stderr


# Data files and output places: (argv, the file the line must name, a distinctive part of the line).
# finetune first says which checkpoint it read, so these allow up to 3 lines, the last the error.
FT_DATA = [*FT, "finetune.data.task=null", "data.seq_len=32"]
PREP = ["prepare", "data.vocab_size=300", "data.path={cwd}/prepared"]
DATA_CASES: list[tuple[list[str], str, str]] = [
    ([*PREP, "data.sources=[{path: {latin1}}]"], "{latin1}", "is not UTF-8 text (line 1, byte 25: 0xe9)"),
    ([*PREP, "data.sources=[{path: {fake_parquet}}]"], "{fake_parquet}", "is not a Parquet file"),
    ([*PREP, "data.sources=[{path: {junk}}]"], "{junk}", "holds binary data, not text"),
    ([*PREP, "data.sources=[{path: {empty}}]"], "{empty}", "holds no text"),
    (
        [*PREP, "data.sources=[{path: {utf16}}]"],
        "{utf16}",
        "is UTF-16 text; re-encode it as UTF-8 with `iconv",
    ),
    (
        [*PREP[:2], "data.sources=[{path: {rows}}]", "data.path=/proc/suite-data"],
        "/proc/suite-data",
        "not writable",
    ),
    (
        [*FT_DATA, "finetune.data.sources=[{path: {latin1_chat}}]"],
        "{latin1_chat}",
        "iconv -f latin1 -t utf-8",
    ),
    (
        [*FT_DATA, "finetune.data.sources=[{path: {fake_chat_parquet}}]"],
        "{fake_chat_parquet}",
        "read as .jsonl",
    ),
    (["run", "pipeline={bad_pipeline}"], "{bad_pipeline}:4:1", "starts at 3:11"),
    (["report", "{run}", "out=/proc/suite-report"], "/proc/suite-report", "cannot be created"),
    (
        ["run", "pipeline=embedded", "run.dir=/proc/suite-pipeline"],
        "/proc/suite-pipeline",
        "cannot be created",
    ),
]


def _data_case_id(case: tuple[list[str], str, str]) -> str:
    argv, named, _ = case
    return f"{argv[0]} {named}".replace("{", "").replace("}", "")


@pytest.mark.parametrize(
    ("argv", "named", "expected"), DATA_CASES, ids=[_data_case_id(c) for c in DATA_CASES]
)
def test_careless_data_files_answer_in_one_line(forked, shared, tmp_path, argv, named, expected):
    proc, before, after = run_case(forked, shared, tmp_path, argv)
    cwd = tmp_path / "cwd"
    paths = {key: str(cwd / name) for key, (name, _, _) in DATA_FILES.items()}
    paths.update(run=str(shared["run"]), junk=str(cwd / "junk.txt"), empty=str(cwd / "empty.txt"))
    named = _fill(named, paths)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr}"
    assert 1 <= len(lines) <= 3, proc.stderr
    assert lines[-1].startswith("error: ") and named in lines[-1] and expected in lines[-1], lines[-1]
    assert after == before, "the working directory changed"
    assert _snapshot(shared["run"]) == shared["snapshot"], "the run folder changed"


# Each suggested fix runs: for these refusals (from CASES and DATA_CASES), every way on that the one
# line offers, read by tests/suggested_fix.py as for any refusal (a command in backticks, key=value,
# --flag, drop key=) and applied to the refused command as a user would type it, runs to exit 0.
# The second list is what both commands carry so the fixed one stops early where the refusal is a
# check of its own: a printed launch, a few tokens, the shared run's batch. {run} is a copy here.
FIXES: list[tuple[list[str], list[str]]] = [
    # train on, a new run.dir, or train.overwrite=true (which was refused here too)
    ([*PRE, "run.dir={run}", "train.max_steps=1"], SHARED_TRAIN),
    ([*GEN, "generate.top_p=2"], ["generate.max_new_tokens=2"]),  # a value to type
    (["config", "show", "model.name=a b,c"], []),  # the quoting form
    (["finetune", "ckpt={run}", "run.dir={cwd}/ft"], ["--print-launch"]),  # drop ckpt=, model.init_from=
    ([*PREP, "data.sources=[{path: {latin1}}]"], []),  # the iconv command, then its file
    ([*PREP, "data.sources=[{path: {utf16}}]"], []),  # the same for UTF-16
    ([*PREP, "data.sources=[{path: {fake_parquet}}]"], []),  # `cp` to the name it reads as (.jsonl)
    ([*PREP[:2], "data.sources=[{path: {rows}}]", "data.path=/proc/suite-data"], []),  # a folder in cwd
    (["config", "show", "model.num_layer=3"], []),  # the key meant, with the value typed
    (
        ["eval", "ckpt={run}", "metric=perplexity", "eval.seq_len=16", "eval.stride=32"],
        ["eval.max_tokens=64"],
    ),
]


@pytest.mark.parametrize(("argv", "carried"), FIXES, ids=[_case_id(a) for a, _ in FIXES])
def test_each_suggested_fix_runs(forked, shared, tmp_path, argv, carried):
    assert argv in [a for a, _ in CASES] + [a for a, _, _ in DATA_CASES]
    cwd = tmp_path / "cwd"
    values = {**_prepare_cwd(cwd), "run": str(tmp_path / "run"), "data": str(shared["data"])}
    shutil.copytree(shared["run"], tmp_path / "run")
    refused = [_fill(a, values) for a in [*argv, *carried]]
    proc = forked.run(refused, cwd=cwd, out=tmp_path / "out", timeout=120)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and line.startswith("error: "), proc.stderr
    ways = ways_on(line)
    assert ways, f"no way on to run in: {line}"
    for index, way in enumerate(ways):
        for command in way.commands:
            subprocess.run(command, shell=True, check=True, cwd=cwd, timeout=60)
        fixed = way.apply(refused)
        proc = forked.run(fixed, cwd=cwd, out=tmp_path / f"out{index}", timeout=300)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (line, way, proc.stderr[-2000:])
        assert not [e for e in proc.stderr.splitlines() if e.startswith("error:")], proc.stderr
