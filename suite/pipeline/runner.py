"""`suite run pipeline=<name>`: every stage as a subprocess of the same CLI, in order, resumable.

On a machine without a GPU the stages are forked from one process per run that imported torch and
the suite once (suite/launch/fork_server.py), which saves each stage a fresh interpreter's ~4 s of imports;
each stage is still a process of its own, with its own exit code, stopped by SIGTERM.

A stage that finished left a marker (<dir>/logs/<stage>.done.json: the command it ran, a digest of
that command and of the outputs it read, the fingerprint of its own outputs, its result). On a rerun
a stage is skipped when its marker's digest is the one it would run with now and its outputs still
verify; a stage without a marker runs again with the same command, so a training stage resumes from
its newest checkpoint (its own train.resume) and any other stage starts its folder clean. `--from`
and `--only` rerun stages from scratch. A stage that starts clean or from scratch has its old folder
moved aside to <folder>.old-<N> (suite.folders' rule for every folder), never deleted. Quality gates
are checked as soon as their stages have finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from suite import folders
from suite.config.errors import ConfigError
from suite.config.schema import LaunchConfig
from suite.launch.fork_server import SERVER_ENV, ForkServer, client_command
from suite.launch.launcher import WORKER_PRELOAD, forks_workers
from suite.pipeline import outputs
from suite.pipeline.recipe import Gate, Pipeline, Stage
from suite.pipeline.report_file import write_report
from suite.verb import VERBS

GATE_EXIT = 3  # a quality gate stopped the pipeline
# what most stages import beyond a worker's, imported once by the run's fork server
STAGE_PRELOAD = ("transformers", "suite.cli.dispatch", "suite.infer.generate", "suite.config.compose")
RECORD = "pipeline.json"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def made_by(pipeline: Pipeline) -> dict[str, Any]:
    """What a pipeline's folder records (suite.folders): which pipeline, with which stages. Another
    pipeline, or this one with stages added or removed, is another thing: its folders would lie
    beside stages built from another model."""
    stages = [s.name for s in pipeline.stages]
    return folders.made_by("run", None, {"pipeline": pipeline.name, "stages": stages})


def _legacy(folder: Path) -> dict[str, Any] | None:
    """A pipeline folder written before made_by.json: its pipeline.json names the pipeline and stages."""
    try:
        data = json.loads((folder / RECORD).read_text())
        stages = [s["name"] for s in data["stages"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"verb": "run", "settings": {"pipeline": data.get("pipeline"), "stages": stages}}


class Run:
    def __init__(
        self,
        pipeline: Pipeline,
        start: str | None,
        only: str | None,
        overwrite: bool = False,
        overrides: list[str] | None = None,
    ):
        self.p = pipeline
        self.overwrite = overwrite
        # the command line's pipeline=, run.dir= and stage overrides, as typed: a suggested command repeats them
        self.overrides = overrides if overrides is not None else [f"pipeline={pipeline.recipe}"]
        self.logs = pipeline.dir / "logs"
        names = [s.name for s in pipeline.stages]
        if start and only:
            raise ConfigError("--from and --only do not go together; pass one of them")
        if start:
            chosen = pipeline.stage(start, "--from").name
            self.selected = set(names[names.index(chosen) :])
        elif only:
            self.selected = {pipeline.stage(only, "--only").name}
        else:
            self.selected = set(names)
        self.forced = self.selected if (start or only) else set()
        self.server = None  # suite.launch.fork_server.ForkServer, started by the first stage that runs
        self.server_dir: str | None = None
        self.spawned = False  # whether a stage has run (a refusal before that leaves run.dir as it was)
        self.figures: dict[str, dict[str, Any]] = {}
        self.done: dict[str, dict[str, Any]] = {}  # stage name -> its marker
        self.records: dict[str, dict[str, Any]] = {
            s.name: {
                "name": s.name,
                "verb": s.verb,
                "folder": str(s.folder),
                "needs": s.needs,
                "command": _shown(s),
                "action": "not run",
                "status": "pending",
            }
            for s in pipeline.stages
        }
        self.gates: list[dict[str, Any]] = []
        self.status = "running"
        self.exit_code: int | None = None

    # ---- bookkeeping -------------------------------------------------------------------------
    def marker_path(self, stage: Stage) -> Path:
        return self.logs / f"{stage.name}.done.json"

    def digest(self, stage: Stage) -> str:
        inputs = {n: self.done[n]["output"] for n in stage.needs if n in self.done}
        text = json.dumps({"argv": stage.argv(), "inputs": inputs}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def save(self) -> None:
        _write_json(
            self.p.dir / RECORD,
            {
                "pipeline": self.p.name,
                "recipe": str(self.p.recipe),
                "dir": str(self.p.dir),
                "status": self.status,
                "exit_code": self.exit_code,
                "stages": list(self.records.values()),
                "figures": self.figures,
                "gates": self.gates,
            },
        )

    def finished(self, stage: Stage, marker: dict[str, Any], action: str) -> None:
        self.done[stage.name] = marker
        for name, row in marker["figures"].items():
            outputs.merge(self.figures, {name: row}, stage)
        self.records[stage.name].update(
            action=action,
            status="done",
            seconds=marker.get("seconds"),
            result=marker.get("result"),
            figures=marker["figures"],
            output=marker["output"],
        )

    def valid_marker(self, stage: Stage) -> tuple[dict[str, Any] | None, str]:
        """(marker, '') when the stage finished and its outputs verify; else (None, why not)."""
        path = self.marker_path(stage)
        if not path.is_file():
            return None, "not finished"
        try:
            marker = json.loads(path.read_text())
            now = outputs.fingerprint(stage)
        except (ConfigError, ValueError, OSError) as exc:
            return None, f"its outputs do not verify ({exc})"
        if now != marker.get("output"):
            return None, "its outputs changed since it finished"
        return marker, ""

    # ---- one stage ---------------------------------------------------------------------------
    def header(self, stage: Stage, text: str) -> None:
        index = self.p.stages.index(stage) + 1
        print(f"==> [{index}/{len(self.p.stages)}] {stage.name}: {text}", flush=True)

    def clear(self, stage: Stage) -> None:
        """Start a stage from scratch: its marker goes; its folder, whatever the stage's verb (a run, a
        quantized checkpoint, an export, an eval's result), is moved aside to <folder>.old-<N> as
        every folder the suite replaces is (suite.folders.move_aside), never deleted."""
        self.marker_path(stage).unlink(missing_ok=True)
        folder = stage.folder
        if not folder.is_dir() or not any(folder.iterdir()):
            with contextlib.suppress(OSError):
                folder.rmdir()  # nothing in it to keep
            return
        moved = folders.move_aside(folder, "run.dir", "--from/--only")
        print(f"    moved the earlier {folder} aside to {moved.name}", flush=True)

    def run_stage(self, stage: Stage) -> int:
        forced = stage.name in self.forced
        marker, why = self.valid_marker(stage)
        if marker is not None and not forced and marker.get("digest") == self.digest(stage):
            self.header(stage, f"finished earlier ({outputs.describe(marker['output'])}); skipped")
            self.finished(stage, marker, "skipped")
            return 0
        resume = False
        if forced:
            self.clear(stage)
        elif marker is not None:  # finished with another command or other inputs
            print(
                f"    {stage.name} changed since it finished (its command or its inputs); rerunning",
                flush=True,
            )
            self.clear(stage)
        elif self.marker_path(stage).is_file() or stage.output != "run":
            if self.marker_path(stage).is_file():
                print(f"    {stage.name}: {why}; rerunning", flush=True)
            self.clear(stage)
        else:
            resume = stage.folder.exists()
        self.header(stage, ("resuming: " if resume else "") + _shown(stage))
        self.records[stage.name].update(action="resumed" if resume else "ran", status="running")
        self.save()
        start = time.perf_counter()
        code, printed = self.spawn(stage)
        seconds = round(time.perf_counter() - start, 1)
        if code != 0:
            self.records[stage.name].update(status="failed", exit_code=code, seconds=seconds)
            return code
        if stage.output == "result":
            stage.folder.mkdir(parents=True, exist_ok=True)
            _write_json(stage.folder / outputs.RESULT, printed or {})
        result = outputs.read_result(stage, printed)
        marker = {
            "stage": stage.name,
            "command": _shown(stage),
            "digest": self.digest(stage),
            "output": outputs.fingerprint(stage),
            "result": result,
            "figures": outputs.figures(stage, result),
            "seconds": seconds,
        }
        _write_json(self.marker_path(stage), marker)
        self.finished(stage, marker, "resumed" if resume else "ran")
        return 0

    def spawn(self, stage: Stage) -> tuple[int, dict[str, Any] | None]:
        """`python -m suite <verb> ...`, its stdout and stderr streamed here and into logs/<stage>.log;
        returns the exit code and the last JSON object it printed on stdout."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        command = [sys.executable, "-m", "suite", *stage.argv()]
        self.spawned = True
        server = self.fork_server(env)
        if server is not None:
            env[SERVER_ENV] = server.address
            command = client_command("suite.cli", stage.argv())
        log = open(self.logs / f"{stage.name}.log", "a", encoding="utf-8")  # noqa: SIM115 (closed below)
        log.write(f"$ {_shown(stage)}\n")
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # the stage saves and stops

        def pump_stderr() -> None:
            for line in proc.stderr:
                sys.stderr.write(line)
                sys.stderr.flush()
                log.write(line)

        thread = threading.Thread(target=pump_stderr, daemon=True)
        thread.start()
        printed = None
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                if line.startswith("{"):
                    with contextlib.suppress(ValueError):
                        printed = json.loads(line)
            code = proc.wait()
        except KeyboardInterrupt:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
            thread.join(timeout=5)
            log.close()
        return code, printed if isinstance(printed, dict) else None

    def fork_server(self, env: dict[str, str]):
        """The run's fork server, started on first use where workers would fork too (no GPU)."""
        if self.server is None and self.server_dir is None:
            self.server_dir = tempfile.mkdtemp(prefix="suite-run-")
            if forks_workers(LaunchConfig(), "auto") and len(self.server_dir) < 90:
                preload = [
                    *WORKER_PRELOAD,
                    *(m for v in VERBS.values() for m in v.rank_imports),
                    *STAGE_PRELOAD,
                ]
                self.server = ForkServer(self.server_dir, preload, env)
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.server_dir is not None:
            shutil.rmtree(self.server_dir, ignore_errors=True)

    # ---- gates -------------------------------------------------------------------------------
    def model_of(self, name: str) -> str:
        stage = self.p.stage(name, "gate")
        return stage.measures or stage.name

    def gate_ready(self, gate: Gate, index: int) -> bool:
        """A gate is checked after the last stage that gives figures about its stages."""
        models = {self.model_of(n) for n in gate.stages}
        last = max(
            i
            for i, s in enumerate(self.p.stages)
            if s.name in models or s.measures in models or s.name in gate.stages
        )
        return last == index

    def check_gate(self, gate: Gate) -> str | None:
        """None when the gate passes; else the one line that stops the pipeline."""
        of, vs = self.model_of(gate.of), self.model_of(gate.vs) if gate.vs else None
        for name in [of] + ([vs] if vs else []):
            if gate.metric not in self.figures.get(name, {}):
                raise ConfigError(
                    f"gate '{gate.name}': stage {name} has no {gate.metric} figure; measure it with an eval "
                    f'stage (e.g. verb: eval, args: ["ckpt=${{stage:{name}}}"])'
                )
        a = self.figures[of][gate.metric]
        b = self.figures[vs][gate.metric] if vs else None
        record = {
            "name": gate.name,
            "metric": gate.metric,
            "of": of,
            "vs": vs,
            gate.limit: gate.value,
            "value": a,
        }
        if vs:
            record["reference"] = b
        if gate.limit == "max_drop":
            ok, says = b - a <= gate.value + 1e-12, f"{_fmt(a)}, {_fmt(b - a)} below {vs}'s {_fmt(b)}"
        elif gate.limit == "max_rise":
            ok, says = a - b <= gate.value + 1e-12, f"{_fmt(a)}, {_fmt(a - b)} above {vs}'s {_fmt(b)}"
        elif gate.limit == "min":
            ok, says = a >= gate.value, _fmt(a)
        else:
            ok, says = a <= gate.value, _fmt(a)
        record["passed"] = ok
        self.gates.append(record)
        line = f"gate '{gate.name}': {gate.metric} of {of} is {says} ({gate.limit} {_fmt(gate.value)})"
        print(f"    {line}: {'passed' if ok else 'FAILED'}", flush=True)
        return None if ok else line

    # ---- the whole run -----------------------------------------------------------------------
    def run(self) -> int:
        # every refusal before anything is written or moved: another pipeline's folder, a stage asked
        # for that reads one that has not finished; a refused run leaves run.dir as it was (or absent)
        made = made_by(self.p)
        moves = folders.check_claim(self.p.dir, made, "run.dir", self.overwrite, legacy=_legacy)
        self.check_unfinished(fresh=moves)
        moved = folders.claim(self.p.dir, made, "run.dir", self.overwrite, legacy=_legacy)
        before = {p.name for p in self.p.dir.iterdir()} if self.p.dir.is_dir() else None
        folders.write_record(self.p.dir, made)
        self.logs.mkdir(exist_ok=True)
        print(f"suite run pipeline={self.p.name}: {len(self.p.stages)} stages in {self.p.dir}", flush=True)
        refused = False
        try:
            return self._run()
        except ConfigError:
            refused = not self.spawned  # a refusal before any stage ran (a gate without its figures)
            raise
        finally:
            self.close()
            if refused:
                self.undo(before, moved)
            else:
                self.save()
                written = write_report(self.p, self.records, self.figures, self.gates, self.status)
                print(f"wrote {self.p.dir / RECORD}, {', '.join(str(p) for p in written)}", flush=True)

    def undo(self, before: set[str] | None, moved: Path | None = None) -> None:
        """After a refusal before any stage ran: take away what this command wrote (its record, an
        empty logs/), so run.dir is as it was, or absent when it was (`before`: its entries then);
        content that --overwrite moved aside (`moved`) is moved back."""
        if before is None:
            shutil.rmtree(self.p.dir, ignore_errors=True)
            if moved is not None:
                moved.rename(self.p.dir)
                print(f"moved {moved} back to {self.p.dir}: nothing ran", flush=True)
            return
        for entry in self.p.dir.iterdir():
            if entry.name in before:
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def check_unfinished(self, fresh: bool) -> None:
        """Refuse (before anything is written) a stage asked for that reads a stage left out which has
        not finished. `fresh`: run.dir's content is about to be moved aside, so nothing has finished."""
        for stage in self.p.stages:
            if stage.name in self.selected:
                continue
            marker, why = (None, "not finished") if fresh else self.valid_marker(stage)
            if marker is None and any(
                stage.name in s.needs for s in self.p.stages if s.name in self.selected
            ):
                again = shlex.join(["suite", "run", *self.overrides, "--from", stage.name])
                raise ConfigError(
                    f"stage '{stage.name}' has not finished ({why}) and a stage you asked for reads it; "
                    f"run it first with `{again}`"
                )

    def _run(self) -> int:
        for index, stage in enumerate(self.p.stages):
            if stage.name not in self.selected:
                marker, _ = self.valid_marker(stage)
                if marker is not None:
                    self.finished(stage, marker, "kept")
            else:
                code = self.run_stage(stage)
                self.save()
                if code != 0:
                    self.status, self.exit_code = "failed", code
                    print(
                        f"error: stage '{stage.name}' (suite {stage.verb}) failed with exit code {code}; its log: "
                        f"{self.logs / (stage.name + '.log')}; run the same command again to go on from it",
                        file=sys.stderr,
                        flush=True,
                    )
                    return code
            for gate in self.p.gates:
                if self.gate_ready(gate, index) and all(self.model_of(n) in self.done for n in gate.stages):
                    failed = self.check_gate(gate)
                    if failed:
                        self.status, self.exit_code = "stopped by a gate", GATE_EXIT
                        later = [s.name for s in self.p.stages[index + 1 :]]
                        stop = f"; not run: {', '.join(later)}" if later else ""
                        print(f"error: {failed}{stop}", file=sys.stderr, flush=True)
                        return GATE_EXIT
        self.status, self.exit_code = "done", 0
        return 0


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _shown(stage: Stage) -> str:
    return "suite " + " ".join(shlex.quote(a) for a in stage.argv())
