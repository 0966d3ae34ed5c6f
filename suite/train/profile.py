"""`train.profile=true`: a torch profiler trace of a few training steps and a table of the top operators.

The profiler follows torch.profiler.schedule: `profile_wait` steps skipped (the first step pays one-off
costs: allocations, lazy init, compilation), `profile_warmup` traced and discarded, `profile_steps`
recorded. When the window closes each rank writes `<run.dir>/profile/trace_rank<r>.json` (a chrome
trace: open it in https://ui.perfetto.dev or chrome://tracing) and `top_ops_rank<r>.txt`, the operators
sorted by self time (CUDA time first on a GPU); rank 0 also prints its table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from suite.config.schema import TrainConfig

TOP_OPS = 15  # rows of the printed table


class StepProfiler:
    """Profile a window of training steps; call `step()` after each training step, `close()` at the end."""

    def __init__(
        self, cfg: TrainConfig, run_dir: Path, device: torch.device, rank: int, log: Callable[[str], None]
    ):
        self.folder = Path(run_dir) / "profile"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.log = log
        self.cuda = device.type == "cuda"
        self.written = False
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(
            activities=activities,
            schedule=schedule(
                wait=cfg.profile_wait, warmup=cfg.profile_warmup, active=cfg.profile_steps, repeat=1
            ),
            on_trace_ready=self._write,
        )
        self.profiler.start()
        self.skipped = cfg.profile_wait + cfg.profile_warmup

    def _write(self, prof: profile) -> None:
        trace = self.folder / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=TOP_OPS)
        (self.folder / f"top_ops_rank{self.rank}.txt").write_text(table + "\n")
        self.written = True
        self.log(f"profile: top operators by {sort_by} (trace: {trace})\n{table}")

    def step(self) -> None:
        self.profiler.step()

    def close(self) -> None:
        """Stop the profiler; a window the run cut short is still written."""
        self.profiler.stop()
        if not self.written:
            self.log(
                f"profile: the run ended before a step was recorded (train.profile_wait + train.profile_warmup "
                f"= {self.skipped} steps); lower them or raise train.max_steps"
            )
