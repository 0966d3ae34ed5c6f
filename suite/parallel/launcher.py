"""Run a verb on many processes with torch's elastic launcher, started in-process by the CLI.

The parent composes and validates the config once and freezes it to a file; every worker reads
that file (`python -m suite.worker <verb> <config.yaml>`), so no worker ever re-runs Hydra.

    launch.nproc_per_node   workers on this node (one per GPU; CPU processes on a CPU machine)
    launch.nnodes           nodes in the job; run the same command on each with its node_rank
    launch.node_rank        this node's number; node 0 hosts the rendezvous store
    launch.rdzv_endpoint    host:port of the rendezvous (node 0's address). On one node the default
                            127.0.0.1:29500 is replaced by a free port picked by the OS, so two jobs
                            on one machine never collide.
    launch.max_restarts     how many times the whole worker group is restarted after a failure
                            (workers resume from the newest checkpoint)

Worker stdout/stderr go straight to this console: only rank 0 prints progress and metrics, any
rank's traceback shows up. A failed worker ends the job with one `error:` line naming the rank and
its exception, and a non-zero exit (2 for a configuration error found inside a worker).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from suite.config.errors import ConfigError
from suite.config.schema import LaunchConfig

WORKER_FLAG = "SUITE_WORKER"
DEFAULT_ENDPOINT = LaunchConfig.rdzv_endpoint
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent


def inside_worker() -> bool:
    """True in a process the launcher started (or any torchrun-launched process)."""
    return os.environ.get(WORKER_FLAG) == "1" or "TORCHELASTIC_RUN_ID" in os.environ


def _nproc(value: object) -> int:
    text = str(value)
    return int(text.split(":")[-1])  # min:max elastic range: the maximum


def rendezvous_endpoint(launch_cfg: LaunchConfig) -> str:
    """The endpoint to use: a free loopback port for a one-node job left at the default."""
    if launch_cfg.nnodes == 1 and launch_cfg.rdzv_endpoint == DEFAULT_ENDPOINT:
        return "127.0.0.1:0"  # c10d rendezvous binds port 0: the OS picks a free one (torchrun --standalone)
    return launch_cfg.rdzv_endpoint


def run_id(launch_cfg: LaunchConfig, run_dir: Path) -> str:
    """Identical on every node of one job (the same command runs on each): from the endpoint, the
    node count and run.dir as written (not resolved: nodes may start in different folders)."""
    if os.environ.get("SUITE_RUN_ID"):
        return os.environ["SUITE_RUN_ID"]
    key = f"{launch_cfg.rdzv_endpoint}|{launch_cfg.nnodes}|{run_dir}"
    return "suite-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def _first_failure(exc) -> tuple[int, int, str]:
    """(rank, exit code, message) of the earliest failing worker."""
    failures = getattr(exc, "failures", {}) or {}
    if not failures:
        return -1, 1, str(exc).strip().splitlines()[0] if str(exc).strip() else "a worker failed"

    def blame(item):
        # 1. killed by a signal (OOM killer, segfault) other than SIGTERM, which is the agent stopping
        #    the survivors; 2. the earliest rank that raised (its peers then fail on closed
        #    connections, later); 3. the rest
        failure = item[1]
        killed = failure.exitcode < 0 and failure.exitcode != -15
        raised = bool(failure.error_file_data and failure.error_file_data.get("message"))
        return (not killed, not raised, failure.timestamp, item[0])

    rank, first = min(failures.items(), key=blame)
    message = first.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message or "").strip()
    if message.startswith("To enable traceback"):
        message = ""
    message = message.splitlines()[0] if message else ""
    for prefix in ("RunStopped: ", "SystemExit: ", "error: "):  # a worker's own one-line stop message
        message = message.removeprefix(prefix)
    return rank, first.exitcode, message


def launch(verb: str, resolved_yaml: str, launch_cfg: LaunchConfig, run_dir: Path) -> None:
    """Start nproc_per_node workers on this node (one node of nnodes) and wait for them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    run_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="suite-launch-"))
    frozen = workdir / "config.yaml"
    frozen.write_text(resolved_yaml)
    nodes = launch_cfg.nnodes
    endpoint = rendezvous_endpoint(launch_cfg)
    loopback = endpoint.startswith(("127.", "localhost"))
    config = ElasticConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=_nproc(launch_cfg.nproc_per_node),
        run_id=run_id(launch_cfg, run_dir),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": launch_cfg.node_rank == 0} if nodes > 1 else {},
        max_restarts=launch_cfg.max_restarts,
        monitor_interval=0.25,
        start_method="spawn",
        local_addr="127.0.0.1" if loopback else None,
    )
    # the agent's INFO chatter is not the user's business; its warnings and errors still print
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # a failed worker is reported below, once, as one line; the agent's own error log would repeat it
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    env = {
        WORKER_FLAG: "1",
        # workers import this very package, installed or not
        "PYTHONPATH": os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "suite.worker", verb, str(frozen))
    except ChildFailedError as exc:
        rank, code, message = _first_failure(exc)
        if code == ConfigError.exit_code and message:
            raise ConfigError(message.removeprefix("ConfigError: ")) from None
        where = f"rank {rank} exited with code {code}" if rank >= 0 else "a worker failed"
        detail = f": {message}" if message else " (see that rank's output above)"
        raise SystemExit(f"error: {verb} failed, {where}{detail}") from None
    except SignalException as exc:
        # SIGTERM/SIGINT to this process: the agent has passed it to the workers (they checkpoint the
        # current step and exit, see the trainer) and waited for them
        code = 128 + int(exc.sigval)
        raise SystemExit(code) from None
    except Exception as exc:  # rendezvous timeouts and the like: still one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SystemExit(
            f"error: {verb} could not start its workers: {type(exc).__name__}: {first}"
        ) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(workdir, ignore_errors=True)
