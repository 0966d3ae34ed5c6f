"""Generation speed: `suite generate`'s decoder against transformers' `generate` and onnxruntime, one run.

    python bench/generate.py                               # runs/gpt-tiny (made first when missing)
    python bench/generate.py --ckpt runs/llama-tiny --tokens 200 --batches 1 8 --repeats 5
    python bench/generate.py --append                      # also append the tables to docs/benchmarks.md
    python bench/generate.py --ckpt gguf:SmolLM2-135M-Instruct.Q4_1.gguf --tokens 128 --no-onnx --no-compile \
        --dtypes fp32 bf16 fp16 --llama-cpp --no-cache-table    # a real model beside llama.cpp

What it runs, all greedy, same prompts, same process, interleaved (best of --repeats):
  suite         the suite model with the static-cache batch decoder (what `suite generate` runs)
  suite+compile the same with generate.compile=true (torch.compile of the decode step; compiled once
                before timing, its compile time reported apart)
  transformers  AutoModelForCausalLM.from_pretrained(<suite export format=hf>).generate(use_cache=True)
  ort fp32/int8/int4  the `suite export format=onnx [export.quantize=...]` graphs in onnxruntime (not
                with --no-onnx)
  suite bf16/fp16  --dtypes: the same decoder with generate.dtype=bf16|fp16 (reported, not checked)
  llama.cpp f16/q8_0/q4_0  --llama-cpp: llama-cpp-python on the suite's own `suite export format=gguf
                export.quantize=...` files, one sequence id per prompt, greedy (argmax of its logits)
Every row also gives the bytes of weights a decode step reads and the bound they set at the memory
bandwidth measured in the same run (the best of 5 sums of a 1 GiB tensor), and the header the suite's
per-step dispatch overhead (its eager decoder on the same architecture with tiny widths).
Prefill tokens/s = batch x prompt length / time to the first token; decode tokens/s = batch x (N - 1)
/ (time for N tokens - time to the first token). Every fp32 contender must produce the same greedy tokens
as the suite; the others report how many of the suite's fp32 tokens they match.

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
from generate_llama import (
    GGUF_QUANTS,
    LlamaCpp,
    dispatch_overhead,
    gguf_bytes_per_token,
    matmul_time,
    read_bandwidth,
    suite_bytes_per_token,
)

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

    def __init__(self, name: str, first, full, precision: str = "fp32", nbytes: int = 0, exact: bool = True):
        """precision: of its weights; nbytes: of weights read per decode step; exact: must match the
        suite's fp32 greedy tokens."""
        self.name, self.first, self.full = name, first, full
        self.precision, self.nbytes, self.exact = precision, nbytes, exact
        self.best: dict[int, tuple[float, float]] = {}
        self.same: dict[int, str] = {}  # batch -> "k/n" tokens equal to the suite fp32 ones

    def measure(self, batch: int) -> None:
        t1 = timed(lambda: self.first(batch))
        tn = timed(lambda: self.full(batch))
        old = self.best.get(batch)
        if old is None:
            self.best[batch] = (t1, tn)
        else:
            self.best[batch] = (min(old[0], t1), min(old[1], tn))


def suite_contender(name, engine, prompts, n, **kw):
    from suite.infer.engines import ModelEngine

    pick = lambda logits: logits.argmax(-1, keepdim=True)  # noqa: E731

    def run(batch, tokens):
        return torch.stack(list(engine.steps(prompts[:batch], tokens, pick)), 1)

    contender = Contender(name, lambda b: run(b, 1), lambda b: run(b, n), **kw)
    if isinstance(engine, ModelEngine):
        contender.engine = engine  # for the matmul timing
    return contender


def llama_cpp_contender(quant: str, path: Path, prompts, n, threads: int):
    llama = LlamaCpp(path, threads, len(prompts), len(prompts[0]) + n)

    def run(batch, tokens):
        return llama.generate(prompts[:batch], tokens)

    precision = quant.upper()
    return Contender(
        f"llama.cpp {precision}",
        lambda b: run(b, 1),
        lambda b: run(b, n),
        precision,
        gguf_bytes_per_token(path),
        False,
    )


def hf_contender(model, prompts, n, **kw):
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

    return Contender("transformers generate", lambda b: run(b, 1), lambda b: run(b, n), **kw)


def speed_table(contenders, batches, prompt_len, n, bandwidth: float) -> str:
    """One row per contender and batch; the bound: batch x bandwidth / bytes read per step."""
    rows = [
        "| contender | precision | batch | prefill tokens/s | decode tokens/s | decode vs transformers "
        "| MB read per step | bound tokens/s | of bound | greedy tokens = suite fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    hf = next(c for c in contenders if c.name == "transformers generate")
    for batch in batches:
        hf_t1, hf_tn = hf.best[batch]
        hf_decode = batch * (n - 1) / (hf_tn - hf_t1)
        for c in contenders:
            t1, tn = c.best[batch]
            decode = batch * (n - 1) / (tn - t1)
            bound = batch * bandwidth / c.nbytes if c.nbytes else float("nan")
            rows.append(
                f"| {c.name} | {c.precision} | {batch} | {batch * prompt_len / t1:,.0f} | {decode:,.1f} "
                f"| {decode / hf_decode:.2f}x | {c.nbytes / 1e6:,.1f} | {bound:,.1f} | {decode / bound:.0%} "
                f"| {c.same.get(batch, '')} |"
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


def machine() -> str:
    """The CPU's model name and whether it has AVX-512 / native bf16 (lscpu), the load average."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in info.splitlines():
            key, _, value = line.partition(":")
            model = value.strip() if key.strip() == "Model name" else model
            flags = value.split() if key.strip() == "Flags" else flags
    except OSError:
        pass
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    bf16 = ", native bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else ", no native bf16"
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{model}, {os.cpu_count()} cores, {simd}{bf16 if flags else ''}, load average {load} (1/5/15 min)"


def exports_needed(ckpt: str, out: Path, onnx: bool, llama_cpp: bool) -> dict[str, Path]:
    """Each export the contenders read, made with `suite export` unless `out` holds it already."""
    args = {"hf": []}
    if onnx:
        args |= {"onnx-fp32": ["format=onnx"]}
        args |= {f"onnx-{q}": ["format=onnx", f"export.quantize={q}"] for q in ("int8", "int4")}
    if llama_cpp:
        args |= {f"gguf-{q}": ["format=gguf", f"export.quantize={q}"] for q in GGUF_QUANTS}
    for name, extra in args.items():
        if not (out / name / "export_manifest.json").exists():
            print(f"suite export ckpt={ckpt} out={out / name} {' '.join(extra)}", file=sys.stderr)
            suite("export", f"ckpt={ckpt}", f"out={out / name}", *extra)
    return {name: out / name for name in args}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--ckpt", default=str(REPO / "runs" / "gpt-tiny"), help="a run, hf:<dir> or gguf:<file>"
    )
    parser.add_argument("--tokens", type=int, default=200, help="tokens generated per prompt (N)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-tokens", type=int, default=256)
    parser.add_argument("--no-compile", action="store_true", help="leave suite+compile out")
    parser.add_argument("--no-onnx", action="store_true", help="leave the onnxruntime contenders out")
    parser.add_argument("--no-cache-table", action="store_true", help="leave the KV-cache table out")
    parser.add_argument("--llama-cpp", action="store_true", help="llama.cpp on the suite's GGUF exports")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["fp32"],
        choices=["fp32", "bf16", "fp16"],
        help="suite decode precisions",
    )
    parser.add_argument("--out", default=None, help="folder for the exports (default: a temporary one)")
    parser.add_argument("--append", action="store_true", help="append the tables to docs/benchmarks.md")
    args = parser.parse_args()

    ckpt = args.ckpt
    if ":" not in ckpt and not Path(ckpt).exists():
        print(f"{ckpt} is missing: training it (suite pretrain run.dir={ckpt})", file=sys.stderr)
        suite("pretrain", f"run.dir={ckpt}", "log.progress=false")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-generate-"))
    exports = exports_needed(ckpt, out, not args.no_onnx, args.llama_cpp)

    from transformers import AutoModelForCausalLM

    from suite.infer.engines import GraphEngine, ModelEngine
    from suite.model_source import ModelSource
    from suite.runtime import DTYPES

    threads = torch.get_num_threads()
    model = ModelSource.parse(ckpt).load_model("cpu")
    vocab = model.cfg.vocab_size
    prompt_len, n = args.prompt_len, min(args.tokens, model.cfg.max_seq_len - args.prompt_len)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (max(args.batches), prompt_len), generator=gen).tolist()
    fp32_bytes = suite_bytes_per_token(model)

    contenders = [suite_contender("suite", ModelEngine(model), prompts, n, nbytes=fp32_bytes)]
    for dtype in (d for d in args.dtypes if d != "fp32"):
        engine = ModelEngine(model, dtype=DTYPES[dtype])
        nbytes = suite_bytes_per_token(engine.decoder.model)
        contenders.append(
            suite_contender(f"suite {dtype}", engine, prompts, n, precision=dtype, nbytes=nbytes, exact=False)
        )
    compile_note = ""
    if not args.no_compile:
        compiled = suite_contender(
            "suite + compile", ModelEngine(model, compile=True), prompts, n, nbytes=fp32_bytes
        )
        start = time.perf_counter()
        for batch in args.batches:  # compile once per batch size, before timing
            compiled.full(batch)
        compile_note = f"suite + compile: compiling the decode step for batches {args.batches} took {time.perf_counter() - start:.0f} s (not in the table)."
        contenders.append(compiled)
    hf = AutoModelForCausalLM.from_pretrained(exports["hf"]).eval()
    contenders.append(hf_contender(hf, prompts, n, nbytes=fp32_bytes))
    for name in (k for k in exports if k.startswith("onnx-")):
        engine = GraphEngine(exports[name], threads=threads)
        exact = name == "onnx-fp32"
        contenders.append(
            suite_contender(f"onnxruntime {name[5:]}", engine, prompts, n, precision=name[5:], exact=exact)
        )
    for quant in GGUF_QUANTS if args.llama_cpp else ():
        path = next(exports[f"gguf-{quant}"].glob("*.gguf"))
        contenders.append(llama_cpp_contender(quant, path, prompts, n, threads))

    reference = {b: contenders[0].full(b) for b in args.batches}
    for c in contenders:
        for b in args.batches:
            tokens = c.full(b).cpu()
            if c.exact and not torch.equal(tokens, reference[b]):
                raise SystemExit(f"{c.name} at batch {b} does not generate the suite's greedy tokens")
            c.same[b] = f"{int((tokens == reference[b]).sum())}/{reference[b].numel()}"
    bandwidth = read_bandwidth()
    for _ in range(args.repeats):
        for c in contenders:
            for b in args.batches:
                c.measure(b)
    overhead = dispatch_overhead(model.cfg, n, args.repeats)
    matmuls = [
        f"{c.precision} {matmul_time(c.engine.decoder.model, c.engine.decoder.head) * 1e3:.1f} ms"
        for c in contenders
        if hasattr(c, "engine")
    ]

    flags = " --no-compile" * args.no_compile + " --no-onnx" * args.no_onnx + " --llama-cpp" * args.llama_cpp
    flags += " --no-cache-table" * args.no_cache_table + (" --dtypes " + " ".join(args.dtypes)) * (
        args.dtypes != ["fp32"]
    )
    name = ckpt.rpartition("/")[2]
    header = (
        f"## Generation speed, {time.strftime('%Y-%m-%d %H:%M %Z')}, {name}\n\n"
        f"`python bench/generate.py --ckpt {ckpt} --tokens {args.tokens} --batches {' '.join(map(str, args.batches))}"
        f" --repeats {args.repeats}{flags}`; {machine()}; torch {torch.__version__} with {threads} threads; prompt "
        f"{prompt_len} seeded random tokens, {n} generated, greedy, best of {args.repeats}. Memory read bandwidth "
        f"measured in the run: {bandwidth / 1e9:.1f} GB/s (best of 5 sums of a 1 GiB fp32 tensor). The suite's "
        f"dispatch overhead per decode step (its eager fp32 decoder on {name}'s architecture with tiny widths, "
        f"batch 1): {overhead * 1e3:.2f} ms. The matmuls of one batch-1 step alone (every block projection "
        f"on one row, then the head, as the decoder holds the weights): {', '.join(matmuls)}.\n"
    )
    text = header + "\n" + speed_table(contenders, args.batches, prompt_len, n, bandwidth)
    text += ("\n\n" + compile_note if compile_note else "") + "\n"
    if not args.no_cache_table:
        text += "\n" + cache_table(model.cfg, args.cache_tokens, prompt_len, args.repeats) + "\n"
    print(text)
    if args.append:
        with (REPO / "docs" / "benchmarks.md").open("a") as docs:
            docs.write("\n" + text)


if __name__ == "__main__":
    main()
