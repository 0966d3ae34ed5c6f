"""A `main(argv)` for tests/unit/test_fork_server.py to run through suite.launch.fork_server: it reports
its process, then exits with a code, kills itself with a signal, or waits for SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    action, value = argv
    print(f"pid={os.getpid()} ppid={os.getppid()} env={os.environ.get('FORK_TARGET_ENV', '')}", flush=True)
    print(f"cwd={os.getcwd()}", file=sys.stderr, flush=True)
    if action == "exit":
        return int(value)
    if action == "signal":
        os.kill(os.getpid(), int(value))
        time.sleep(5)
    if action == "term":  # wait for SIGTERM, then exit with `value`
        signal.signal(signal.SIGTERM, lambda *_: os._exit(int(value)))
        print("waiting", flush=True)
        time.sleep(60)
    if action == "raise":
        raise SystemExit(value)
    if action == "threads":  # the intra-op thread count this process runs with
        import torch

        print(f"threads={torch.get_num_threads()}", flush=True)
        return 0
    return 99
