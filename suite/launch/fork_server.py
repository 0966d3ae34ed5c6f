"""Start suite processes by forking one process that imported torch and the suite, not a fresh
interpreter each.

A worker's imports (torch, its distributed packages, the trainer) cost ~4 s of CPU per rank, paid
by every rank at every start and restart; a `suite run` stage pays as much before it does
anything. With `launch.worker_start=fork` the launcher starts one server per job
(`python -m suite.launch.fork_server <socket> <modules>`), which imports all that once; each rank is still
the process torch's elastic agent starts, `python -m suite.cli.worker <verb> <config>`, but that
process (the *client*, a bare interpreter) hands its argv, environment, working folder and
stdin/stdout/stderr to the server over a Unix socket and the server forks the real worker from its
warm state. A pipeline (suite.pipeline.runner) does the same with one server per `suite run`, its
stages started as `python -m suite.launch.fork_server --client suite.cli <verb> ...`, each the CLI's `main`.
This module imports nothing of the suite itself: its callers name the modules to preload and the
module whose `main(argv)` each process runs.
The client then stands for the forked process:

- a signal sent to the client (the agent's SIGTERM when it stops the group) is passed on to the
  worker; the worker's exit code, or the signal that killed it, becomes the client's own;
- a client killed outright (SIGKILL from the OOM killer, a test, an operator) takes its worker
  with it: the worker watches the client's end of the socket and kills itself when it closes;
- if the server is gone, the client runs the worker itself, as `spawn` does.

The server never touches a GPU (forking a process that initialised CUDA breaks CUDA in the child),
and `auto` uses it only where the workers run on CPU (gloo), the case measured here.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import io
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback

WORKER_MODULE = "suite.cli.worker"  # a launched rank: ends without exit functions, as suite.cli.worker does
SERVER_ENV = "SUITE_WORKER_SERVER"
THREADS_ENV = "SUITE_FORK_THREADS"  # the intra-op thread count a forked process takes by default  # "<server pid>:<socket path>", set by the launcher for the clients
CONNECT_WAIT_S = 300.0  # the server imports for a few seconds first; a slow machine may take longer
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_HEADER = struct.Struct("!I")


def _send(conn: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    payload = json.dumps(message).encode()
    data = _HEADER.pack(len(payload)) + payload
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.sendall(data)


def _read_exactly(conn: socket.socket, size: int, fds: list[int] | None = None) -> bytes | None:
    """`size` bytes, no more (a later message stays in the socket), or None at end of stream; with
    `fds`, the descriptors sent along are collected there."""
    data = b""
    while len(data) < size:
        if fds is not None and not data:
            chunk, got, _, _ = socket.recv_fds(conn, size, 3)
            fds.extend(got)
        else:
            chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _receive(conn: socket.socket, with_fds: bool = False) -> tuple[dict | None, list[int]]:
    """One message (and the descriptors sent with it); (None, fds) once the peer has closed."""
    fds: list[int] = []
    header = _read_exactly(conn, _HEADER.size, fds if with_fds else None)
    if header is None:
        return None, fds
    payload = _read_exactly(conn, _HEADER.unpack(header)[0])
    return (None if payload is None else json.loads(payload)), fds


# ---------------------------------------------------------------------------------------- server


def preload(modules: list[str]) -> None:
    """Import `modules` once, in the server (the launcher names what a worker of its verb imports)."""
    for module in modules:
        importlib.import_module(module)


def run_main(module: str, argv: list[str], exit_functions: bool) -> int:
    """`module.main(argv)` as `python -m` runs an entry point: its return value is the exit code, a
    SystemExit's code or one-line message (on stderr, code 1), an uncaught exception's traceback
    (code 1); then, with `exit_functions`, the interpreter's exit functions (wandb, logging,
    temporary files), which suite.cli.worker leaves out on purpose (see its `_exit`)."""
    try:
        entry = importlib.import_module(module)
        sys.argv = [entry.__file__ or module, *argv]
        code = entry.main(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    if exit_functions:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    return code if isinstance(code, int) else 1


def _become_worker(conn: socket.socket, request: dict, fds: list[int], others: list[socket.socket]) -> None:
    """In the forked child: take the client's descriptors, folder and environment, run the worker's
    `main`, and exit with its code; never returns."""
    code = 1
    try:
        _die_with_parent()
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for other in others:
            other.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = io.TextIOWrapper(
                io.FileIO(fd, "w", closefd=False),
                encoding="utf-8",
                errors="backslashreplace",
                line_buffering=True,
                write_through=unbuffered,
            )
            setattr(sys, name, stream)
        os.chdir(request["cwd"])
        default_threads = os.environ.get(THREADS_ENV, "")
        os.environ.clear()
        os.environ.update(request["env"])
        # the server imported with one OpenMP thread (a thread pool must not exist when it forks);
        # the process gets the count a fresh interpreter would have: its OMP_NUM_THREADS, else the
        # launcher's default
        threads = os.environ.get("OMP_NUM_THREADS") or default_threads
        if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))

        def watch_client() -> None:
            with contextlib.suppress(OSError):
                while conn.recv(1):
                    pass
            os.kill(os.getpid(), signal.SIGKILL)  # the client is gone: so is the worker it stood for

        threading.Thread(target=watch_client, name="suite-client-watch", daemon=True).start()
        code = run_main(request["module"], request["argv"], request["module"] != WORKER_MODULE)
    except BaseException:  # the worker's main reports its own failures; this is the server's part failing
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code if isinstance(code, int) else 1)


def _die_with_parent() -> None:
    """Linux: a forked worker gets SIGKILL when the server dies (orphans would hold the clients'
    sockets open and leave them waiting)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _fork_safe() -> str | None:
    """Why forking this process would be unsafe, or None: a thread (an import's pool) or CUDA
    initialised here would be broken in every child."""
    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threading.active_count() > 1 or tasks > 1:
        return f"{max(threading.active_count(), tasks)} threads after the imports"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by the imports"
    return None


def serve(path: str, modules: list[str], parent: int) -> None:
    """Preload, listen on `path`, fork a worker per connection and tell each client how it ended.

    Event-driven (the listener and SIGCHLD through a wakeup pipe): a worker's death reaches its
    client within a millisecond, so the agent sees it at the same poll as its peers' failures,
    which follow it (see suite.launch.launcher._first_failure)."""
    preload(modules)  # `parent`: the launcher's pid, passed in (it may have died while this started)
    unsafe = _fork_safe()
    if unsafe:  # the clients find no socket and run their processes themselves (as spawn does)
        print(f"note: the fork server stops: {unsafe}; workers start as fresh interpreters", file=sys.stderr)
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops the server, not the terminal
    signal.set_wakeup_fd(wake_w)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears once it can be connected to
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    events.register(wake_r, selectors.EVENT_READ)
    clients: dict[int, socket.socket] = {}  # worker pid -> its client's connection

    def start_worker() -> None:
        conn, _ = listener.accept()
        conn.settimeout(30)  # a stalled client must not hold the others up
        try:
            request, fds = _receive(conn, with_fds=True)
        except (OSError, ValueError):
            conn.close()
            raise
        conn.settimeout(None)
        if request is None or len(fds) != 3:
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:
            conn.close()
            for fd in fds:
                os.close(fd)
            raise
        if pid == 0:
            signal.set_wakeup_fd(-1)
            events.close()
            os.close(wake_r)
            os.close(wake_w)
            listener.close()
            _become_worker(conn, request, fds, list(clients.values()))
        for fd in fds:
            os.close(fd)
        clients[pid] = conn
        with contextlib.suppress(OSError):
            _send(conn, {"pid": pid})

    def reap() -> None:
        with contextlib.suppress(OSError):
            while os.read(wake_r, 512):
                pass
        while clients:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            conn = clients.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()

    try:
        while not stop.is_set() and os.getppid() == parent:
            for key, _ in events.select(timeout=0.5):
                if key.fileobj is listener:
                    try:
                        start_worker()
                    except (OSError, ValueError) as exc:  # fork or accept failed, a broken request:
                        # that client gets no pid and runs its process itself; the others go on
                        print(f"note: the fork server could not start a process: {exc}", file=sys.stderr)
            reap()  # also after a missed wakeup: SIGCHLD does not queue
    finally:
        for pid in clients:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


SERVER_NAME = b"suite-forksrv"  # the process name (ps, top, /proc/<pid>/comm) of a server forked in place


class _ForkedServer:
    """The handle of a server forked from the launcher itself: what ForkServer uses of a Popen."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _fork_in_place(path: str, modules: list[str], env: dict[str, str]) -> _ForkedServer | None:
    """The server as a fork of this process, when this process already imported torch and may be
    forked (no thread, no CUDA): what a fresh server would import first (~4 s of CPU, on every
    launch's critical path) is here already. None where it may not, and the caller starts one."""
    torch = sys.modules.get("torch")
    if torch is None or _fork_safe() is not None:
        return None
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _ForkedServer(pid)
    code = 0
    try:  # the child: the server, as `python -m suite.launch.fork_server` would run with `env`
        os.setsid()  # as start_new_session: the terminal's Ctrl-C goes to the launcher
        for sig in (*FORWARDED, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(1)  # no OpenMP pool in the server (see ForkServer)
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(15, SERVER_NAME)  # PR_SET_NAME
        serve(path, modules, parent)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class ForkServer:
    """The launcher's side: start the server for one job, give the clients its address, stop it.

    Forked from the launcher itself where that is safe (`_fork_in_place`), else a fresh interpreter."""

    def __init__(self, folder: str, modules: list[str], env: dict[str, str]):
        self.path = os.path.join(folder, "workers.sock")
        env = {**os.environ, **env}
        torch = sys.modules.get("torch")
        threads = env.get("OMP_NUM_THREADS") or str(torch.get_num_threads() if torch else os.cpu_count() or 1)
        server_env = {
            **env,
            # one OpenMP thread while importing: an OpenMP pool in the server would be broken in
            # every forked child (each sets its own count, THREADS_ENV, after the fork)
            "OMP_NUM_THREADS": "1",
            THREADS_ENV: threads,
            # torch.cuda.is_available() through NVML: asking CUDA itself would make forking unsafe
            "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        }
        self.proc: subprocess.Popen | _ForkedServer | None = _fork_in_place(self.path, modules, server_env)
        if self.proc is None:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "suite.launch.fork_server",
                    self.path,
                    ",".join(modules),
                    str(os.getpid()),
                ],
                env=server_env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl-C goes to the launcher, which stops the workers
            )

    @property
    def address(self) -> str:
        return f"{self.proc.pid}:{self.path}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------- client


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _connect(address: str) -> socket.socket | None:
    """A connection to the server at "<pid>:<path>", once it listens; None if it is gone."""
    pid, path = address.split(":", 1)
    deadline = time.monotonic() + CONNECT_WAIT_S
    while time.monotonic() < deadline and _alive(int(pid)):
        if os.path.exists(path):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(path)
                return conn
            except OSError:
                conn.close()
        time.sleep(0.02)
    return None


def forward(module: str, argv: list[str], address: str) -> int | None:
    """Run `module.main(argv)` in a process forked by the server and stand for it (see the module
    docstring). Returns its exit code, never returns if a signal killed it, and returns None if the
    server could not start it (the caller then runs it itself)."""
    pending: list[int] = []  # signals that arrive before the worker exists: passed on once it does
    worker = 0

    def pass_on(sig: int, _frame) -> None:
        if not worker:
            pending.append(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, sig)

    for sig in FORWARDED:
        signal.signal(sig, pass_on)
    conn = _connect(address)
    if conn is None or pending:
        _end_by(pending)
        return None
    with conn:
        request = {"module": module, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
        try:
            _send(conn, request, fds=[0, 1, 2])
            started, _ = _receive(conn)
        except OSError:
            started = None
        if started is None:
            _end_by(pending)
            return None
        worker = int(started["pid"])
        for sig in pending:
            pass_on(sig, None)
        ended, _ = _receive(conn)
    if ended is None:
        print(f"error: the worker server ended before worker {worker} did", file=sys.stderr, flush=True)
        return 1
    code = int(ended["exit"])
    if code < 0:  # killed by a signal: end the same way, so the agent reports that signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(5)
    return code


def _end_by(signals: list[int]) -> None:
    """A signal came before there was a worker to pass it to: end by the first one, as the process
    it was meant for would have (its default action), and restore the defaults otherwise."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    if signals:
        os.kill(os.getpid(), signals[0])
        time.sleep(5)


def client_command(module: str, argv: list[str]) -> list[str]:
    """The command of a process that stands for `module.main(argv)` run by the server whose address
    is in its environment (SERVER_ENV), or runs it itself when there is none."""
    return [sys.executable, "-m", "suite.launch.fork_server", "--client", module, *argv]


def _client_main(module: str, argv: list[str]) -> int:
    address = os.environ.get(SERVER_ENV)
    code = forward(module, argv, address) if address else None
    return run_main(module, argv, module != WORKER_MODULE) if code is None else code


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        code = _client_main(sys.argv[2], sys.argv[3:])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    serve(sys.argv[1], [m for m in sys.argv[2].split(",") if m], int(sys.argv[3]))
