#!/usr/bin/env python
"""Training throughput of the suite's real step against plain transformers, on the same shapes.

    python bench/throughput.py                      # what `make bench` runs: bf16 where the CPU has it natively (else fp32), 3 shapes, compiled peers
    python bench/throughput.py --quick              # a smoke run (gpt-tiny, 1 rep, 1 step)
    python bench/throughput.py --shapes llama-12x768 --reps 1 --suite-variant eager:train.compile=false
    python bench/throughput.py --quiet-wait 120   # on a shared machine: time only when it is idle

For every shape and precision, each contender trains the same model shape on the same random token
batches (same batch, micro-batches, sequence length, AdamW hyperparameters, clipping, precision):

- `suite`: `suite.train.trainer.standalone_step` (`build_model` on meta -> `parallelize` (world 1) ->
  `materialize` -> `optimizer_for` -> `build_step`, as the trainer builds it), and each step is that
  `TrainStep` (lr, forward/backward with the trainer's loss, unscale, `clip_grad_norm`, optimizer
  step, zero_grad), with the recipe as it is: fp32 weights
  (bf16: under autocast, the same scheme as the peer), `train.compile=auto`, `model.attention=auto`.
- `suite [bf16 params]` (bf16 only): the same with `train.param_dtype=bf16` (bf16 parameters and
  gradients, fp32 masters): a different precision scheme from the peer's, so a row of its own. Each
  `--suite-variant NAME:overrides` adds a suite row with more overrides (what a setting is worth).
- `hf`: transformers' `GPT2LMHeadModel` / `LlamaForCausalLM` with what a user would pick for speed,
  `torch.optim.AdamW(fused=True)` (fused runs on CPU as on GPU), and a plain loop (fp32 weights,
  autocast forward in bf16, fp32 cross-entropy as transformers' own loss does, backward,
  `clip_grad_norm_`, step, zero_grad); sdpa attention, transformers' default.

Every row records (table column "setup", and `--raw`) the optimizer, the weights' dtype, the compute
dtype (autocast or the weights') and the attention kernel it ran.
- `transformers +compile` (`--compile SHAPE[:PRECISION]`, default all): `torch.compile(model)`.
  Compile time (of either contender) is reported apart from throughput.
- `transformers +kept host memory` (`--peer-host-memory`, default all): transformers eager in a
  process that made the same glibc malloc setting the suite's trainer makes on the CPU
  (`train.keep_host_memory`, suite.train.host_memory). Not what a transformers user gets by default,
  so the headline ratios are over the rows above; this row shows how much of them that setting is.

Each contender runs in its own process (so its peak memory, `ru_maxrss` above the process's own
high-water mark after imports, is its alone): it builds the model and warms up 2 steps while nothing
else of ours runs, then waits. The parent hands the processes the baton in turn: each repetition
times `--steps` steps of every contender, one after the other, order reversed every other
repetition, so drift of the machine hits all contenders alike, and no process is timed while another
one of ours computes. The table reports medians over `--reps` repetitions and each contender's CPU
share during its windows: a window that got less than `--min-share` of the cores (other processes
ran) is timed again, up to `--retries` times, and `--quiet-wait S` waits for idle CPUs before each
window. MFU = tokens/s * matmul FLOPs/token (suite.models.flops_per_token, one formula for every contender:
no embedding lookup, causal attention at half) / the matmul ceiling this script measures
on the same machine and precision (best of square matmuls of several sizes, before and after the
runs). The table is printed last and appended to docs/benchmarks.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT_TAG = "BENCH_RESULT "
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from bench.baseline import ab_lines  # noqa: E402
from bench.contenders import (  # noqa: E402  (after the path fix above)
    SHAPES,
    SUITE_EXTRA_ROWS,
    WARMUP,
    build_hf_step,
    build_suite_step,
    step_setup,
    suite_config,
)
from bench.report import SECTION_PREFIX, append_docs, fmt_table, label, machine, mfu  # noqa: E402

DEFAULT_SHAPES = ("gpt-tiny", "gpt-12x768", "llama-12x768")


def max_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_worker(spec: dict) -> None:
    """One contender in its own process: build, warm up, then time `steps` steps per "run" line on stdin.

    Protocol (one JSON line each way, tagged): the worker prints READY after the warm-up, then for every
    `run <rep>` it reads it times the next window and prints its result; `stop` prints the peak memory.
    """
    import torch
    import transformers  # noqa: F401  (both contenders import the same modules before the baseline)

    from suite.models import flops_per_token
    from suite.train import trainer as _trainer  # noqa: F401

    cfg, dims = suite_config(spec["shape"], spec["precision"], spec.get("overrides", ()))
    seq, micro = cfg.data.seq_len, cfg.parallel.micro_batch_size
    accumulation = dims.accumulation(cfg.parallel)
    tokens = micro * accumulation * seq

    def batches(window: int, count: int) -> list[list[torch.Tensor]]:
        """The same random tokens for every contender: seeded by (seed, window)."""
        gen = torch.Generator().manual_seed(spec["seed"] * 1000 + window)
        return [
            [
                torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=gen)
                for _ in range(accumulation)
            ]
            for _ in range(count)
        ]

    warm = batches(0, WARMUP)
    base_gb = max_rss_gb()
    t0 = time.perf_counter()
    compiled = spec["compile"]
    if spec["contender"] == "suite":
        from suite.parallel.parallelize import compile_enabled
        from suite.runtime import resolve_precision

        cpu = torch.device("cpu")
        compiled = compile_enabled(cfg, dims, cpu, resolve_precision(cfg.train, cpu))
        step, model = build_suite_step(cfg, dims)
    else:
        if spec["variant"] == "kept":
            from suite.train.host_memory import keep_freed_host_memory

            keep_freed_host_memory()
        step, model = build_hf_step(cfg, spec["compile"])
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    warmup_s, losses = [], []
    for batch in warm:
        start = time.perf_counter()
        losses.append(float(step(batch)))  # float(): a sync on GPU; on CPU the step is already done
        warmup_s.append(time.perf_counter() - start)
    emit(
        "READY",
        {
            "build_s": build_s,
            "warmup_s": warmup_s,
            "first_loss": losses[0],
            "params": n_params,
            "flops_per_token": flops_per_token(cfg.model, seq),
            "tokens_per_step": tokens,
            "seq": seq,
            "batch": micro * accumulation,
            "micro": micro,
            "threads": torch.get_num_threads(),
            "compiled": compiled,
            "param_dtype": cfg.train.param_dtype if spec["contender"] == "suite" else "fp32",
            **step_setup(spec["contender"], cfg, model, step),
        },
    )
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "stop":
            break
        rep = int(command[1])
        window = batches(1 + rep, spec["steps"])
        cpu0, times = cpu_seconds(), []
        for batch in window:
            start = time.perf_counter()
            loss = float(step(batch))
            times.append(time.perf_counter() - start)
        # CPU time the window got over wall time x threads: well below 1 means other processes took
        # the cores during the window (its tokens/s then understates the contender).
        cpu_share = (cpu_seconds() - cpu0) / (sum(times) * torch.get_num_threads())
        emit(
            "WINDOW",
            {
                "rep": rep,
                "step_s": times,
                "tokens_per_s": tokens * len(times) / sum(times),
                "cpu_share": cpu_share,
                "loss": loss,
            },
        )
    emit("DONE", {"peak_rss_gb": max_rss_gb(), "base_rss_gb": base_gb})


def emit(tag: str, payload: dict) -> None:
    print(f"{RESULT_TAG}{tag} {json.dumps(payload)}", flush=True)


# ---- the parent: ceilings, interleaved runs, table ---------------------------------------------
def matmul_ceiling(
    precision: str, quiet_wait: float = 0.0, min_share: float = 0.0, retries: int = 0
) -> float:
    """Best square-matmul FLOP/s over a few sizes (the CPU's best size differs by dtype).

    A measurement during which this process got less than `min_share` of the cores is taken again
    (at most `retries` times): a ceiling measured on a busy machine would inflate every MFU.
    """
    import torch

    from suite.train.peak_flops import measure_matmul_peak, peak_key, record_peak

    device = torch.device("cpu")
    best = 0.0
    for size in (512, 1024, 2048):
        for attempt in range(1 + retries):
            wait_quiet(quiet_wait)
            cpu0, wall0 = cpu_seconds(), time.perf_counter()
            best = max(best, measure_matmul_peak(device, precision, (size,), seconds=0.75))
            share = (cpu_seconds() - cpu0) / ((time.perf_counter() - wall0) * torch.get_num_threads())
            if share >= min_share or attempt == retries:
                break
    record_peak(peak_key(device, precision), best)  # training runs' MFU then uses the same ceiling
    return best


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of the machine's CPU time that was busy over `seconds` (from /proc/stat; 0 elsewhere)."""

    def sample() -> tuple[int, int]:
        values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError):
        return 0.0
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(limit_s: float, threshold: float = 0.15) -> None:
    """On a shared machine: wait (at most `limit_s`) until other processes leave the CPUs idle.

    Called between timing windows, when no contender runs, so any busy time is someone else's.
    """
    if limit_s <= 0:
        return
    deadline = time.monotonic() + limit_s
    busy = busy_fraction()
    if busy <= threshold:
        return
    print(f"  (machine {busy:.0%} busy with other processes; waiting up to {limit_s:.0f} s)", flush=True)
    while busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction()


class Worker:
    """A contender's process; the parent hands it the baton one timing window at a time."""

    def __init__(self, spec: dict, timeout: float):
        self.spec, self.timeout = spec, timeout
        self.name = f"{spec['shape']} {spec['precision']} {label(spec['contender'], spec['variant'])}"
        self.info: dict = {}
        self.windows: list[dict] = []
        self.discarded = 0
        self.memory: dict = {}
        self.failed = ""
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed in stop())
        root = Path(spec.get("tree") or ROOT)  # --baseline: an earlier commit's checkout runs its own step
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(root / "bench" / "throughput.py"), "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
            cwd=root,
        )

    def _read(self, tag: str) -> dict | None:
        deadline = time.monotonic() + self.timeout
        while not self.failed:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(f"no answer in {self.timeout:.0f} s")
                break
            line = self.proc.stdout.readline()
            if not line:
                self._fail(f"exited with code {self.proc.wait()}")
                break
            if line.startswith(RESULT_TAG):
                got, _, payload = line[len(RESULT_TAG) :].partition(" ")
                if got == tag:
                    return json.loads(payload)
        return None

    def _fail(self, why: str) -> None:
        self.stderr.seek(0)
        tail = "\n    ".join(self.stderr.read().strip().splitlines()[-8:])
        self.failed = why
        print(f"  ! {self.name}: {why}\n    {tail}", flush=True)
        self.proc.kill()

    def ready(self) -> bool:
        self.info = self._read("READY") or {}
        return bool(self.info)

    def run(self, rep: int) -> dict | None:
        if self.failed:
            return None
        self.proc.stdin.write(f"run {rep}\n")
        self.proc.stdin.flush()
        window = self._read("WINDOW")
        if window:
            self.windows.append(window)
        return window

    def discard_last(self) -> None:
        """Drop the last window (timed while other processes took the cores); counted in the table."""
        self.windows.pop()
        self.discarded += 1

    def stop(self) -> None:
        if not self.failed:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
            self.memory = self._read("DONE") or {}
        self.proc.wait()
        self.stderr.close()

    # ---- summary ----
    def median(self, key: str) -> float:
        return statistics.median(w[key] for w in self.windows)

    @property
    def mem_gb(self) -> float | None:
        if not self.memory:
            return None
        return self.memory["peak_rss_gb"] - self.memory["base_rss_gb"]


def contenders(
    shape: str,
    precision: str,
    compile_for: set[str],
    variants: dict[str, tuple[str, ...]],
    host_memory_for: frozenset[str] = frozenset(),
) -> list[tuple[str, str, tuple[str, ...]]]:
    """(contender, variant, suite overrides): the suite as the recipe is, its labelled extra rows for the
    precision (bf16: bf16 parameters), each `--suite-variant`, transformers eager, transformers compiled
    where `--compile` names the shape[:precision], and transformers eager with the suite's host-memory
    setting where `--peer-host-memory` names it."""
    out = [("suite", "", ())]
    out += [("suite", name, extra) for name, extra in SUITE_EXTRA_ROWS.get(precision, {}).items()]
    out += [("suite", name, extra) for name, extra in variants.items()]
    out.append(("hf", "eager", ()))
    if {"all", shape, f"{shape}:{precision}"} & compile_for:
        out.append(("hf", "compiled", ()))
    if {"all", shape, f"{shape}:{precision}"} & host_memory_for:
        out.append(("hf", "kept", ()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes",
        default=",".join(DEFAULT_SHAPES),
        help=f"comma-separated, from: {', '.join(SHAPES)} (default: %(default)s)",
    )
    parser.add_argument(
        "--precision",
        default=None,
        help="comma-separated: fp32, bf16, or auto: bf16 where this CPU computes it natively (AVX-512 BF16 "
        "or AMX), else fp32, since emulated bf16 matmuls run ~100x slower than fp32 (default: auto; "
        "--quick: fp32)",
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="repetitions per contender (default: %(default)s)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per run, after 2 warm-up steps (default: per shape, "
        + ", ".join(f"{k} {v.steps}" for k, v in SHAPES.items())
        + ")",
    )
    parser.add_argument(
        "--compile",
        default="all",
        help="where to also run transformers with torch.compile: comma-separated SHAPE or SHAPE:PRECISION, "
        "'all' or 'none' (default: %(default)s; compiling costs about a minute per model on a 2-core CPU)",
    )
    parser.add_argument(
        "--peer-host-memory",
        default="all",
        help="where to also run transformers eager with the suite's host-memory setting (glibc malloc keeps "
        "freed memory, as `train.keep_host_memory` does): SHAPE or SHAPE:PRECISION, 'all' or 'none' "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--suite-variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="also time the suite with these overrides on top of the recipe, as a row of its own "
        "(repeatable), e.g. 'eager:train.compile=false' or 'sdpa:model.attention=sdpa'",
    )
    parser.add_argument(
        "--out", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown file to append to"
    )
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--raw", help="also write every measurement as JSON to this file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: gpt-tiny, 1 rep, 1 step, no compile, fp32 unless --precision says otherwise",
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds per worker run (default: %(default)s)"
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="on a shared machine, wait up to this many seconds before each timing window until other "
        "processes leave the CPUs idle (default: %(default)s, no waiting)",
    )
    parser.add_argument(
        "--min-share",
        type=float,
        default=0.85,
        help="a timing window (or ceiling measurement) that got less than this share of the cores, because "
        "other processes ran, is timed again (default: %(default)s)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="how many times a contended window is timed again before it is kept (default: %(default)s)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also time the suite step of this earlier commit (a temporary git worktree), interleaved with "
        "today's rows in the same run: an A/B of a change (bench/baseline.py)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run_worker(json.loads(args.worker))
        return 0

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    asked = args.precision or ("fp32" if args.quick else "auto")
    precisions = [p.strip() for p in asked.split(",") if p.strip()]
    if "auto" in precisions:
        from suite.runtime import auto_precision

        chosen = auto_precision("cpu")
        precisions = [chosen if p == "auto" else p for p in precisions]
        if chosen != "bf16":
            print(
                "--precision auto: this CPU has no native bf16 matmul (AVX-512 BF16 / AMX), so bf16 would be "
                "emulated; benchmarking fp32 (pass --precision bf16 to time the emulation anyway)",
                flush=True,
            )
    compile_for = {c.strip() for c in args.compile.split(",") if c.strip() and c.strip() != "none"}
    host_memory_for = frozenset(
        c.strip() for c in args.peer_host_memory.split(",") if c.strip() and c.strip() != "none"
    )
    variants: dict[str, tuple[str, ...]] = {}
    for text in args.suite_variant:
        name, _, overrides = text.partition(":")
        if not name or "=" not in overrides:
            parser.error(f"--suite-variant {text!r}: write NAME:KEY=VALUE[,KEY=VALUE...]")
        variants[name] = tuple(o.strip() for o in overrides.split(",") if o.strip())
    reps = args.reps
    if args.quick:
        shapes, reps, compile_for, variants = ["gpt-tiny"], 1, set(), {}
        host_memory_for = frozenset()
        args.steps = 1
    for shape in shapes:
        if shape not in SHAPES:
            parser.error(f"--shapes: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    for precision in precisions:
        if precision not in ("fp32", "bf16"):
            parser.error(f"--precision: {precision!r} is not one of fp32, bf16, auto")
    if reps < 1:
        parser.error("--reps must be at least 1")

    trees: dict[str, str] = {}
    if args.baseline:
        from bench.baseline import checkout

        commit, tree = checkout(ROOT, args.baseline)
        variants[f"@{commit}"] = ()
        trees[f"@{commit}"] = str(tree)
    started = time.perf_counter()
    quiet = args.quiet_wait
    ceilings = {p: matmul_ceiling(p, quiet, args.min_share, args.retries) for p in precisions}
    print(
        "matmul ceiling: " + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s" for p, v in ceilings.items()), flush=True
    )

    workers: dict[tuple, Worker] = {}
    for shape in shapes:
        steps = args.steps or SHAPES[shape].steps
        for precision in precisions:
            group = []
            for contender, variant, overrides in contenders(
                shape, precision, compile_for, variants, host_memory_for
            ):
                spec = {
                    "shape": shape,
                    "precision": precision,
                    "contender": contender,
                    "variant": variant,
                    "compile": variant == "compiled",  # transformers: torch.compile(model)
                    "overrides": list(overrides),  # the suite's settings
                    "steps": steps,
                    "seed": 1,
                    "tree": trees.get(variant) if contender == "suite" else None,
                }
                t0 = time.perf_counter()
                worker = Worker(spec, args.timeout)  # one at a time: build and warm-up alone on the machine
                workers[(shape, precision, contender, variant)] = worker
                if worker.ready():
                    group.append(worker)
                    info = worker.info
                    print(
                        f"[{time.perf_counter() - started:4.0f}s] {worker.name}: built in {info['build_s']:.1f} s, "
                        f"warm-up steps {', '.join(f'{x:.1f}' for x in info['warmup_s'])} s, "
                        f"first loss {info['first_loss']:.3f} ({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
            for rep in range(reps):
                for worker in group if rep % 2 == 0 else group[::-1]:
                    for attempt in range(1 + args.retries):
                        wait_quiet(quiet)
                        window = worker.run(rep)
                        if not window:
                            break
                        contended = window["cpu_share"] < args.min_share and attempt < args.retries
                        print(
                            f"[{time.perf_counter() - started:4.0f}s] {worker.name} rep {rep + 1}/{reps}: "
                            f"{window['tokens_per_s']:,.0f} tokens/s ({sum(window['step_s']):.1f} s for "
                            f"{len(window['step_s'])} steps, CPU share {window['cpu_share']:.0%})"
                            + (" - other processes took the cores: timing it again" if contended else ""),
                            flush=True,
                        )
                        if not contended:
                            break
                        worker.discard_last()
            for worker in group:
                worker.stop()
    for p in precisions:  # the ceiling again after the runs: keep the best (a busy moment lowers it)
        ceilings[p] = max(ceilings[p], matmul_ceiling(p, quiet, args.min_share, args.retries))

    table = fmt_table(workers, ceilings)
    details = []
    for shape in shapes:
        done = {k[2]: w for k, w in workers.items() if k[0] == shape and w.info}
        if not done:
            continue
        info = next(iter(done.values())).info
        params = ", ".join(f"{label(c, '')} {w.info['params'] / 1e6:.1f}M" for c, w in done.items())
        overrides = " ".join(SHAPES[shape].overrides)
        details.append(
            f"- `{shape}`: `recipe={SHAPES[shape].recipe}{' ' + overrides if overrides else ''}`; batch "
            f"{info['batch']} (micro-batches of {info['micro']}) x seq {info['seq']} = {info['tokens_per_step']} "
            f"tokens/step, {info['flops_per_token'] / 1e6:.0f} MFLOP/token; parameters stored: {params}; "
            f"{args.steps or SHAPES[shape].steps} timed steps per repetition"
        )
    load = os.getloadavg()
    command = " ".join(argv if argv is not None else sys.argv[1:])
    section = "\n".join(
        [
            f"{SECTION_PREFIX}{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}: "
            "`python bench/throughput.py" + (f" {command}`" if command else "`"),
            "",
            f"- machine: {machine()}; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
            "(1 / 5 / 15 min)",
            "- matmul ceiling (best square matmul): "
            + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s" for p, v in ceilings.items()),
            f"- {reps} repetitions (median; contenders alternate, order reversed every other repetition), "
            f"{WARMUP} warm-up steps, AdamW as the setup column says (transformers: fused; the suite: its default), grad "
            f"clip and lr from the recipe, the same random tokens for every contender; "
            f"{time.perf_counter() - started:.0f} s in all",
            "- suite settings: the recipe as is (fp32 weights; bf16: under autocast, as the peer), "
            + "".join(
                f"`[{n}]` adds `{' '.join(o)}` ({p} only); "
                for p in precisions
                for n, o in SUITE_EXTRA_ROWS.get(p, {}).items()
            )
            + "`train.compile=auto` (compile s column: `eager` where auto chose not to compile), "
            "`train.keep_host_memory=auto` (on: the CPU step keeps freed host memory)"
            + "".join(f"; `[{n}]` adds `{' '.join(o)}`" for n, o in variants.items() if n not in trees)
            + "".join(f"; `[{n}]` is commit {n[1:]}'s own step (--baseline, a git worktree)" for n in trees),
            *details,
            *[line for name in trees for line in ab_lines(workers, name)],
            "",
            table,
        ]
    )
    if args.raw:
        raw = {
            "ceilings": ceilings,
            "runs": [
                {
                    **w.spec,
                    "label": w.name,
                    "info": w.info,
                    "windows": w.windows,
                    "memory": w.memory,
                    "failed": w.failed,
                    "tokens_per_s": w.median("tokens_per_s") if w.windows else None,
                    "mfu": mfu(w, ceilings) if w.windows else None,
                }
                for w in workers.values()
            ],
        }
        Path(args.raw).write_text(json.dumps(raw, indent=1))
    if not args.no_write and not args.quick:
        append_docs(Path(args.out), section)
        print(f"appended to {args.out}", flush=True)
    print()
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
