"""`suite generate` beyond one prompt: batches of prompts of different lengths (left-padded into one
static-cache batch) decode exactly as each prompt alone; stop sequences, the chat template, streaming,
an export folder as ckpt=, `suite chat` on piped input; one-line errors for bad prompt files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from suite.config.schema import GenerateConfig
from suite.infer.engines import ModelEngine, load_engine
from suite.infer.generate import generate_texts, generate_tokens
from suite.model_source import ModelSource
from tests.helpers import REPO, TINY_MODEL, run_suite, suite_env

GREEDY = GenerateConfig(max_new_tokens=12, temperature=0.0, top_k=None, top_p=None)
PROMPTS = ["The module", "A longer prompt about the suite and its", "It", "Parallel layouts are"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for family, model in {
        "gpt": ["model=gpt-tiny"],
        "llama": ["model=llama-tiny", "model.num_kv_heads=2"],
    }.items():
        run = root / family
        run_suite(
            "pretrain",
            *model,
            *TINY_MODEL,
            f"data.path={tiny_data}",
            f"run.dir={run}",
            "train.max_steps=4",
            "train.eval_every=4",
            "train.eval_batches=1",
            "parallel.micro_batch_size=2",
            "parallel.global_batch_size=2",
            check=True,
            timeout=300,
        )
        out[family] = run
    # the gpt run carries a chat template the way a finetuned run does (tokenizer_config.json and
    # chat_template.jinja beside tokenizer.json); the llama run, pretrained only, has none
    from suite.data.chat import CHAT_TEMPLATES

    tokenizer = ModelSource.parse(str(out["gpt"])).tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATES["chatml"]
    tokenizer.save_pretrained(out["gpt"])
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_padded_batch_decodes_each_prompt_as_alone(runs, family):
    model = ModelSource.parse(str(runs[family])).load_model("cpu")
    tokenizer = ModelSource.parse(str(runs[family])).tokenizer()
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 2  # really ragged
    engine = ModelEngine(model)
    steps = torch.stack(list(engine.steps(prompts, 12, lambda x: x.argmax(-1, keepdim=True))), 1)
    for row, ids in enumerate(prompts):
        assert steps[row].tolist() == generate_tokens(model, ids, GREEDY), f"row {row}"
    # sampling: a fixed seed gives the same batch twice
    sampled = GenerateConfig(max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=3, batch_size=2)
    first = generate_texts(engine, tokenizer, prompts, sampled)
    assert first == generate_texts(engine, tokenizer, prompts, sampled) and len(first) == 4


def test_stop_sequences_end_a_row_where_they_appear(runs):
    source = ModelSource.parse(str(runs["gpt"]))
    engine, tokenizer = ModelEngine(source.load_model("cpu")), source.tokenizer()
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    free = generate_texts(engine, tokenizer, ids, GREEDY)
    row = max(range(4), key=lambda i: len(free[i]))
    stop = free[row][len(free[row]) // 2 : len(free[row]) // 2 + 2]
    assert stop.strip(), free
    cut = generate_texts(engine, tokenizer, ids, GenerateConfig(**{**GREEDY.__dict__, "stop": [stop]}))
    for full, short in zip(free, cut):
        assert short == full[: full.find(stop)] if stop in full else short == full


def test_prompts_file_stream_chat_and_an_export_folder(runs, tmp_path):
    run = runs["llama"]
    lines = tmp_path / "prompts.txt"
    lines.write_text("\n".join(PROMPTS[:3]) + "\n\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    common = ["generate.temperature=0", "generate.max_new_tokens=10", "--json"]
    by_lines = run_suite("generate", f"ckpt={run}", f"generate.prompts_file={lines}", *common, check=True)
    by_jsonl = run_suite("generate", f"ckpt={run}", f"generate.prompts_file={jsonl}", *common, check=True)
    results = json.loads(by_lines.stdout)["results"]
    assert results == json.loads(by_jsonl.stdout)["results"]
    assert [r["prompt"] for r in results] == PROMPTS[:3]
    # each equals the same prompt alone; streamed output (no --json) is prompt + the same text
    for r in results[:2]:
        alone = run_suite("generate", f"ckpt={run}", f"prompt={r['prompt']}", *common, check=True)
        assert json.loads(alone.stdout)["text"] == r["text"]
    streamed = run_suite("generate", f"ckpt={run}", f"prompt={PROMPTS[0]}", *common[:2], check=True)
    assert streamed.stdout == PROMPTS[0] + results[0]["text"] + "\n"
    # an ONNX export folder as ckpt=: the same greedy text
    out = tmp_path / "onnx"
    run_suite("export", f"ckpt={run}", "format=onnx", f"out={out}", check=True, timeout=600)
    from_onnx = run_suite("generate", f"ckpt={out}", f"generate.prompts_file={lines}", *common, check=True)
    assert json.loads(from_onnx.stdout)["results"] == results
    assert "onnx export (fp32)" in from_onnx.stderr
    # the chat template: the prompt goes in as a user turn, in the checkpoint's own template ...
    engine, tokenizer, _ = load_engine(str(runs["gpt"]))
    from suite.data.chat import CHAT_TEMPLATES, prompt_ids

    turn = prompt_ids(tokenizer, [{"role": "user", "content": PROMPTS[0]}], CHAT_TEMPLATES["chatml"])
    want = generate_texts(
        engine, tokenizer, [turn], GenerateConfig(**{**GREEDY.__dict__, "max_new_tokens": 10})
    )
    chat = run_suite(
        "generate", f"ckpt={runs['gpt']}", f"prompt={PROMPTS[0]}", "generate.chat=true", *common, check=True
    )
    assert json.loads(chat.stdout)["text"] == want[0]
    # ... and a model without one is refused in one line (no default template in its place)
    refused = run_suite("generate", f"ckpt={run}", f"prompt={PROMPTS[0]}", "generate.chat=true", *common)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "generate.chat=true" in refused.stderr and "carries no chat template" in refused.stderr


def test_suite_chat_reads_turns_until_end_of_input(runs):
    proc = subprocess.run(
        [sys.executable, "-m", "suite", "chat", f"ckpt={runs['gpt']}", "generate.temperature=0"]
        + ["generate.max_new_tokens=6"],
        input="hello there\nand again\n/exit\nnever read\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=suite_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") == 3, proc.stdout  # two turns answered, the third prompt reads /exit
    assert "chat: type a message" in proc.stderr


@pytest.mark.parametrize(
    "content, expected",
    [
        ("", "holds no prompts"),
        ("\n\n", "holds no prompts"),
        ('{"text": "x"}\n', 'line 1 is not a JSON object with a "prompt"'),
    ],
)
def test_bad_prompt_files_are_one_line(runs, tmp_path, content, expected):
    path = tmp_path / ("p.jsonl" if content.startswith("{") else "p.txt")
    path.write_text(content)
    proc = run_suite("generate", f"ckpt={runs['gpt']}", f"generate.prompts_file={path}")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], proc.stderr


def test_the_compiled_decode_step_decodes_the_same_tokens(runs):
    """generate.compile=true: torch.compile (inductor, weights frozen) of the static-shape decode step."""
    source = ModelSource.parse(str(runs["llama"]))
    model, tokenizer = source.load_model("cpu"), source.tokenizer()
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    pick = lambda logits: logits.argmax(-1, keepdim=True)  # noqa: E731
    eager = torch.stack(list(ModelEngine(model).steps(prompts, 10, pick)), 1)
    compiled = torch.stack(list(ModelEngine(model, compile=True).steps(prompts, 10, pick)), 1)
    assert torch.equal(eager, compiled)
