"""A real checkpoint through SFT and export (issue 43): SmolLM2-135M-Instruct read as `gguf:<file>`.

    flock /tmp/heavy.lock python bench/real_model.py                       # LoRA, 50 steps, 3 shapes
    python bench/real_model.py --steps 2 --shapes messages --out /tmp/rm   # a quick look

The chat set is the built-in task's conversations (reverse-4: 200 to train on, 24 held out,
deterministic), written in each of the three row shapes the suite reads: OpenAI `messages`, ShareGPT
`conversations`/`from`/`value`, Alpaca `instruction`/`input`/`output`. The same conversations render
to the same tokens, so the three runs must log the same losses: a shape read differently shows as
another curve. For each shape, as a user runs it:

    suite finetune model.init_from=gguf:<file> finetune.data.sources=[{path: <shape>/train.jsonl}]
        finetune.data.eval_sources=[{path: <shape>/eval.jsonl}] finetune.method=lora train.max_steps=50

and the held-out loss before (the trainer's step-0 evaluation) and after. Then the first run is
exported as an HF folder and as an F16 GGUF, and the chat prompt each renders for the same messages
(add_generation_prompt) is compared: transformers' `apply_chat_template` on the HF export, and
llama.cpp's chat handler on the GGUF (llama-cpp-python's Jinja2ChatFormatter built, as `Llama` builds
it, from the file's `tokenizer.chat_template` and its bos/eos token texts). A greedy answer from
llama.cpp's chat completion shows the trained format. One markdown table and JSON lines are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported

from finetune import suite  # noqa: E402 (after the path)

DEFAULT_GGUF = REPO / ".cache" / "real_model" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPES = ("messages", "sharegpt", "alpaca")
PROBE = [{"role": "user", "content": "Reverse the digits 4821."}]


def shaped(conversation: list[dict[str, str]], shape: str) -> dict:
    """One user/assistant conversation as a row of `shape`."""
    user, assistant = conversation[0]["content"], conversation[1]["content"]
    if shape == "messages":
        return {"messages": conversation}
    if shape == "sharegpt":
        return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]}
    return {"instruction": user, "input": "", "output": assistant}


def write_chat_sets(out: Path, task: str, rows: int, held_out: int) -> dict[str, dict[str, Path]]:
    """<out>/data/<shape>/{train,eval}.jsonl: the same conversations in each shape."""
    sys.path.insert(0, str(REPO))
    from suite.data.tasks import generate_task

    train, evals = generate_task(task, rows, held_out, seed=0)
    paths = {}
    for shape in SHAPES:
        folder = out / "data" / shape
        folder.mkdir(parents=True, exist_ok=True)
        paths[shape] = {}
        for split, convs in (("train", train), ("eval", evals)):
            path = folder / f"{split}.jsonl"
            path.write_text("".join(json.dumps(shaped(c, shape)) + "\n" for c in convs))
            paths[shape][split] = path
    return paths


def same_rows_in_every_shape(gguf: Path, sets: dict[str, dict[str, Path]], seq_len: int) -> bool:
    """The three shapes' training files render to the same token rows and loss masks (SmolLM2's
    tokenizer and template): the runs on them are one computation, so their losses must agree."""
    sys.path.insert(0, str(REPO))
    from suite.data.sft import SFTDataset, SFTOptions
    from suite.model_source import ModelSource

    tokenizer = ModelSource.parse(f"gguf:{gguf}").tokenizer()
    options = SFTOptions(seq_len=seq_len, template=tokenizer.chat_template)
    rendered = []
    for shape in sets:
        data = SFTDataset.build(str(sets[shape]["train"]), tokenizer, options)
        rendered.append((data.tokens.tolist(), data.labels.tolist()))
    return all(r == rendered[0] for r in rendered)


def finetune(args: argparse.Namespace, gguf: Path, data: dict[str, Path], run_dir: Path) -> dict:
    load = os.getloadavg()[0]
    _, wall, cpu = suite(
        "finetune",
        f"model.init_from=gguf:{gguf}",
        f"run.dir={run_dir}",
        f"finetune.method={args.method}",
        f"finetune.lora.rank={args.rank}",
        f"finetune.lora.alpha={args.rank}",
        f"finetune.data.sources=[{{path: {data['train']}}}]",
        f"finetune.data.eval_sources=[{{path: {data['eval']}}}]",
        "finetune.data.task=null",
        "finetune.eval_samples=0",
        f"data.seq_len={args.seq_len}",
        f"parallel.micro_batch_size={args.batch}",
        f"parallel.global_batch_size={args.batch}",
        f"train.max_steps={args.steps}",
        f"train.eval_every={args.steps}",
        f"train.save_every={args.steps}",
        "train.log_every=10",
        "train.precision=fp32",
        f"optim.lr={args.lr}",
        "sched.warmup_steps=5",
        "train.overwrite=true",
        "log.wandb=false",
        "log.progress=false",
        "log.report=false",
    )
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    evals = {r["step"]: r["val_loss"] for r in metrics if "val_loss" in r}
    losses = [r["loss"] for r in metrics if "loss" in r]
    return {
        "before": evals[min(evals)],
        "after": evals[max(evals)],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "load_at_start": round(load, 2),
        "load_at_end": round(os.getloadavg()[0], 2),
    }


def rendered_prompts(hf_dir: Path, gguf_file: Path) -> dict:
    """The chat prompt for PROBE from transformers (HF export) and llama.cpp (GGUF export)."""
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    theirs = tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    llama = Llama(str(gguf_file), n_ctx=256, n_threads=2, verbose=False, seed=0)
    vocab = llama._model
    formatter = Jinja2ChatFormatter(
        template=llama.metadata["tokenizer.chat_template"],
        eos_token=vocab.token_get_text(llama.token_eos()),
        bos_token=vocab.token_get_text(llama.token_bos()),
    )
    ours = formatter(messages=PROBE).prompt
    ids_hf = tokenizer.encode(theirs, add_special_tokens=False)
    ids_llama = llama.tokenize(ours.encode(), add_bos=False, special=True)
    reply = llama.create_chat_completion(messages=PROBE, max_tokens=12, temperature=0.0)
    return {
        "same_prompt": theirs == ours,
        "same_tokens": list(ids_hf) == list(ids_llama),
        "prompt": ours,
        "llama_cpp_chat_format": llama.chat_format,
        "llama_cpp_answer": reply["choices"][0]["message"]["content"],
        "gguf_pre": llama.metadata.get("tokenizer.ggml.pre"),
        "hf_bos_token_id": json.loads((hf_dir / "config.json").read_text()).get("bos_token_id"),
    }


def table(rows: list[dict]) -> None:
    print("\n| shape | held-out loss before | after | train loss first / last | wall s | load |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['before']:.4f} | {r['after']:.4f} | {r['first_loss']:.3f} / {r['last_loss']:.3f} "
            f"| {r['wall_s']:.0f} | {r['load_at_start']:.1f}-{r['load_at_end']:.1f} |",
            flush=True,
        )


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return proc.stdout.strip() or "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--gguf", type=Path, default=DEFAULT_GGUF, help="the SmolLM2 file (tests/real_model.py fetches it)"
    )
    p.add_argument("--out", type=Path, default=Path("/tmp/real_model_bench"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--task", default="reverse-4")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--method", default="lora", choices=("lora", "full"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--no-export", action="store_true", help="train only (the exports come from the first shape)"
    )
    args = p.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"{args.gguf}: no such file; `pytest tests/e2e/test_real_model.py` fetches it")
    sets = write_chat_sets(args.out, args.task, args.rows, args.held_out)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; commit {commit()}",
        flush=True,
    )
    print(f"the shapes render the same token rows: {same_rows_in_every_shape(args.gguf, sets, args.seq_len)}")
    rows = []
    for shape in args.shapes.split(","):
        record = {"shape": shape, **finetune(args, args.gguf, sets[shape], args.out / "runs" / shape)}
        rows.append(record)
        print(json.dumps(record), flush=True)
    table(rows)
    if args.no_export:
        return
    first = args.out / "runs" / args.shapes.split(",")[0]
    merge = ["merge_lora=true"] if args.method == "lora" else []
    _, hf_s, _ = suite("export", f"ckpt={first}", f"out={args.out / 'hf'}", "--overwrite", *merge)
    _, gguf_s, _ = suite(
        "export", f"ckpt={first}", f"out={args.out / 'gguf'}", "format=gguf", "--overwrite", *merge
    )
    render = rendered_prompts(args.out / "hf", next((args.out / "gguf").glob("*.gguf")))
    render.update(export_hf_s=round(hf_s, 1), export_gguf_s=round(gguf_s, 1))
    print(json.dumps(render), flush=True)
    print(
        f"\nexports of {first.name}: same prompt {render['same_prompt']}, same tokens {render['same_tokens']}, "
        f"llama.cpp chat format {render['llama_cpp_chat_format']!r}, answer {render['llama_cpp_answer']!r}"
    )


if __name__ == "__main__":
    main()
