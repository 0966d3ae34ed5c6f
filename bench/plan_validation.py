"""The planner against Narayanan et al. 2021, Table 2: each published run's predicted TFLOP/s per GPU
beside the published one, and the layout the planner itself picks for the same model and GPU count
(a full search each). Prints the markdown table docs/planner.md quotes.

    python bench/plan_validation.py [--cluster a100-80g] [--no-search]
"""

from __future__ import annotations

import argparse
import time

from suite.config.compose import compose_config, to_object
from suite.plan.cost import evaluate
from suite.plan.published import NARAYANAN_2021_TABLE_2, job_of
from suite.plan.search import search


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="a100-80g")
    parser.add_argument("--no-search", action="store_true", help="skip the planner's own choice")
    args = parser.parse_args()
    cluster = to_object(compose_config([f"cluster={args.cluster}"])).cluster
    print(f"cluster preset {args.cluster}\n")
    print(
        "| system | model | GPUs | layout | published TFLOP/s | predicted | error | planner's choice | its TFLOP/s | search s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    searched: dict[tuple, tuple] = {}
    for run in NARAYANAN_2021_TABLE_2:
        job = job_of(run, cluster)
        cost = evaluate(job, run.layout)
        key = (run.model, run.gpus, run.global_batch)
        if not args.no_search and key not in searched:
            start = time.perf_counter()
            best = search(job).best
            searched[key] = (best, time.perf_counter() - start)
        best, seconds = searched.get(key, (None, 0.0))
        choice = f"{best.layout.name} | {best.tflops_per_device:.1f} | {seconds:.0f}" if best else "- | - | -"
        faster = "" if best is None or best.time.total <= cost.time.total else " (SLOWER)"
        print(
            f"| {run.system} | {run.model} | {run.gpus} | {run.layout.name} | {run.tflops_per_gpu:.0f} | "
            f"{cost.tflops_per_device:.1f} | {cost.tflops_per_device / run.tflops_per_gpu - 1:+.1%} | {choice}{faster} |"
        )


if __name__ == "__main__":
    main()
