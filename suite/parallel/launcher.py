"""Run a verb on many processes with torch's elastic launcher, started in-process by the CLI.

The parent composes and validates the config once and freezes it to a file; every worker reads
that file (`python -m suite.worker <verb> <config.yaml>`), so no worker ever re-runs Hydra.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path

from suite.config.schema import LaunchConfig

WORKER_FLAG = "SUITE_WORKER"


def inside_worker() -> bool:
    """True in a process the launcher started (or any torchrun-launched process)."""
    return os.environ.get(WORKER_FLAG) == "1" or "TORCHELASTIC_RUN_ID" in os.environ


def _nproc_range(value: object) -> tuple[int, int]:
    text = str(value)
    if ":" in text:
        low, high = text.split(":", 1)
        return int(low), int(high)
    return int(text), int(text)


def launch(verb: str, resolved_yaml: str, launch_cfg: LaunchConfig, run_dir: Path) -> None:
    """Start nproc_per_node workers on this node (one node of nnodes) and wait for them."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    run_dir.mkdir(parents=True, exist_ok=True)
    frozen = Path(tempfile.mkdtemp(prefix="suite-launch-")) / "config.yaml"
    frozen.write_text(resolved_yaml)
    nproc_min, nproc_max = _nproc_range(launch_cfg.nproc_per_node)
    nodes = launch_cfg.nnodes
    config = ElasticConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc_max,
        run_id=os.environ.get("SUITE_RUN_ID", uuid.uuid5(uuid.NAMESPACE_URL, str(run_dir.resolve())).hex[:16]),
        rdzv_backend="c10d",
        rdzv_endpoint=launch_cfg.rdzv_endpoint,
        rdzv_configs={"is_host": launch_cfg.node_rank == 0} if nodes > 1 else {},
        max_restarts=launch_cfg.max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
        local_addr="127.0.0.1" if launch_cfg.rdzv_endpoint.startswith(("127.", "localhost")) else None,
    )
    del nproc_min  # elastic ranges shrink nodes, not processes per node; kept for validation
    os.environ[WORKER_FLAG] = "1"
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "suite.worker", verb, str(frozen))
    except ChildFailedError as exc:
        failures = exc.failures
        first = min(failures.values(), key=lambda f: f.timestamp) if failures else None
        detail = f"rank {first.global_rank} exited with {first.exitcode}" if first else "a worker failed"
        raise SystemExit(f"error: {verb} failed: {detail} (see the rank's output above)") from None
    finally:
        os.environ.pop(WORKER_FLAG, None)
