"""Generation speed: `suite generate`'s decoder against transformers' `generate` and onnxruntime, one run.

    python bench/generate.py                               # runs/gpt-tiny (made first when missing)
    python bench/generate.py --ckpt runs/llama-tiny --tokens 200 --batches 1 8 --repeats 5
    python bench/generate.py --append                      # also append the tables to docs/benchmarks.md

What it runs, all greedy, same prompts, same process, interleaved (best of --repeats):
  suite         the suite model with the static-cache batch decoder (what `suite generate` runs)
  suite+compile the same with generate.compile=true (torch.compile of the decode step; compiled once
                before timing, its compile time reported apart)
  transformers  AutoModelForCausalLM.from_pretrained(<suite export format=hf>).generate(use_cache=True)
  ort fp32/int8/int4  the `suite export format=onnx [export.quantize=...]` graphs in onnxruntime
Prefill tokens/s = batch x prompt length / time to the first token; decode tokens/s = batch x (N - 1)
/ (time for N tokens - time to the first token). Every contender must produce the same greedy tokens as
the suite (the quantized ONNX ones are only reported).

The KV-cache table: the suite model decoding --cache-tokens tokens with the cache against recomputing
the whole sequence every step (what generation without a cache does), batch 1, on the checkpoint's
architecture with max_seq_len raised to fit (random weights: speed does not depend on them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def suite(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "suite", *args], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"suite {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Contender:
    """first(batch): the first token only (prefill); full(batch): N tokens; both return the tokens."""

    def __init__(self, name: str, first, full):
        self.name, self.first, self.full = name, first, full
        self.best: dict[int, tuple[float, float]] = {}

    def measure(self, batch: int) -> None:
        t1 = timed(lambda: self.first(batch))
        tn = timed(lambda: self.full(batch))
        old = self.best.get(batch)
        if old is None:
            self.best[batch] = (t1, tn)
        else:
            self.best[batch] = (min(old[0], t1), min(old[1], tn))


def suite_contender(name, engine, prompts, n):
    from suite.config.schema import GenerateConfig  # noqa: F401

    pick = lambda logits: logits.argmax(-1, keepdim=True)  # noqa: E731

    def run(batch, tokens):
        return torch.stack(list(engine.steps(prompts[:batch], tokens, pick)), 1)

    return Contender(name, lambda b: run(b, 1), lambda b: run(b, n))


def hf_contender(model, prompts, n):
    def run(batch, tokens):
        with torch.no_grad():
            out = model.generate(
                torch.tensor(prompts[:batch]),
                attention_mask=torch.ones(batch, len(prompts[0]), dtype=torch.long),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        return out[:, len(prompts[0]) :]

    return Contender("transformers generate", lambda b: run(b, 1), lambda b: run(b, n))


def speed_table(contenders, batches, prompt_len, n) -> str:
    rows = [
        "| contender | batch | prefill tokens/s | decode tokens/s | decode vs transformers |",
        "|---|---|---|---|---|",
    ]
    hf = next(c for c in contenders if c.name == "transformers generate")
    for batch in batches:
        hf_t1, hf_tn = hf.best[batch]
        hf_decode = batch * (n - 1) / (hf_tn - hf_t1)
        for c in contenders:
            t1, tn = c.best[batch]
            decode = batch * (n - 1) / (tn - t1)
            rows.append(
                f"| {c.name} | {batch} | {batch * prompt_len / t1:,.0f} | {decode:,.0f} | {decode / hf_decode:.2f}x |"
            )
    return "\n".join(rows)


def cache_table(cfg, n: int, prompt_len: int, repeats: int) -> str:
    """With the static cache vs recomputing the sequence at every step, batch 1."""
    from suite.infer.engines import ModelEngine
    from suite.models import build_model

    big = dataclasses.replace(cfg, max_seq_len=prompt_len + n)
    model = build_model(big, "cpu")
    model.init_weights(0)
    model.eval()
    prompt = torch.randint(0, big.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    engine = ModelEngine(model)
    model = engine.decoder.model  # the same weight layout both ways: the table measures the cache alone
    pick = lambda logits: logits.argmax(-1, keepdim=True)  # noqa: E731

    @torch.no_grad()
    def without_cache():
        tokens = prompt
        out = []
        for _ in range(n):
            nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            tokens = torch.cat([tokens, nxt], 1)
        return torch.cat(out, 1)[0]

    def with_cache():
        return torch.stack(list(engine.steps(prompt.tolist(), n, pick)), 1)[0]

    assert with_cache().tolist() == without_cache().tolist(), "the cache changes the greedy tokens"
    cached = min(timed(with_cache) for _ in range(repeats))
    plain = min(timed(without_cache) for _ in range(max(1, repeats // 2)))
    return (
        f"| decoding {n} tokens after {prompt_len} (batch 1) | seconds | tokens/s |\n|---|---|---|\n"
        f"| with the KV cache (suite) | {cached:.2f} | {n / cached:,.0f} |\n"
        f"| without a cache (whole sequence every step) | {plain:.2f} | {n / plain:,.0f} |\n"
        f"| speed-up | {plain / cached:.1f}x | |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", default=str(REPO / "runs" / "gpt-tiny"))
    parser.add_argument("--tokens", type=int, default=200, help="tokens generated per prompt (N)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-tokens", type=int, default=256)
    parser.add_argument("--no-compile", action="store_true", help="leave suite+compile out")
    parser.add_argument("--out", default=None, help="folder for the exports (default: a temporary one)")
    parser.add_argument("--append", action="store_true", help="append the tables to docs/benchmarks.md")
    args = parser.parse_args()

    ckpt = Path(args.ckpt)
    if not ckpt.exists():
        print(f"{ckpt} is missing: training it (suite pretrain run.dir={ckpt})", file=sys.stderr)
        suite("pretrain", f"run.dir={ckpt}", "log.progress=false")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-generate-"))
    exports = {
        "hf": out / "hf",
        "onnx-fp32": out / "onnx-fp32",
        "onnx-int8": out / "onnx-int8",
        "onnx-int4": out / "onnx-int4",
    }
    for name, folder in exports.items():
        if not (folder / "export_manifest.json").exists():
            extra = (
                []
                if name == "hf"
                else ["format=onnx"] + ([f"export.quantize={name[5:]}"] if name != "onnx-fp32" else [])
            )
            suite("export", f"ckpt={ckpt}", f"out={folder}", *extra)

    from transformers import AutoModelForCausalLM

    from suite.infer.engines import GraphEngine, ModelEngine
    from suite.model_source import ModelSource

    threads = torch.get_num_threads()
    model = ModelSource.parse(str(ckpt)).load_model("cpu")
    vocab = model.cfg.vocab_size
    prompt_len, n = args.prompt_len, min(args.tokens, model.cfg.max_seq_len - args.prompt_len)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (max(args.batches), prompt_len), generator=gen).tolist()

    contenders = [suite_contender("suite", ModelEngine(model), prompts, n)]
    compile_note = ""
    if not args.no_compile:
        compiled = suite_contender("suite + compile", ModelEngine(model, compile=True), prompts, n)
        start = time.perf_counter()
        for batch in args.batches:  # compile once per batch size, before timing
            compiled.full(batch)
        compile_note = f"suite + compile: compiling the decode step for batches {args.batches} took {time.perf_counter() - start:.0f} s (not in the table)."
        contenders.append(compiled)
    hf = AutoModelForCausalLM.from_pretrained(exports["hf"]).eval()
    contenders.append(hf_contender(hf, prompts, n))
    for name in ("onnx-fp32", "onnx-int8", "onnx-int4"):
        engine = GraphEngine(exports[name], threads=threads)
        contenders.append(suite_contender(f"onnxruntime {name[5:]}", engine, prompts, n))

    reference = {b: contenders[0].full(b) for b in args.batches}
    for c in contenders[1:]:
        for b in args.batches:
            same = torch.equal(c.full(b).cpu(), reference[b])
            if not same and "int" not in c.name:
                raise SystemExit(f"{c.name} at batch {b} does not generate the suite's greedy tokens")
    for _ in range(args.repeats):
        for c in contenders:
            for b in args.batches:
                c.measure(b)

    cpu = platform.processor() or platform.machine()
    header = (
        f"## Generation speed, {time.strftime('%Y-%m-%d')}, {ckpt.name}\n\n"
        f"`python bench/generate.py --ckpt {args.ckpt} --tokens {args.tokens} --batches {' '.join(map(str, args.batches))}`; "
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {threads} threads, fp32; prompt "
        f"{prompt_len} tokens, {n} generated, greedy, best of {args.repeats}.\n"
    )
    text = (
        header
        + "\n"
        + speed_table(contenders, args.batches, prompt_len, n)
        + ("\n\n" + compile_note if compile_note else "")
        + "\n\n"
        + cache_table(model.cfg, args.cache_tokens, prompt_len, args.repeats)
        + "\n"
    )
    print(text)
    if args.append:
        with (REPO / "docs" / "benchmarks.md").open("a") as docs:
            docs.write("\n" + text)


if __name__ == "__main__":
    main()
