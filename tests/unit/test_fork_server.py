"""suite.fork_server on its own: a client stands for a process the server forked (output, folder,
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

from suite.fork_server import SERVER_ENV, ForkServer, client_command
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


def _client(server, tmp_path, *argv: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "FORK_TARGET_ENV": "from-the-client"}
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
        f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from suite.fork_server import ForkServer; "
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
