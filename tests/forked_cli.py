"""The real CLI entry point, many times, at the cost of one interpreter start.

`python -m tests.forked_cli` imports suite's CLI (and torch) once, then answers one request per
line on stdin: it forks a child that does what `python -m suite <argv>` does (suite.__main__:
`sys.exit(main())`, an uncaught exception printed as a traceback with exit code 1) in the asked
working directory, with its stdin, stdout and stderr on files, and replies with the exit code.
`ForkedCLI` is the test side: `run(argv, cwd)` gives a CompletedProcess like `run_suite`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _child(request: dict) -> None:
    """In the forked child: become `python -m suite <argv>`; never returns."""
    code = 1
    try:
        out = Path(request["out"])
        os.chdir(request["cwd"])
        os.environ.update(request.get("env") or {})
        stdin = out / "stdin"
        stdin.write_bytes((request.get("stdin") or "").encode())
        write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for fd, path, flags in (
            (0, stdin, os.O_RDONLY),
            (1, out / "stdout", write),
            (2, out / "stderr", write),
        ):
            handle = os.open(path, flags, 0o644)
            os.dup2(handle, fd)
            os.close(handle)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (not the server's request pipe)
        from suite.launch.fork_server import run_main

        # what `python -m suite` does, exit functions included (logging, wandb, temporary files)
        code = run_main("suite.cli", request["argv"], exit_functions=True)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code if isinstance(code, int) else 1)


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return 124
        time.sleep(0.005)


def serve() -> None:
    sys.path[:] = [str(REPO) if p in ("", ".") else p for p in sys.path]
    import torch  # noqa: F401  (what every verb needs, imported once before forking)
    import torch.distributed.checkpoint  # noqa: F401
    from transformers import PreTrainedTokenizerFast  # noqa: F401  (the tokenizer of every run)

    import suite.cli.dispatch  # noqa: F401  (the CLI and every verb; suite.cli itself is kept light)
    import suite.infer.generate  # noqa: F401
    import suite.model_source  # noqa: F401
    import suite.report.plots  # noqa: F401  (matplotlib: every training run writes its report)
    import suite.train.trainer  # noqa: F401
    from suite.config.compose import compose_config

    compose_config([])  # Hydra's own lazy imports and caches, paid once
    # what many calls import lazily, 1-3 s each: torchao (quantize, QAT, quantized checkpoints) and the
    # ONNX exporter. Neither starts a thread; onnxruntime's and transformers' model classes' imports do,
    # so they stay out (a fork must not copy a process with threads)
    import onnxscript  # noqa: F401
    import torchao.quantization  # noqa: F401

    with contextlib.suppress(ImportError):  # torch's private module: only a speed-up
        import torch.onnx._internal.exporter._core  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"rc": _wait(pid, request.get("timeout", 120))}), flush=True)


class ForkedCLI:
    """One server process; `run` forks a child per call."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forked_cli"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError("the forked CLI server did not start")
        self.count = 0

    def run(
        self,
        argv: list[str],
        cwd: Path,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 120,
        out: Path | None = None,
    ) -> subprocess.CompletedProcess:
        self.count += 1
        out = Path(out or cwd.parent / f".forked-{self.count}")
        out.mkdir(parents=True, exist_ok=True)
        request = {
            "argv": argv,
            "cwd": str(cwd),
            "stdin": stdin,
            "env": env,
            "timeout": timeout,
            "out": str(out),
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        read = lambda name: (out / name).read_text(errors="replace") if (out / name).exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(argv, reply["rc"], read("stdout"), read("stderr"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve()
