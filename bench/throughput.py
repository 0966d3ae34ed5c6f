#!/usr/bin/env python
"""Training throughput of the suite's real step against plain transformers, on the same shapes.

    python bench/throughput.py                      # what `make bench` runs
    python bench/throughput.py --quick              # a smoke run (gpt-tiny, 1 rep, 1 step)
    python bench/throughput.py --shapes llama-12x768 --precision bf16 --compile llama-12x768

For every shape and precision, each contender trains the same model shape on the same random token
batches (same batch, micro-batches, sequence length, AdamW hyperparameters, clipping, precision):

- `suite`: `build_model` on meta -> `parallelize` (world 1) -> `materialize` -> `build_optimizer`, and
  each step is `Trainer.train_step` itself (lr, `ParallelModel.forward_backward` with the trainer's
  loss, unscale, `clip_grad_norm`, optimizer step, zero_grad).
- `hf`: transformers' `GPT2LMHeadModel` / `LlamaForCausalLM` with `torch.optim.AdamW(foreach=True)`
  and a plain loop (autocast forward, fp32 cross-entropy as transformers' own loss does, backward,
  `clip_grad_norm_`, step, zero_grad).
- `+compile` variants (`--compile SHAPES`): `train.compile=true` for the suite (each block compiled),
  `torch.compile(model)` for transformers. Compile time is reported apart from throughput.

Every (contender, repetition) runs in a fresh subprocess, so peak memory (`ru_maxrss` above the
process's own high-water mark after imports) is not contaminated by the other contender, and the
contenders alternate within each repetition (order reversed every other repetition) so slow drift
of the machine hits all of them alike. Each run warms up 2 steps, then times `--steps` steps; the
table reports medians over `--reps` repetitions. MFU = tokens/s * (6*params + 12*layers*seq*width)
/ the matmul ceiling that this script measures on the same machine and precision (best of square
matmuls of several sizes, before and after the runs). The table is printed last and appended to
docs/benchmarks.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT_TAG = "BENCH_RESULT "
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))


# ---- shapes -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A suite recipe plus overrides; the transformers model is derived from the composed config."""

    recipe: str
    overrides: tuple[str, ...] = ()
    steps: int = 4  # timed steps per run (default; --steps overrides)
    note: str = ""


SHAPES: dict[str, Shape] = {
    # Exactly the CPU default recipe: 4x256, 4 heads, vocab 8192, seq 256, micro 8 x 2 accumulation.
    "gpt-tiny": Shape("gpt-tiny", steps=6, note="recipe gpt-tiny as shipped"),
    # GPT-2 small-like: ~110M parameters (tied head), GELU 3072.
    "gpt-12x768": Shape(
        "gpt-tiny",
        (
            "model.name=gpt-12x768", "model.num_layers=12", "model.hidden_size=768", "model.num_heads=12",
            "model.vocab_size=32000", "model.max_seq_len=512", "data.seq_len=512",
            "parallel.micro_batch_size=4", "parallel.global_batch_size=4",
        ),
        steps=2,
    ),
    # Llama-family: ~134M parameters, SwiGLU 2048, untied head, no GQA.
    "llama-12x768": Shape(
        "llama-tiny",
        (
            "model.name=llama-12x768", "model.num_layers=12", "model.hidden_size=768", "model.num_heads=12",
            "model.num_kv_heads=12", "model.ffn_hidden_size=2048", "model.vocab_size=32000",
            "model.max_seq_len=512", "model.tie_embeddings=false", "data.seq_len=512",
            "parallel.micro_batch_size=4", "parallel.global_batch_size=4",
        ),
        steps=2,
    ),
}
DEFAULT_SHAPES = ("gpt-tiny", "gpt-12x768")
WARMUP = 2


def suite_config(shape: str, precision: str, compile_: bool):
    """The composed, validated suite config of a shape (the source of truth for both contenders)."""
    from suite.config.compose import compose_config, to_object
    from suite.config.validate import validate

    spec = SHAPES[shape]
    overrides = [f"recipe={spec.recipe}", *spec.overrides, f"train.precision={precision}",
                 f"train.compile={str(compile_).lower()}", "train.device=cpu"]
    cfg = to_object(compose_config(overrides))
    dims = validate(cfg, needs_data=False)
    return cfg, dims


# ---- the contenders (run inside a worker subprocess) --------------------------------------------
def build_suite_step(cfg, dims):
    """The suite's step exactly as `Trainer` builds and runs it, minus data, logging and checkpoints.

    A bare Trainer gets the attributes `Trainer.__init__` gives it (same calls, same order), so the
    step timed is `Trainer.train_step` itself; keep this in step with `Trainer.__init__`.
    """
    from contextlib import nullcontext

    import torch

    from suite.models import build_model, materialize
    from suite.parallel.parallelize import parallelize
    from suite.train.optim import build_optimizer
    from suite.train.trainer import AUTOCAST_DTYPES, Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.dims = cfg, dims
    trainer.device = torch.device("cpu")
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, "meta")
    trainer.parallel = parallelize(model, cfg, dims, trainer.device)
    trainer.model = trainer.parallel.model
    if trainer.parallel.materialized is False:
        materialize(trainer.model, trainer.device, cfg.train.seed)
    trainer.optimizer = build_optimizer(trainer.model, cfg.optim, trainer.device)
    trainer.scaler = torch.amp.GradScaler(trainer.device.type, enabled=cfg.train.precision == "fp16")
    dtype = AUTOCAST_DTYPES.get(cfg.train.precision)
    trainer.autocast = (
        (lambda: torch.autocast(trainer.device.type, dtype=dtype)) if dtype is not None else nullcontext
    )
    trainer.step = 0

    def step(micro_batches):
        loss, _ = trainer.train_step(micro_batches)
        trainer.step += 1
        return loss

    return step, trainer.model


def hf_model(cfg):
    """transformers' own class for the shape, with the same sizes, no dropout, SDPA attention."""
    m = cfg.model
    if m.family == "gpt":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=m.vocab_size, n_positions=m.max_seq_len, n_embd=m.hidden_size, n_layer=m.num_layers,
            n_head=m.num_heads, n_inner=m.ffn_hidden_size, activation_function="gelu_new",
            resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout, layer_norm_epsilon=m.norm_eps,
            initializer_range=m.init_std, tie_word_embeddings=m.tie_embeddings, use_cache=False,
        )
        config._attn_implementation = "sdpa"
        return GPT2LMHeadModel(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    from suite.models.transformer import ffn_size

    config = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=ffn_size(m),
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads or m.num_heads, max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, attention_bias=m.qkv_bias, mlp_bias=False,
        attention_dropout=m.dropout, initializer_range=m.init_std, tie_word_embeddings=m.tie_embeddings,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def build_hf_step(cfg, compile_: bool):
    """What a user would write with transformers: AdamW(foreach), autocast, clip, step."""
    from contextlib import nullcontext

    import torch
    import torch.nn.functional as F

    torch.manual_seed(cfg.train.seed)
    model = hf_model(cfg).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True,
    )
    forward = torch.compile(model) if compile_ else model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else nullcontext
    vocab = cfg.model.vocab_size

    def step(micro_batches):
        total = torch.zeros(())
        for batch in micro_batches:
            with autocast():
                logits = forward(input_ids=batch[:, :-1], use_cache=False).logits
                # transformers' ForCausalLMLoss: logits.float(), mean cross-entropy over the tokens.
                loss = F.cross_entropy(logits.float().view(-1, vocab), batch[:, 1:].reshape(-1))
                loss = loss / len(micro_batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step, model


def max_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_worker(spec: dict) -> dict:
    import torch

    import transformers  # noqa: F401  (both contenders import the same modules before the baseline)
    from suite.models import flops_per_token
    from suite.train import trainer as _trainer  # noqa: F401

    cfg, dims = suite_config(spec["shape"], spec["precision"], spec["compile"])
    seq, micro = cfg.data.seq_len, cfg.parallel.micro_batch_size
    accumulation = dims.accumulation(cfg.parallel)
    total_steps = WARMUP + spec["steps"]
    gen = torch.Generator().manual_seed(spec["seed"])
    batches = [
        [torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=gen) for _ in range(accumulation)]
        for _ in range(total_steps)
    ]
    base_gb = max_rss_gb()
    t0 = time.perf_counter()
    if spec["contender"] == "suite":
        step, model = build_suite_step(cfg, dims)
    else:
        step, model = build_hf_step(cfg, spec["compile"])
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    times, losses = [], []
    for batch in batches:
        start = time.perf_counter()
        loss = step(batch)
        losses.append(float(loss))  # a sync on GPU; on CPU the step is already done
        times.append(time.perf_counter() - start)
    timed = times[WARMUP:]
    tokens = micro * accumulation * seq
    return {
        **spec,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens * len(timed) / sum(timed),
        "step_s": timed,
        "warmup_s": times[:WARMUP],
        "build_s": build_s,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "params": n_params,
        "flops_per_token": flops_per_token(cfg.model, seq),
        "peak_rss_gb": max_rss_gb(),
        "base_rss_gb": base_gb,
        "threads": torch.get_num_threads(),
        "seq": seq,
        "batch": micro * accumulation,
        "micro": micro,
    }


# ---- the parent: ceilings, interleaved runs, table ---------------------------------------------
def matmul_ceiling(precision: str) -> float:
    """Best square-matmul FLOP/s over a few sizes (the CPU's best size differs by dtype)."""
    import torch

    from suite.train.flops import measure_matmul_peak

    device = torch.device("cpu")
    return max(measure_matmul_peak(device, precision, size, seconds=0.75) for size in (512, 1024, 2048))


@dataclass
class Cell:
    runs: list[dict] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.runs)

    @property
    def mem_gb(self) -> float:
        return statistics.median(r["peak_rss_gb"] - r["base_rss_gb"] for r in self.runs)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    except (OSError, StopIteration):
        isa = []
    return (
        f"{cpu} ({', '.join(isa) or 'no AVX info'}), {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}, {platform.system()}"
    )


def contenders(shape: str, compile_shapes: set[str]) -> list[tuple[str, bool]]:
    out = [("suite", False), ("hf", False)]
    if shape in compile_shapes:
        out += [("suite", True), ("hf", True)]
    return out


def label(contender: str, compile_: bool) -> str:
    name = "suite" if contender == "suite" else "transformers"
    return name + (" +compile" if compile_ else "")


def run_one(spec: dict, timeout: float) -> dict | None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"  ! timed out after {timeout:.0f}s: {spec}", flush=True)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = "\n    ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
    print(f"  ! worker failed (rc {proc.returncode}): {spec}\n    {tail}", flush=True)
    return None


def fmt_table(cells: dict, ceilings: dict, shapes, precisions, compile_shapes) -> str:
    head = (
        "| shape | precision | contender | tokens/s | range | vs transformers | MFU | peak mem (GB) | "
        "s/step | compile s |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [head]
    for shape in shapes:
        for precision in precisions:
            base = {}
            for contender, compile_ in contenders(shape, compile_shapes):
                cell = cells.get((shape, precision, contender, compile_))
                if cell and cell.runs:
                    base[(contender, compile_)] = cell.median("tokens_per_s")
            for contender, compile_ in contenders(shape, compile_shapes):
                cell = cells.get((shape, precision, contender, compile_))
                if not cell or not cell.runs:
                    rows.append(f"| {shape} | {precision} | {label(contender, compile_)} | failed | | | | | | |")
                    continue
                tps = cell.median("tokens_per_s")
                lo = min(r["tokens_per_s"] for r in cell.runs)
                hi = max(r["tokens_per_s"] for r in cell.runs)
                peer = base.get(("hf", compile_))
                ratio = f"{tps / peer:.2f}x" if contender == "suite" and peer else ""
                if contender == "suite" and compile_ and ("hf", False) in base:
                    ratio += f" ({tps / base[('hf', False)]:.2f}x eager)"
                mfu = tps * cell.runs[0]["flops_per_token"] / ceilings[precision]
                step_s = statistics.median(statistics.median(r["step_s"]) for r in cell.runs)
                compile_s = (
                    f"{statistics.median(r['warmup_s'][0] - statistics.median(r['step_s']) for r in cell.runs):.0f}"
                    if compile_ else ""
                )
                rows.append(
                    f"| {shape} | {precision} | {label(contender, compile_)} | {tps:,.0f} | {lo:,.0f}-{hi:,.0f} | "
                    f"{ratio} | {mfu:.1%} | {cell.mem_gb:.2f} | {step_s:.2f} | {compile_s} |"
                )
    return "\n".join(rows)


def append_docs(out: Path, text: str) -> None:
    intro = """# Benchmarks

Training throughput of the suite on the machine at hand, measured side by side with what a user would
otherwise run: plain transformers (`GPT2LMHeadModel` / `LlamaForCausalLM`) with `torch.optim.AdamW` and a
plain loop, on the same shapes, batch, sequence length, precision, optimizer settings and random token
batches. The suite side is its real training step: `build_model` on meta, `parallelize`, `materialize`,
`build_optimizer`, then `Trainer.train_step` (lr, `ParallelModel.forward_backward` with the trainer's loss,
unscale, `clip_grad_norm`, optimizer step, zero_grad).

- **tokens/s**: median over repetitions (each a fresh process, contenders alternating) of the tokens of the
  timed steps over their wall time, after 2 warm-up steps; **range** is the min-max over repetitions.
- **MFU**: tokens/s x (6 x params + 12 x layers x seq x width) / the matmul ceiling, a square matmul in the
  same precision measured by the harness on the same machine (best of several sizes, before and after).
- **peak mem**: the process's peak resident set (`ru_maxrss`) minus its high-water mark after imports,
  i.e. what building the model and training it added; each contender runs in its own process.
- **compile s**: first warm-up step minus a steady step (torch.compile variants only).

Reproduce with `make bench` (`python bench/throughput.py`; `--help` lists the options: `--shapes`,
`--precision`, `--reps`, `--steps`, `--compile`, `--quick`). Each run appends a section below. On a shared or
busy machine the absolute numbers move; the ratios, measured interleaved, are the more stable figure.
"""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(intro)
    with out.open("a") as f:
        f.write("\n" + text.rstrip() + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"comma-separated, from: {', '.join(SHAPES)} (default: %(default)s)")
    parser.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16 (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per contender (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per run, after 2 warm-up steps (default: per shape, "
                        + ", ".join(f"{k} {v.steps}" for k, v in SHAPES.items()) + ")")
    parser.add_argument("--compile", default="gpt-tiny",
                        help="shapes that also run the torch.compile variants, comma-separated, 'all' or "
                        "'none' (default: %(default)s; the 12x768 shapes compile for minutes on a small CPU)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown file to append to")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--quick", action="store_true", help="smoke run: gpt-tiny, fp32, 1 rep, 1 step, no compile")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per worker run (default: %(default)s)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(RESULT_TAG + json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return 0

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    compile_shapes = set(SHAPES) if args.compile == "all" else (
        set() if args.compile == "none" else {s.strip() for s in args.compile.split(",")}
    )
    reps = args.reps
    if args.quick:
        shapes, precisions, reps, compile_shapes = ["gpt-tiny"], ["fp32"], 1, set()
        args.steps = 1
    for shape in shapes:
        if shape not in SHAPES:
            parser.error(f"--shapes: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    for precision in precisions:
        if precision not in ("fp32", "bf16"):
            parser.error(f"--precision: {precision!r} is not one of fp32, bf16")
    if reps < 1:
        parser.error("--reps must be at least 1")

    started = time.perf_counter()
    ceilings = {p: matmul_ceiling(p) for p in precisions}
    print("matmul ceiling: " + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s" for p, v in ceilings.items()), flush=True)

    plan = []
    for shape in shapes:
        steps = args.steps or SHAPES[shape].steps
        for precision in precisions:
            order = contenders(shape, compile_shapes)
            for rep in range(reps):
                for contender, compile_ in order if rep % 2 == 0 else order[::-1]:
                    plan.append({"shape": shape, "precision": precision, "contender": contender,
                                 "compile": compile_, "steps": steps, "rep": rep, "seed": 1000 + rep})
    cells: dict[tuple, Cell] = {}
    for i, spec in enumerate(plan, 1):
        t0 = time.perf_counter()
        result = run_one(spec, args.timeout)
        key = (spec["shape"], spec["precision"], spec["contender"], spec["compile"])
        cells.setdefault(key, Cell())
        if result is None:
            continue
        cells[key].runs.append(result)
        print(
            f"[{i}/{len(plan)}] {spec['shape']} {spec['precision']} {label(spec['contender'], spec['compile'])} "
            f"rep {spec['rep'] + 1}: {result['tokens_per_s']:,.0f} tokens/s "
            f"({statistics.median(result['step_s']):.2f} s/step, loss {result['first_loss']:.2f}, "
            f"+{result['peak_rss_gb'] - result['base_rss_gb']:.2f} GB, {time.perf_counter() - t0:.0f} s "
            f"in all, {time.perf_counter() - started:.0f} s elapsed)",
            flush=True,
        )
    for p in precisions:  # the ceiling again after the runs: keep the best (a busy moment lowers it)
        ceilings[p] = max(ceilings[p], matmul_ceiling(p))

    table = fmt_table(cells, ceilings, shapes, precisions, compile_shapes)
    any_run = next((c.runs[0] for c in cells.values() if c.runs), None)
    details = []
    for shape in shapes:
        cell = next((c for k, c in cells.items() if k[0] == shape and c.runs), None)
        if cell:
            r = cell.runs[0]
            suite_params = next((c.runs[0]["params"] for k, c in cells.items()
                                 if k[0] == shape and k[2] == "suite" and c.runs), None)
            hf_params = next((c.runs[0]["params"] for k, c in cells.items()
                              if k[0] == shape and k[2] == "hf" and c.runs), None)
            overrides = " ".join(SHAPES[shape].overrides)
            details.append(
                f"- `{shape}`: `recipe={SHAPES[shape].recipe}{' ' + overrides if overrides else ''}`; "
                f"batch {r['batch']} (micro {r['micro']}) x seq {r['seq']} = {r['tokens_per_step']} tokens/step, "
                f"{r['flops_per_token'] / 1e6:.0f} MFLOP/token; parameters (stored) suite "
                f"{(suite_params or 0) / 1e6:.1f}M, transformers {(hf_params or 0) / 1e6:.1f}M; "
                f"{len(cell.runs[0]['step_s'])} timed steps per run"
            )
    load = os.getloadavg()
    section = "\n".join([
        f"## {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        f"- machine: {machine()}; load average at the end {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}",
        "- matmul ceiling: " + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s" for p, v in ceilings.items()),
        f"- settings: {reps} repetitions (median), {WARMUP} warm-up steps, AdamW foreach, grad clip "
        f"{1.0 if any_run is None else 'as the recipe'}, same random token batches; "
        f"`python bench/throughput.py {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip() + "; "
        f"{time.perf_counter() - started:.0f} s in all",
        *details,
        "",
        table,
    ])
    if not args.no_write and not args.quick:
        append_docs(Path(args.out), section)
        print(f"appended to {args.out}", flush=True)
    print()
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
