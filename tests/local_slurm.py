"""A one-node Slurm on this machine for tests: munged, slurmctld and slurmd as root, every file
(munge key, slurm.conf, state, spool, logs) in a temporary folder, ports picked free.

    with LocalSlurm(folder) as slurm:
        proc = slurm.sbatch(script, args, cwd=...)   # sbatch --wait; the job's output: slurm.job_output

Needs slurm-wlm and munge (Debian/Ubuntu packages) and root; tests skip without them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers import free_port, suite_env

CONF = """\
ClusterName=suitetest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=5
NodeName=localhost CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class LocalSlurm:
    def __init__(self, folder: Path, cpus: int = 2):
        self.folder = Path(folder)
        self.cpus = cpus
        # unix socket paths are limited to ~107 bytes: the daemons' files live in a short folder
        self.root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        self.conf = self.root / "slurm.conf"
        self.job_output = ""
        self.final_logs = ""

    def env(self) -> dict[str, str]:
        return suite_env(SLURM_CONF=str(self.conf), SUITE_PYTHON=sys.executable)

    def __enter__(self) -> LocalSlurm:
        root = self.root
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        key = root / "munge" / "munge.key"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
        key.chmod(0o400)
        subprocess.run(
            [
                "munged",
                "--force",
                f"--key-file={key}",
                f"--socket={root}/munge/munge.sock",
                f"--pid-file={root}/munge/munged.pid",
                f"--log-file={root}/munge/munged.log",
                f"--seed-file={root}/munge/seed",
            ],
            check=True,
            capture_output=True,
        )
        self.conf.write_text(
            CONF.format(root=root, ctld_port=free_port(), slurmd_port=free_port(), cpus=self.cpus)
        )
        try:
            subprocess.run(
                ["slurmctld", "-f", str(self.conf), "-i"], check=True, capture_output=True, env=self.env()
            )
            subprocess.run(
                ["slurmd", "-f", str(self.conf), "-N", "localhost"],
                check=True,
                capture_output=True,
                env=self.env(),
            )
            self._wait_idle()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            proc = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=self.env()
            )
            state = proc.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the local Slurm node did not become idle (state {state!r}):\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for name in ("log/slurmctld.log", "log/slurmd.log", "munge/munged.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-20:]))
        return "\n".join(parts)

    def sbatch(self, script: Path, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        out = self.folder / "job-%j.out"
        self.folder.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            ["sbatch", "--wait", "--nodes=1", f"--output={out}", str(script), *args],
            cwd=cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        self.job_output = "\n".join(p.read_text() for p in sorted(self.folder.glob("job-*.out")))
        return proc

    def __exit__(self, *exc) -> None:
        self.final_logs = self.logs()
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            path = self.root / pid_file
            with contextlib.suppress(OSError, ValueError):
                pid = int(path.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                for _ in range(50):
                    os.kill(pid, 0)  # raises once it is gone
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)
