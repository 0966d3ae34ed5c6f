"""Run a verb on many processes with torch's elastic launcher, started in-process by the CLI.

The parent composes and validates the config once and freezes it to a file; every worker reads
that file (`python -m suite.cli.worker <verb> <config.yaml>`), so no worker ever re-runs Hydra.

    launch.nproc_per_node   workers on this node (one per GPU; CPU processes on a CPU machine)
    launch.nnodes           nodes in the job; run the same command on each with its node_rank
    launch.node_rank        this node's number; node 0 hosts the rendezvous store
    launch.rdzv_endpoint    host:port of the rendezvous (node 0's address). On one node the default
                            127.0.0.1:29500 is replaced by a free port picked by the OS, so two jobs
                            on one machine never collide.
                            While node(s) wait for their peers, each says so every few seconds,
                            with the endpoint and how to start the others.
    launch.max_restarts     how many times the whole worker group is restarted after a failure
                            (workers resume from the newest checkpoint)
    launch.worker_start     spawn: every rank a fresh interpreter; fork: ranks forked from one
                            process per job that imported torch and the suite once
                            (suite/launch/fork_server.py); auto: fork for CPU workers, spawn on GPUs

Elastic process range (`launch.nproc_per_node=min:max`, one node): the job starts on max workers.
After a failure (with restarts left) the suite's launcher starts a new worker group itself: on the
same device slots, unless the failing rank's slot failed in the previous attempt too, in which
case that slot (its GPU) is treated as lost and the job goes on without it, on the largest world
size between min and the slots left for which the parallel degrees resolve (`parallel.sharding`
or `parallel.dp` set to `auto` absorbs the change; the global batch, hence the data order and the
loss, stays the same). The workers reshard the newest checkpoint on load.
`SUITE_FAULT_LOSE_DEVICE=1` (a test aid) treats a failing slot as lost at its first failure.

Worker stdout/stderr go straight to this console: only rank 0 prints progress and metrics, any
rank's traceback shows up. A failed worker ends the job with one `error:` line naming the rank and
its exception, and a non-zero exit (2 for a configuration error found inside a worker).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
from torch.distributed.launcher.api import elastic_launch

from suite.config.compose import load_saved_config
from suite.config.errors import ConfigError
from suite.config.schema import LaunchConfig
from suite.launch.fork_server import SERVER_ENV, ForkServer
from suite.parallel.dims import elastic_world_sizes

WORKER_FLAG = "SUITE_WORKER"
RESTART_ENV = "SUITE_RESTART_COUNT"  # the attempt number of an elastic (min:max) job, for the workers
LOSE_DEVICE_ENV = "SUITE_FAULT_LOSE_DEVICE"
DEFAULT_ENDPOINT = LaunchConfig.rdzv_endpoint
STARTED = "started"  # a worker touches this file beside the frozen config once it runs
WAIT_NOTICE_S = 5.0  # a node waiting for its peers says so this often
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent


def inside_worker() -> bool:
    """True in a process the launcher started (or any torchrun-launched process)."""
    return os.environ.get(WORKER_FLAG) == "1" or "TORCHELASTIC_RUN_ID" in os.environ


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


LAUNCH_KEYS = ("launch.nnodes", "launch.node_rank", "launch.nproc_per_node", "launch.rdzv_endpoint")


def node_commands(verb: str, args: list[str], launch_cfg: LaunchConfig) -> list[str]:
    """The command each of launch.nnodes nodes runs (`--print-launch`, scripts/slurm/suite.sbatch):
    the arguments as typed, less the launch.* keys that differ per node, then those keys."""
    kept = [a for a in args if a.split("=", 1)[0] not in LAUNCH_KEYS]
    return [
        shlex.join(
            [
                "python",
                "-m",
                "suite",
                verb,
                *kept,
                f"launch.nnodes={launch_cfg.nnodes}",
                f"launch.nproc_per_node={launch_cfg.nproc_per_node}",
                f"launch.rdzv_endpoint={launch_cfg.rdzv_endpoint}",
                f"launch.node_rank={rank}",
            ]
        )
        for rank in range(launch_cfg.nnodes)
    ]


def _announce_waiting(launch_cfg: LaunchConfig, endpoint: str, started: Path) -> threading.Event:
    """Until this node's workers start (they touch `started`), say every WAIT_NOTICE_S seconds that
    the node waits for its peers, where, and how to start them. Set the returned event to stop."""
    stop = threading.Event()
    nodes, rank = launch_cfg.nnodes, launch_cfg.node_rank
    others = ", ".join(str(r) for r in range(nodes) if r != rank)
    host = endpoint.rsplit(":", 1)[0]
    reach = (
        f" ({host} is this machine's loopback address: other machines need launch.rdzv_endpoint=<node 0's address>:<port>)"
        if host.startswith(("127.", "localhost"))
        else ""
    )

    def loop() -> None:
        start = time.monotonic()
        while not stop.wait(WAIT_NOTICE_S) and not started.exists():
            print(
                f"node {rank} of {nodes}: waiting {time.monotonic() - start:.0f}s for the other nodes at "
                f"launch.rdzv_endpoint={endpoint}{reach}; start node(s) {others} with this same command and "
                f"launch.node_rank=<n> launch.rdzv_endpoint={endpoint}",
                flush=True,
            )

    threading.Thread(target=loop, name="suite-wait-notice", daemon=True).start()
    return stop


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


class GroupFailed(Exception):
    """A worker group ended with a failed worker: (rank, exit code, message) of the first failure."""

    def __init__(self, rank: int, code: int, message: str):
        super().__init__(rank, code, message)
        self.rank, self.code, self.message = rank, code, message

    def describe(self, verb: str) -> str:
        where = f"rank {self.rank} exited with code {self.code}" if self.rank >= 0 else "a worker failed"
        detail = f": {self.message}" if self.message else " (see that rank's output above)"
        return f"{verb} failed, {where}{detail}"


# what every launched worker imports, imported once by the fork server (a verb adds its own: Verb.rank_imports)
WORKER_PRELOAD = (
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "suite.preflight",
    "suite.parallel",
    "suite.model_source",
    "suite.train.trainer",
    "suite.cli.worker",
    "suite.cli.verbs",  # the verb registry the worker reads (every verb module: import it once, not per rank)
)


def forks_workers(launch_cfg: LaunchConfig, device: str) -> bool:
    """launch.worker_start resolved: fork for CPU workers under auto (measured here), spawn for GPU
    ones until the fork path is measured on a GPU machine."""
    if launch_cfg.worker_start != "auto":
        return launch_cfg.worker_start == "fork"
    if launch_cfg.backend == "nccl" or device == "cuda":
        return False
    if launch_cfg.backend == "gloo" or device == "cpu":
        return True
    return not torch.cuda.is_available()


def _worker_env(extra_env: dict[str, str]) -> dict[str, str]:
    """What every worker (and the fork server, which must import as they would) runs with."""
    return {
        WORKER_FLAG: "1",
        # workers import this very package, installed or not
        "PYTHONPATH": os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **extra_env,
    }


def launch(
    verb: str,
    resolved_yaml: str,
    launch_cfg: LaunchConfig,
    run_dir: Path,
    device: str = "auto",
    preload: tuple[str, ...] = (),
) -> None:
    """Start the workers on this node (one node of nnodes) and wait for them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="suite-launch-"))
    frozen = workdir / "config.yaml"
    frozen.write_text(resolved_yaml)
    # one warm process per job forks the ranks (and those of any restart); its socket path must
    # fit a Unix socket address (108 bytes)
    server = None
    if forks_workers(launch_cfg, device) and len(str(workdir / "workers.sock")) < 100:
        server = ForkServer(str(workdir), [*WORKER_PRELOAD, *preload], _worker_env({}))
    # empty: no server, even where this command itself was forked by one (a `suite run` stage)
    base_env = {SERVER_ENV: server.address if server else ""}
    try:
        parts = str(launch_cfg.nproc_per_node).split(":")  # validated: N or min:max
        low, high = int(parts[0]), int(parts[-1])
        if low == high:
            _run_group(verb, frozen, run_dir, launch_cfg, high, launch_cfg.max_restarts, base_env)
        else:
            _run_elastic(verb, frozen, run_dir, launch_cfg, low, high, base_env)
    except GroupFailed as failed:
        if failed.code == ConfigError.exit_code and failed.message:
            raise ConfigError(failed.message.removeprefix("ConfigError: ")) from None
        raise SystemExit(f"error: {failed.describe(verb)}") from None
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _run_elastic(
    verb: str,
    frozen: Path,
    run_dir: Path,
    launch_cfg: LaunchConfig,
    low: int,
    high: int,
    base_env: dict[str, str],
) -> None:
    """Attempts of an elastic (min:max) job, each a fresh worker group that the suite restarts
    itself, on fewer processes once a device slot is lost (see the module docstring)."""
    sizes = elastic_world_sizes(load_saved_config(frozen))  # largest first; validation checked min
    slots = list(range(high))  # device slots: local GPU indices on a GPU node
    suspect: int | None = None  # the slot that failed in the previous attempt
    nproc = sizes[0]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(high)))).split(",")
    for attempt in range(launch_cfg.max_restarts + 1):
        extra = {**base_env, RESTART_ENV: str(attempt)}
        if len(slots) < high:  # a slot was dropped: hide its device from the workers
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(visible[s] for s in slots[:nproc] if s < len(visible))
        try:
            _run_group(verb, frozen, run_dir, launch_cfg, nproc, 0, extra)
            return
        except GroupFailed as failed:
            if failed.code == ConfigError.exit_code or attempt == launch_cfg.max_restarts:
                raise
            culprit = slots[failed.rank] if 0 <= failed.rank < nproc else None
            lost = culprit is not None and (culprit == suspect or os.environ.get(LOSE_DEVICE_ENV) == "1")
            suspect = None if lost else culprit
            note = ""
            if lost:
                slots.remove(culprit)
                note = f"device slot {culprit} counts as lost ({len(slots)} left); "
            fitting = [n for n in sizes if n <= len(slots)]
            if not fitting:
                raise SystemExit(
                    f"error: {failed.describe(verb)}; {note}no world size between {low} and {len(slots)} "
                    "fits the parallel degrees, so the job cannot continue"
                ) from None
            nproc = fitting[0]
            print(
                f"{failed.describe(verb)}; {note}restarting on {nproc} processes from the newest "
                f"checkpoint (restart {attempt + 1} of {launch_cfg.max_restarts})",
                flush=True,
            )


def _run_group(
    verb: str,
    frozen: Path,
    run_dir: Path,
    launch_cfg: LaunchConfig,
    nproc: int,
    max_restarts: int,
    extra_env: dict[str, str],
) -> None:
    """One elastic_launch of `nproc` workers (torch's agent restarts them up to `max_restarts`
    times); a failure raises GroupFailed."""
    nodes = launch_cfg.nnodes
    endpoint = rendezvous_endpoint(launch_cfg)
    loopback = endpoint.startswith(("127.", "localhost"))
    config = ElasticConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        run_id=run_id(launch_cfg, run_dir),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": launch_cfg.node_rank == 0} if nodes > 1 else {},
        max_restarts=max_restarts,
        monitor_interval=0.25,
        start_method="spawn",
        local_addr="127.0.0.1" if loopback else None,
    )
    # the agent's INFO chatter is not the user's business; its warnings and errors still print
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # a failed worker is reported by the caller, once, as one line; the agent's own error log would repeat it
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    env = _worker_env(extra_env)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    waiting = _announce_waiting(launch_cfg, endpoint, frozen.with_name(STARTED)) if nodes > 1 else None
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "suite.cli.worker", verb, str(frozen))
    except ChildFailedError as exc:
        raise GroupFailed(*_first_failure(exc)) from None
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
        if waiting is not None:
            waiting.set()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
