#!/usr/bin/env python
"""`suite prepare` throughput and peak memory against the tokenizer's own `encode_batch` (issue 40).

    python bench/prepare.py                          # 0.1 and 1 GB of generated JSON lines, 1 and 2 workers
    python bench/prepare.py --sizes 0.1 1 4 --workers 1 2 --dir /tmp/prepare-bench

Generated text: documents of 1-6 KB drawn from a fixed word list by a seeded generator (the same bytes
every run). One byte-level BPE tokenizer (vocab 8192) is trained once on the first 20 MB and given to
every run (`data.tokenizer`), so the runs time streaming, parsing, tokenizing and writing only.
The ceiling is `Tokenizer.encode_batch` single-threaded (TOKENIZERS_PARALLELISM=false) over the same
documents in one process, 1 MB batches, only the encode calls timed: what one core can do at best.
Each `suite prepare` is a fresh process; its peak memory is the largest sum of RSS over it and its
children (the workers), sampled every 0.1 s; its CPU seconds (all processes) are recorded beside the
wall time, since on a shared machine wall-clock ratios measure the other users too. The ceiling is
measured once per corpus and kept in --dir (`--workers` with no numbers measures only that), so the
points can be run one at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "data",
    "token",
    "training",
    "loss",
    "gradient",
    "layer",
    "attention",
    "memory",
    "shard",
    "worker",
    "process",
    "python",
    "tensor",
    "0",
    "1",
    "2",
    "3",
    "42",
    "1984",
]
REPO = Path(__file__).resolve().parents[1]


def generate(path: Path, gigabytes: float) -> Path:
    """Seeded JSON lines of about `gigabytes` of text (kept between runs)."""
    if path.is_file():
        return path
    target, rng, size = int(gigabytes * 1e9), random.Random(0), 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        while size < target:
            text = " ".join(rng.choices(WORDS, k=rng.randint(200, 1200)))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)
    tmp.rename(path)
    return path


def tokenizer(folder: Path, corpus: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from suite.data.tokenizer import train_tokenizer

    if not (folder / "tokenizer.json").is_file():
        with open(corpus) as f:
            texts, size = [], 0
            for line in f:
                texts.append(json.loads(line)["text"])
                size += len(texts[-1])
                if size > 20e6:
                    break
        train_tokenizer(texts, 8192, folder)
    return folder / "tokenizer.json"


CEILING = """
import json, os, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
spent = cpu = size = 0
batch, batch_size = [], 0
def run(batch):
    global spent, cpu
    start, start_cpu = time.perf_counter(), time.process_time()
    encode(batch, add_special_tokens=False)
    spent += time.perf_counter() - start
    cpu += time.process_time() - start_cpu
with open(sys.argv[2]) as f:
    for line in f:
        text = json.loads(line)["text"]
        batch.append(text); batch_size += len(text); size += len(text)
        if batch_size >= 1_000_000:
            run(batch); batch, batch_size = [], 0
if batch:
    run(batch)
print(json.dumps({"mb": size / 1e6, "seconds": spent, "cpu": cpu}))
"""


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs: what a run cost
    in CPU whatever else shares the cores."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ceiling(tok: Path, corpus: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CEILING, str(tok), str(corpus)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def run_prepare(corpus: Path, tok: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable, "-m", "suite", "prepare", f"data.path={out}", f"data.tokenizer={tok}",
        f"data.sources=[{{path: '{corpus}'}}]", f"data.workers={workers}", "data.val_fraction=0.001",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start, start_cpu = time.perf_counter(), children_cpu()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watched, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(watched))
        time.sleep(0.1)
    seconds, cpu = time.perf_counter() - start, children_cpu() - start_cpu
    if proc.returncode:
        raise SystemExit(proc.stderr.read().decode()[-2000:])
    meta = json.loads((out / "meta.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "peak_rss_mb": peak / 2**20,
        "tokens": meta["num_train_tokens"] + meta["num_val_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])  # none: the ceiling only
    parser.add_argument("--dir", type=Path, default=Path("/tmp/prepare-bench"))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start", flush=True)
    for gb in args.sizes:
        corpus = generate(args.dir / f"corpus-{gb:g}gb.jsonl", gb)
        mb = corpus.stat().st_size / 1e6
        tok = tokenizer(
            args.dir / "tokenizer", generate(args.dir / f"corpus-{args.sizes[0]:g}gb.jsonl", args.sizes[0])
        )
        saved = args.dir / f"ceiling-{gb:g}gb.json"  # measured once per corpus: reruns time prepare only
        if not saved.is_file():
            saved.write_text(json.dumps(ceiling(tok, corpus)))
        ceil = json.loads(saved.read_text())
        ceil_rate, ceil_cpu_rate = ceil["mb"] / ceil["seconds"], ceil["mb"] / ceil["cpu"]
        print(
            f"{gb:g} GB ({mb:,.0f} MB of JSON lines): encode_batch ceiling {ceil_rate:.2f} MB/s of text "
            f"({ceil_cpu_rate:.2f} MB per CPU second), 1 core",
            flush=True,
        )
        for workers in args.workers:
            r = run_prepare(corpus, tok, args.dir / "out", workers)
            rate = ceil["mb"] / r["seconds"]
            row = {
                "gb": gb,
                "workers": workers,
                **r,
                "text_mb_s": rate,
                "of_ceiling": rate / (ceil_rate * workers),
                # CPU the ceiling spends per MB over CPU prepare spends per MB, all processes: the
                # share of the cores' work that is tokenizing, whatever else shares the machine
                "cpu_efficiency": ceil["cpu"] / r["cpu_seconds"],
                "load": os.getloadavg()[0],
            }
            rows.append(row)
            print(
                f"  workers={workers}: {r['seconds']:.1f} s, {rate:.2f} MB/s of text, {r['tokens'] / r['seconds']:,.0f} "
                f"tokens/s, {row['of_ceiling']:.0%} of {workers} x ceiling, peak RSS {r['peak_rss_mb']:,.0f} MB; "
                f"{r['cpu_seconds']:.0f} CPU s ({row['cpu_efficiency']:.0%} of the ceiling's CPU per MB), "
                f"load {row['load']:.2f}",
                flush=True,
            )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
