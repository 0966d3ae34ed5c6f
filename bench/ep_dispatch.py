"""Bytes crossing nodes per step: the flat and the hierarchical expert all-to-all (`parallel.ep_dispatch`).

Launches `recipe=moe-tiny` as `--nodes` loopback "nodes" (one `suite pretrain ... launch.nnodes=N
launch.node_rank=r` per node on 127.0.0.1) x `--per-node` processes, ep over every data rank, once
with each dispatch, and prints per step the loss, the all-to-all bytes all ranks send to other
ranks (`a2a_bytes`) and the part that crosses nodes (`a2a_internode_bytes`), dispatch + combine,
forward + backward, from the split sizes each rank exchanged (metrics.jsonl).
    python bench/ep_dispatch.py --steps 3
    python bench/ep_dispatch.py --steps 3 --set model.top_k=4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(dispatch: str, args: argparse.Namespace, root: Path) -> list[dict]:
    run_dir = root / dispatch
    world = args.nodes * args.per_node
    base = [
        sys.executable,
        "-m",
        "suite",
        "pretrain",
        "recipe=moe-tiny",
        f"run.dir={run_dir}",
        f"train.max_steps={args.steps}",
        "train.log_every=1",
        "train.eval_batches=1",
        "log.wandb=false",
        "parallel.micro_batch_size=4",
        f"parallel.global_batch_size={4 * world}",
        f"parallel.dp={world}",
        f"parallel.ep={world}",
        f"parallel.ep_dispatch={dispatch}",
        f"launch.nnodes={args.nodes}",
        f"launch.nproc_per_node={args.per_node}",
        f"launch.rdzv_endpoint=127.0.0.1:{free_port()}",
        *args.set,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    logs = [(root / f"{dispatch}-node{r}.log").open("w") for r in range(args.nodes)]
    procs = [
        subprocess.Popen(
            [*base, f"launch.node_rank={r}"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        for r, log in enumerate(logs)
    ]
    if any(p.wait() for p in procs):
        sys.exit(f"{dispatch}: a node failed; logs in {root}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "a2a_bytes" in r]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="more overrides, e.g. model.top_k=4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {d: run(d, args, Path(tmp)) for d in ("flat", "hierarchical")}
    print(
        f"recipe=moe-tiny {' '.join(args.set)}: {args.nodes} nodes x {args.per_node} processes, ep={args.nodes * args.per_node}"
    )
    print(
        "| step | loss flat | loss hierarchical | a2a_bytes flat | a2a_bytes hier. | internode flat | internode hier. | hier. / flat |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for f, h in zip(runs["flat"], runs["hierarchical"]):
        ratio = h["a2a_internode_bytes"] / f["a2a_internode_bytes"]
        print(
            f"| {f['step']} | {f['loss']:.7f} | {h['loss']:.7f} | {f['a2a_bytes']:.0f} | {h['a2a_bytes']:.0f} | "
            f"{f['a2a_internode_bytes']:.0f} | {h['a2a_internode_bytes']:.0f} | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
