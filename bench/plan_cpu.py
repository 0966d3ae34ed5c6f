"""The planner's `cpu` cluster preset against real runs on this CPU (issue 19): for each layout of
gpt-tiny and of a ~100M-parameter GPT at world sizes 1, 2 and 4 (gloo), the cost model's per-rank
peak memory and step time beside what `suite pretrain` measured, and the share of layout pairs
whose step times the model orders as measured.

    python bench/plan_cpu.py                        # both models, every layout; the tables last
    python bench/plan_cpu.py --models gpt-tiny --layouts 1proc dp2
    python bench/plan_cpu.py --append               # also append the tables to docs/benchmarks.md
    python bench/plan_cpu.py --repeats 3            # every layout run 3 times, in rounds
    python bench/plan_cpu.py --models gpt-100m --repeats 1 --include earlier.json   # one more round
    python bench/plan_cpu.py --repeats 0 --include earlier.json   # earlier runs against today's model

What is compared:
- memory: the largest rank's peak bytes of live tensor storage during a training step
  (`train.tensor_memory=true`, suite.train.tensor_memory: a dispatch-mode tracker over the last
  step; summary.json tensor_peak_gb_per_rank) against the planner's Memory.total for its worst rank
  (the larger of backward's and the optimizer step's peak: suite.plan.cost.Memory). Not the resident
  set: that holds Python, torch's libraries and gloo's buffers, which no planner counts.
- step time: the median seconds of the steps after the first and before the tracked last one
  (metrics.jsonl, train.log_every=1), and over --repeats runs of each layout the median of the runs'
  medians (the runs go in rounds, every layout once per round, so the machine's drift reaches every
  layout alike), against Time.total, with `cluster=cpu` sized to the launch on
  this machine (suite.plan.fit.launched_cluster: one device per rank; ranks beyond the cores
  time-share them).

fp32 everywhere (the preset's measured fp32 peak; `auto` picks bf16 only on CPUs with native bf16).
Timings on a shared machine move with its load: the table records the load average.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parallel import cpu_name  # noqa: E402  (bench/parallel.py: the same machine line)

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30

# model -> (shape overrides on recipe=gpt-tiny (GPT: pre-LN, learned positions, GELU, tied embeddings),
# default seq_len, default steps): the 100M model's steps are ~20x gpt-tiny's, so shorter and fewer
MODELS: dict[str, tuple[list[str], int, int]] = {
    "gpt-tiny": ([], 128, 8),
    # GPT-2 small's shape on the suite's 8192-token vocabulary: 12 x 768, 12 heads, 91.3M parameters
    "gpt-100m": (
        ["model.num_layers=12", "model.hidden_size=768", "model.num_heads=12", "model.name=gpt-100m"],
        64,
        4,
    ),
}
# --calibrate: a model too narrow for its FLOPs to matter (hidden 32, 16 tokens), at two depths, so that
# a step's time less the cost model's is the runtime's host overhead: a per-layer slope and a per-step
# intercept for each wrapper (the cluster preset's *_overhead_* keys)
NARROW = ["model.hidden_size=32", "model.num_heads=4"]
CALIBRATION: dict[str, tuple[list[str], int, int]] = {
    f"narrow-{layers}": ([*NARROW, f"model.num_layers={layers}", f"model.name=narrow-{layers}"], 16, 12)
    for layers in (2, 6)
}
CALIBRATION_LAYOUTS = ["1proc", "dp2", "sharding2-stage3", "tp2"]
# name -> (world size, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1proc": (1, []),
    "dp2": (2, ["parallel.dp=2"]),
    "sharding2-stage3": (2, ["parallel.sharding=2", "parallel.sharding_stage=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp4": (4, ["parallel.dp=4"]),
    "sharding4-stage2": (4, ["parallel.sharding=4", "parallel.sharding_stage=2"]),
    "tp2-dp2": (4, ["parallel.tp=2", "parallel.dp=2"]),
    "pp2-dp2": (4, ["parallel.pp=2", "parallel.dp=2"]),
}


def shape_args(model: str, args: argparse.Namespace) -> list[str]:
    return [
        "recipe=gpt-tiny",
        *{**MODELS, **CALIBRATION}[model][0],
        f"data.seq_len={seq_of(model, args)}",
        f"parallel.micro_batch_size={args.micro_batch}",
        f"parallel.global_batch_size={args.global_batch}",
        "train.precision=fp32",
        "train.compile=false",
    ]


def seq_of(model: str, args: argparse.Namespace) -> int:
    return (None if model in CALIBRATION else args.seq) or {**MODELS, **CALIBRATION}[model][1]


def steps_of(model: str, args: argparse.Namespace) -> int:
    return (None if model in CALIBRATION else args.steps) or {**MODELS, **CALIBRATION}[model][2]


def run_args(model: str, args: argparse.Namespace) -> list[str]:
    steps = steps_of(model, args)
    return [
        f"train.max_steps={steps}",
        "train.log_every=1",
        f"train.eval_every={steps}",
        "train.eval_batches=1",
        f"train.save_every={steps * 10}",  # only the final checkpoint
        "train.tensor_memory=true",
        "log.wandb=false",
        "log.progress=false",
        "train.num_threads=1",
    ]


def predict(
    model: str, overrides: list[str], world: int, args: argparse.Namespace, bare: bool = False
) -> dict:
    """The cost model's answer for the run's own config, on the `cpu` preset sized to the launch
    (`bare`: with its host overheads zeroed, what --calibrate subtracts)."""
    from suite.config.compose import compose_config, to_object
    from suite.parallel.dims import resolve_dims
    from suite.plan.cost import HOST_OVERHEADS, evaluate
    from suite.plan.fit import launched_cluster, recipe_layout
    from suite.plan.layout import Job

    cfg = to_object(
        compose_config([*overrides, *run_args(model, args), "cluster=cpu", f"launch.nproc_per_node={world}"])
    )
    dims = resolve_dims(cfg, world)
    # the preset sized to this launch on this machine: time-shared cores when ranks outnumber them
    cluster = launched_cluster(cfg, here=True)
    if bare:
        cluster = replace(cluster, **dict.fromkeys(HOST_OVERHEADS, 0.0))
    job = replace(Job.from_config(cfg), cluster=cluster)
    layout = recipe_layout(cfg, dims)
    cost = evaluate(job, layout)
    return {
        "plan_layout": layout.name,
        "mem_gb": cost.memory.total / GIB,
        "mem_parts_gb": {
            k: getattr(cost.memory, k) / GIB
            for k in ("weights", "compute_copies", "gradients", "optimizer", "activations")
        },
        "step_s": cost.time.total,
        "time_parts_s": {
            k: getattr(cost.time, k) for k in ("compute", "tp", "bubble", "pp", "data", "optimizer", "host")
        },
        "micro_batches": cost.micro_batches,
        "layers": cfg.model.num_layers,
    }


def run_layout(model: str, name: str, args: argparse.Namespace, root: Path, bare: bool = False) -> dict:
    world, overrides = LAYOUTS[name]
    shape = shape_args(model, args) + overrides
    row: dict = {"model": model, "layout": name, "world": world, "overrides": " ".join(overrides)}
    row |= predict(model, shape, world, args, bare)
    run_dir = root / f"{model}-{name}"
    cmd = [sys.executable, "-m", "suite", "pretrain", *shape, *run_args(model, args)]
    cmd += [f"run.dir={run_dir}", f"launch.nproc_per_node={world}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    row["run_s"] = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return row | {"error": " / ".join(tail)}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in records if "tokens_per_s" in r][
        1:-1
    ]  # not the first (start-up), not the tracked last
    tokens = args.global_batch * seq_of(model, args)
    summary = json.loads((run_dir / "summary.json").read_text())
    per_rank = summary["tensor_peak_gb_per_rank"]
    return row | {
        "measured_step_s": statistics.median(tokens / r["tokens_per_s"] for r in steps),
        "measured_mem_gb": max(per_rank),
        "measured_mem_per_rank": per_rank,
        "state_gb": summary["state_bytes"]["total"] / GIB,
        "ran": summary["layout"]["degrees"],
    }


def calibrate(args: argparse.Namespace) -> str:
    """Run the narrow model at both depths under each wrapper; per wrapper, the seconds a layer adds
    per micro-batch beyond the bare cost model (the slope between the depths) and the per-step rest
    (the intercept). Prints the preset's lines. The preset's overheads are a process's on a core of
    its own (suite.plan.cost.at_time_share stretches them for time-shared launches), so the 2-rank
    runs must not time-share: 2 cores at least."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        raise SystemExit(
            f"--calibrate runs 2 ranks of one thread each and this process may use {cores} core; "
            "run it where 2 cores are free (taskset -c 0,1 ...)"
        )
    rows = {}
    with tempfile.TemporaryDirectory(prefix="suite-bench-plan-calibrate-") as tmp:
        for name in CALIBRATION_LAYOUTS:
            for model in CALIBRATION:
                row = run_layout(model, name, args, Path(tmp), bare=True)
                if "error" in row:
                    raise SystemExit(f"{model} {name}: {row['error']}")
                rows[name, row["layers"]] = row
                print(
                    f"{model} {name}: {row['measured_step_s']:.4f} s measured, {row['step_s']:.4f} s bare model"
                )
    slopes, intercepts = {}, {}
    (shallow, deep) = sorted({layers for _, layers in rows})
    for name in CALIBRATION_LAYOUTS:
        a, b = rows[name, shallow], rows[name, deep]
        residual = [r["measured_step_s"] - r["step_s"] for r in (a, b)]
        work = [r["micro_batches"] * r["layers"] for r in (a, b)]  # layer micro-batches per rank
        slopes[name] = (residual[1] - residual[0]) / (work[1] - work[0])
        intercepts[name] = residual[0] - work[0] * slopes[name]
    base = slopes["1proc"]
    lines = [
        f"layer_overhead_us: {base * 1e6:.0f}",
        f"tp_layer_overhead_us: {(slopes['tp2'] - base) * 1e6:.0f}",
        f"dp_layer_overhead_us: {(slopes['dp2'] - base) * 1e6:.0f}",
        f"shard_layer_overhead_us: {(slopes['sharding2-stage3'] - base) * 1e6:.0f}",
        f"step_overhead_ms: {intercepts['1proc'] * 1e3:.1f}",
        f"tp_step_overhead_ms: {(intercepts['tp2'] - intercepts['1proc']) * 1e3:.1f}",
        f"dp_step_overhead_ms: {(intercepts['dp2'] - intercepts['1proc']) * 1e3:.1f}",
        f"shard_step_overhead_ms: {(intercepts['sharding2-stage3'] - intercepts['1proc']) * 1e3:.1f}",
    ]
    detail = ", ".join(f"{n} {slopes[n] * 1e6:.0f} us/layer + {intercepts[n] * 1e3:.1f} ms" for n in slopes)
    return "\n".join(lines) + f"\n# per wrapper: {detail}"


def order_agreement(rows: list[dict], resolved_only: bool = False) -> tuple[int, int]:
    """(pairs the model orders as measured, pairs): step times, every pair of a model's layouts.

    resolved_only: only the pairs whose runs do not overlap (every run of one layout faster than every
    run of the other), the pairs the measurement itself orders beyond its run-to-run spread."""
    same = total = 0
    for a, b in itertools.combinations([r for r in rows if "error" not in r], 2):
        if resolved_only and not resolved(a, b):
            continue
        total += 1
        predicted = a["step_s"] - b["step_s"]
        measured = a["measured_step_s"] - b["measured_step_s"]
        same += predicted * measured > 0
    return same, total


def resolved(a: dict, b: dict) -> bool:
    """Every measured run of one layout faster than every run of the other (two runs each at least:
    one run has no spread to be outside of)."""
    ra, rb = a["measured_runs_s"], b["measured_runs_s"]
    return min(len(ra), len(rb)) >= 2 and (max(ra) < min(rb) or max(rb) < min(ra))


def merge_runs(runs: list[dict], args: argparse.Namespace) -> dict:
    """One row from the repeated runs of a layout: the median of their step times (each run's own is
    the median of its steps), every run's kept in measured_runs_s; memory is the largest run's; the
    prediction is this code's (runs from --include were predicted by the code of their day)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    row = dict(max(ok, key=lambda r: r["measured_mem_gb"]))
    row["measured_runs_s"] = [r["measured_step_s"] for r in ok]
    row["measured_step_s"] = statistics.median(row["measured_runs_s"])
    row["run_s"] = sum(r["run_s"] for r in runs)  # an included run carries its own share
    world, overrides = LAYOUTS[row["layout"]]
    return row | predict(row["model"], shape_args(row["model"], args) + overrides, world, args)


def table(rows: list[dict]) -> str:
    lines = [
        "| model | layout | ranks | planner's name | predicted MB | measured MB (per rank) | ratio "
        "| predicted s/step | measured s/step | runs (s/step) | ratio |",
        "|---|---|---:|---|---:|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['layout']} | {r['world']} | failed: {r['error']} | | | | | | | |"
            )
            continue
        ranks = " / ".join(f"{m * 1024:.0f}" for m in r["measured_mem_per_rank"])
        runs = " / ".join(f"{t:.3f}" for t in r.get("measured_runs_s", [r["measured_step_s"]]))
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['world']} | {r['plan_layout']} | {r['mem_gb'] * 1024:.1f} "
            f"| {ranks} | {r['mem_gb'] / r['measured_mem_gb']:.2f} | {r['step_s']:.3f} "
            f"| {r['measured_step_s']:.3f} | {runs} | {r['step_s'] / r['measured_step_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--seq", type=int, help="data.seq_len (default: 128 gpt-tiny, 64 gpt-100m)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument(
        "--steps",
        type=int,
        help="per run (default: 8 gpt-tiny, 4 gpt-100m); the first is start-up, the last tracked",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of every layout, in rounds (the table: their median)"
    )
    parser.add_argument(
        "--include", nargs="*", default=[], metavar="JSON",
        help="earlier --json outputs whose runs of the --models and --layouts join these; every run is "
        "predicted again by this code, at this command's --seq, --micro-batch and --global-batch",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--append", action="store_true", help="append the tables to docs/benchmarks.md")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the cpu preset's host overheads (narrow model, 2 and 6 layers, 4 wrappers) and print them",
    )
    args = parser.parse_args()
    if args.repeats < 0 or (args.repeats == 0 and not args.include and not args.calibrate):
        parser.error(
            f"--repeats {args.repeats}: give 1 or more, or 0 with --include (rescoring earlier runs)"
        )
    if args.calibrate:
        print(calibrate(args))
        return 0

    started = dt.datetime.now(dt.timezone.utc)
    runs: dict[tuple[str, str], list[dict]] = {(m, n): [] for m in args.models for n in args.layouts}
    for path in args.include:  # earlier runs (their --json) first, then these: the runs in time order
        for earlier in json.loads(Path(path).read_text()):
            key = earlier.get("model"), earlier.get("layout")
            if "error" in earlier or key not in runs:  # only the models and layouts asked for
                continue
            times = earlier.get("measured_runs_s", [earlier["measured_step_s"]])
            share = earlier.get("run_s", 0.0) / len(times)
            runs[key] += [earlier | {"measured_step_s": t, "run_s": share} for t in times]
    with tempfile.TemporaryDirectory(prefix="suite-bench-plan-cpu-") as tmp:
        for round_ in range(1, args.repeats + 1):
            for model in args.models:
                for name in args.layouts:
                    row = run_layout(model, name, args, Path(tmp) / f"round{round_}")
                    runs[model, name].append(row)
                    status = row.get("error") or (
                        f"memory {row['mem_gb'] * 1024:.1f} predicted / {row['measured_mem_gb'] * 1024:.1f} MB "
                        f"measured, step {row['step_s']:.3f} / {row['measured_step_s']:.3f} s"
                    )
                    print(f"round {round_}: {model} {name}: {status} ({row['run_s']:.0f} s)", flush=True)
    rows = [merge_runs(found, args) for found in runs.values() if found]
    args.models = list(dict.fromkeys(row["model"] for row in rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    import torch

    command = " ".join(["python bench/plan_cpu.py", *sys.argv[1:]])
    shapes = "; ".join(f"{m}: seq {seq_of(m, args)}, {steps_of(m, args)} steps" for m in args.models)
    agreement = []
    for model in args.models:
        mine = [r for r in rows if r["model"] == model]
        same, total = order_agreement(mine)
        apart, resolved_total = order_agreement(mine, resolved_only=True)
        within = sum(
            1 for r in mine if "error" not in r and abs(r["mem_gb"] / r["measured_mem_gb"] - 1) <= 0.15
        )
        ran = sum(1 for r in mine if "error" not in r)
        agreement.append(
            f"- {model}: memory within 15% for {within} of {ran} layouts; step-time order agrees for "
            f"{same} of {total} pairs ({same / max(total, 1):.0%}); of the {resolved_total} pairs whose "
            f"runs do not overlap, {apart} ({apart / max(resolved_total, 1):.0%})"
        )
    text = (
        f"## The planner's `cpu` preset against runs, {started:%Y-%m-%d %H:%M} UTC: `{command}`\n\n"
        f"- machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, one thread per "
        f"rank; load average at the end {load} (1 / 5 / 15 min)\n"
        f"- shape: {shapes}, global batch {args.global_batch} (micro-batches of {args.micro_batch}), fp32, "
        "AdamW; measured s/step: the median of the steps after the first and before the last, and of "
        "the runs of each layout, made in rounds (each run's in `runs`); measured MB: peak "
        "live tensor storage of the last step per rank (`train.tensor_memory=true`); predicted: "
        "`suite.plan.cost.evaluate` with `cluster=cpu` sized to the launch (worst rank)\n\n"
        + table(rows)
        + "\n\n"
        + "\n".join(agreement)
        + "\n"
    )
    if args.append:
        with (REPO / "docs" / "benchmarks.md").open("a") as docs:
            docs.write("\n" + text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
