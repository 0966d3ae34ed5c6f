"""suite.launch.fork_server on its own: a client stands for a process the server forked (output, folder,
environment, exit code, killing signal, SIGTERM passed on, its SIGKILL taking the process along),
and runs the process itself where there is no server. tests/fork_target.py is the forked `main`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from suite.launch.fork_server import SERVER_ENV, ForkServer, client_command
from tests.helpers import REPO, child_processes, process_gone

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process trees from /proc")


@pytest.fixture
def server(tmp_path):
    env = {"PYTHONPATH": str(REPO)}
    started = ForkServer(str(tmp_path), ["tests.fork_target"], env)
    deadline = time.time() + 60
    while not Path(started.path).exists() and time.time() < deadline:
        time.sleep(0.02)
    yield started
    started.close()


def _client(server, tmp_path, *argv: str, extra_env: dict | None = None, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "FORK_TARGET_ENV": "from-the-client", **(extra_env or {})}
    if server is not None:
        env[SERVER_ENV] = server.address
    return subprocess.Popen(
        client_command("tests.fork_target", list(argv)),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def test_the_forked_process_has_the_clients_output_folder_environment_and_exit_code(server, tmp_path):
    client = _client(server, tmp_path, "exit", "3")
    out, err = client.communicate(timeout=60)
    assert client.returncode == 3, (out, err)
    fields = dict(item.split("=", 1) for item in out.split())
    assert int(fields["ppid"]) == server.proc.pid and int(fields["pid"]) != client.pid  # forked by the server
    assert fields["env"] == "from-the-client"
    assert err.strip() == f"cwd={tmp_path}"


def test_a_process_without_a_server_runs_in_the_client(tmp_path):
    client = _client(None, tmp_path, "exit", "4")
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 4 and f"pid={client.pid} " in out


def test_the_killing_signal_and_a_one_line_exit_are_the_clients(server, tmp_path):
    killed = _client(server, tmp_path, "signal", str(int(signal.SIGSEGV)))
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGSEGV
    stopped = _client(server, tmp_path, "raise", "error: a one-line stop")
    _, err = stopped.communicate(timeout=60)
    assert (
        stopped.returncode == 1 and err.strip().endswith("error: a one-line stop") and "Traceback" not in err
    )


def test_sigterm_reaches_the_process_and_sigkill_of_the_client_takes_it_along(server, tmp_path):
    client = _client(server, tmp_path, "term", "7")
    assert client.stdout.readline().startswith("pid=") and client.stdout.readline() == "waiting\n"
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=60) == 7  # the target's own SIGTERM handler ran
    client = _client(server, tmp_path, "term", "7")
    assert client.stdout.readline().startswith("pid=") and client.stdout.readline() == "waiting\n"
    forked = list(child_processes(server.proc.pid))
    assert len(forked) == 1, forked
    client.kill()
    client.wait(timeout=60)
    deadline = time.time() + 10
    while not process_gone(forked[0]) and time.time() < deadline:
        time.sleep(0.02)
    assert process_gone(forked[0])
    assert server.proc.poll() is None  # the server goes on


def test_the_server_ends_with_its_parent(tmp_path):
    code = (
        f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from suite.launch.fork_server import ForkServer; "
        f"s = ForkServer({str(tmp_path)!r}, [], {{}}); print(s.proc.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while not process_gone(server_pid) and time.time() < deadline:
        time.sleep(0.05)
    assert process_gone(server_pid)


def test_the_server_imports_with_one_thread_and_each_process_takes_its_own_count(tmp_path):
    """An OpenMP pool in the server would be broken in every child, so the server imports torch with
    one thread (and would stop if a thread existed); a forked process then takes its own
    OMP_NUM_THREADS, or without one the launcher's default (here 3), as a fresh interpreter would."""
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "3"}
    server = ForkServer(str(tmp_path), ["torch", "tests.fork_target"], env)
    try:
        lines = {}
        for name, extra in (("default", {}), ("own", {"OMP_NUM_THREADS": "2"})):
            client_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            client = subprocess.Popen(
                client_command("tests.fork_target", ["threads", "0"]),
                cwd=tmp_path,
                env={**client_env, "PYTHONPATH": str(REPO), SERVER_ENV: server.address, **extra},
                stdout=subprocess.PIPE,
                text=True,
            )
            out, _ = client.communicate(timeout=120)
            assert client.returncode == 0, out
            lines[name] = dict(item.split("=", 1) for item in out.split())
        assert all(int(fields["ppid"]) == server.proc.pid for fields in lines.values()), lines  # forked
        assert lines["default"]["threads"] == "3" and lines["own"]["threads"] == "2", lines
    finally:
        server.close()
