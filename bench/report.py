"""bench/throughput.py's output: the table (one row per contender, with what it ran), the machine line,
and the docs/benchmarks.md section it appends."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

SECTION_PREFIX = "## Throughput, "  # each run's section in docs/benchmarks.md


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    except (OSError, StopIteration):
        isa = []
    return (
        f"{cpu} ({', '.join(isa) or 'no AVX info'}), {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}, {platform.system()}"
    )


def label(contender: str, variant: str) -> str:
    if contender == "suite":
        return "suite" + (f" [{variant}]" if variant else "")
    return "transformers" + {"compiled": " +compile", "kept": " +kept host memory"}.get(variant, "")


def setup_text(info: dict) -> str:
    """The "setup" column: optimizer; weights; compute dtype; attention kernel."""
    if "optimizer" not in info:
        return ""
    return f"{info['optimizer']}; {info['weights']} weights; {info['compute']} compute; {info['attention']} attention"


def mfu(w, ceilings: dict) -> float:
    """Median tokens/s x matmul FLOPs/token (the one formula for every contender) / the ceiling."""
    return w.median("tokens_per_s") * w.info["flops_per_token"] / ceilings[w.spec["precision"]]


def fmt_table(workers: dict, ceilings: dict) -> str:
    """One row per contender; suite rows compare with transformers eager and, where run, compiled."""
    rows = [
        "| shape | precision | contender | setup | tokens/s | range | suite / transformers | MFU | peak mem GB | "
        "s/step | CPU share | compile s |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (shape, precision, contender, variant), w in workers.items():
        name = label(contender, variant)
        if not w.windows:
            rows.append(
                f"| {shape} | {precision} | {name} | {setup_text(w.info)} | failed: {w.failed} |" + " |" * 7
            )
            continue
        tps = w.median("tokens_per_s")
        lo, hi = min(x["tokens_per_s"] for x in w.windows), max(x["tokens_per_s"] for x in w.windows)
        ratio = ""
        if contender == "suite":
            parts = []
            for peer_name in ("eager", "compiled", "kept"):
                peer = workers.get((shape, precision, "hf", peer_name))
                if peer and peer.windows:
                    parts.append(f"{tps / peer.median('tokens_per_s'):.2f}x {peer_name}")
            ratio = " / ".join(parts)
        step_s = statistics.median(s for x in w.windows for s in x["step_s"])
        compile_s = f"{w.info['warmup_s'][0] - step_s:.0f}" if w.info.get("compiled") else "eager"
        mem = f"{w.mem_gb:.2f}" if w.mem_gb is not None else "?"
        share = f"{w.median('cpu_share'):.0%}" + (f" ({w.discarded} retimed)" if w.discarded else "")
        rows.append(
            f"| {shape} | {precision} | {name} | {setup_text(w.info)} | {tps:,.0f} | {lo:,.0f}-{hi:,.0f} | {ratio} "
            f"| {mfu(w, ceilings):.1%} | {mem} | "
            f"{step_s:.2f} | {share} | {compile_s} |"
        )
    return "\n".join(rows)


def append_docs(out: Path, text: str) -> None:
    intro = """# Benchmarks

Training throughput of the suite on the machine at hand, measured side by side with what a user would
otherwise run: plain transformers (`GPT2LMHeadModel` / `LlamaForCausalLM`, sdpa attention) with the fastest
AdamW torch has, `torch.optim.AdamW(fused=True)`, and a plain loop, on the same shapes, batch, sequence length,
precision scheme (fp32 weights; in bf16 an autocast forward), optimizer settings and random token batches.
The suite side is its real training step, built as the trainer builds it (`standalone_step`: `build_model`
on meta, `parallelize`, `materialize`, `optimizer_for`, `build_step`), each step the trainer's own
`TrainStep` (lr, forward/backward with the trainer's loss, unscale, `clip_grad_norm`, optimizer step,
zero_grad), with the recipe as it is. Its bf16-parameter mode
(`train.param_dtype=bf16`: bf16 weights and gradients, fp32 masters) is another precision scheme: in bf16 it
is a row of its own, `suite [bf16 params]`. The **setup** column of every row says what it ran: optimizer,
weights, compute dtype, attention kernel.

- **tokens/s**: median over repetitions of the tokens of the timed steps over their wall time. Each contender
  runs in its own process, builds its model and warms up 2 steps alone, then the contenders take turns: every
  repetition times each of them once, in alternating order. **range** is the min-max over repetitions.
- **MFU**: tokens/s x matmul FLOPs per token (`suite.models.flops_per_token`, the same function for every
  contender: projections, MLP or routed experts, output head, causal attention at half; no embedding lookup)
  / the matmul ceiling, a square matmul in the same precision measured by the harness on the same machine
  (best of several sizes, before and after).
- **peak mem**: the process's peak resident set (`ru_maxrss`) minus its high-water mark after imports,
  i.e. what building the model and training it added; each contender runs in its own process.
- **suite / transformers**: the suite row's median tokens/s over transformers' eager (and, where run, compiled) one,
  and over `transformers +kept host memory`: transformers eager in a process that made the glibc malloc
  setting the suite's trainer makes on CPU (`train.keep_host_memory`, docs/performance.md), which shows how
  much of the lead is that setting and how much the step itself.
- **CPU share**: median CPU time the contender's process got during its timed steps over wall time x threads.
  A repetition below `--min-share` (85%) means other processes on the machine took cores: it is timed again
  (up to `--retries` times; "N retimed" counts them) and kept as it is after that, so a share well below
  ~95% marks a row whose tokens/s understates the contender.
- **compile s**: first warm-up step minus a steady step (torch.compile variants only).

Reproduce with `make bench` (`python bench/throughput.py`; `--help` lists the options: `--shapes`,
`--precision`, `--reps`, `--steps`, `--compile`, `--quiet-wait`, `--min-share`, `--retries`, `--quick`). Each
run appends a section below. On a shared or busy machine the absolute numbers move; the ratios, measured
interleaved, are the more stable figure, and `--quiet-wait 120` times only when the CPUs are otherwise idle.
"""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(intro)
    doc = out.read_text()
    # Keep the throughput runs together, right after the intro and the earlier runs, before the
    # sections of other benchmarks that share the file.
    runs = [i for i in range(len(doc)) if doc.startswith("\n" + SECTION_PREFIX, i)]
    following = doc.find("\n## ", runs[-1] + 1 if runs else 0)
    cut = following if following != -1 else len(doc)
    out.write_text(doc[:cut].rstrip() + "\n\n" + text.rstrip() + "\n" + doc[cut:])
