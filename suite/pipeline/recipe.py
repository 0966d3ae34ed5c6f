"""A pipeline recipe (recipes/pipeline/<name>.yaml): its stages, what each reads, its quality gates.

    run:
      dir: runs/pipeline-embedded          # the pipeline's folder; stage <name> writes <dir>/<name>/
    stages:                                # in order; each is one `suite <verb>` with its overrides
      pretrain:
        args: [train.max_steps=250]        # verb: the stage's name when that is a verb
      sft:
        verb: finetune
        args: [recipe=sft-tiny, "model.init_from=${stage:pretrain}"]
      eval-sft:
        verb: eval
        args: ["ckpt=${stage:sft}"]
    gates:                                 # checked once both stages have figures
      - {metric: accuracy, of: int8, vs: sft, max_drop: 0.02}

`${stage:NAME}` is the folder stage NAME wrote (a run folder, an export folder): the only way a stage
names another's output, so no path is ever copied. A stage never sets its own output (run.dir, out,
data.path): the pipeline gives it <dir>/<name>. Errors are one line (ConfigError, exit 2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from suite import user_files
from suite.config.compose import (
    compose_config,
    expand_shortcuts,
    known_options,
    recipe_search_dirs,
    to_object,
)
from suite.config.errors import ConfigError
from suite.output_paths import check_output_folder
from suite.verb import VERBS, check_keys, stage_verbs

REF = re.compile(r"\$\{stage:([^}]*)\}")
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
RESERVED = ("pipeline", "run", "logs")  # command-line keys, the folder of the stage logs
ALIASES = {"out": "export.out"}  # the verbs' short keys that name an output
GATE_LIMITS = ("max_drop", "max_rise", "min", "max")
METRICS = ("accuracy", "perplexity", "params", "bytes", "decode_tokens_per_s")


@dataclass
class Stage:
    name: str
    verb: str
    args: list[str]  # as written, `${stage:...}` resolved
    needs: list[str]  # the stages it reads, in order of mention
    folder: Path
    overrides: list[str] = field(
        default_factory=list
    )  # the command line's <stage>.<key>=<value>, last in args

    @property
    def output(self) -> str:
        """What the stage leaves behind (suite.verb.STAGE_OUTPUTS): a run, a checkpoint, files, a result."""
        return VERBS[self.verb].stage_output

    @property
    def measures(self) -> str | None:
        """The stage whose model a stage with a result (eval, generate) measures (its first reference)."""
        return self.needs[0] if self.output == "result" and self.needs else None

    def argv(self) -> list[str]:
        """`suite <verb> ...` as the pipeline runs it: the stage's args, then its output folder."""
        key = VERBS[self.verb].output_key
        extra = [f"{key}={self.folder}"] if key else []
        return [self.verb, *self.args, *extra, "--json"]


@dataclass
class Gate:
    metric: str
    of: str
    vs: str | None
    limit: str
    value: float
    name: str

    @property
    def stages(self) -> list[str]:
        return [self.of] + ([self.vs] if self.vs else [])


@dataclass
class Pipeline:
    name: str
    recipe: Path
    dir: Path
    stages: list[Stage]
    gates: list[Gate] = field(default_factory=list)

    def stage(self, name: str, what: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise ConfigError(
            f"{what}: '{name}' is not a stage of pipeline '{self.name}'; stages: "
            f"{', '.join(s.name for s in self.stages)}"
        )


def pipeline_options() -> list[str]:
    return known_options("pipeline")


def find_recipe(value: str | None) -> Path:
    """pipeline=NAME (recipes/pipeline/NAME.yaml on the recipe search path) or pipeline=PATH.yaml."""
    known = ", ".join(pipeline_options()) or "none"
    if not value:
        raise ConfigError(f"pipeline is missing; pass pipeline=<name> (known: {known}) or pipeline=./my.yaml")
    if value.endswith((".yaml", ".yml")) or "/" in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(f"pipeline='{value}' is not a file; known pipelines: {known}")
        return path
    for folder in recipe_search_dirs():
        if (folder / "pipeline" / f"{value}.yaml").is_file():
            return folder / "pipeline" / f"{value}.yaml"
    raise ConfigError(f"pipeline='{value}' is not a known pipeline; known: {known} (or pipeline=./my.yaml)")


def _read_yaml(path: Path) -> dict[str, Any]:
    """The recipe as plain data; a YAML syntax error is one line, file:line:column (suite.user_files)."""
    data = user_files.read_yaml(path, "pipeline recipe")
    if not isinstance(data, dict):
        raise ConfigError(f"pipeline recipe {path} is not a mapping with stages:")
    return data


def load_pipeline(overrides: list[str]) -> Pipeline:
    """The pipeline the command line names, with its overrides: pipeline=, run.dir=, and
    <stage>.<key>=<value> (appended to that stage's args, so it wins over the recipe's)."""
    values: dict[str, str] = {}
    per_stage: list[tuple[str, str]] = []
    for text in overrides:
        key, sep, value = text.partition("=")
        if not sep:
            raise ConfigError(f"'{text}' is not key=value; e.g. suite run pipeline=embedded")
        if key in ("pipeline", "run.dir"):
            values[key] = value
        elif "." in key:
            per_stage.append((key.split(".", 1)[0], f"{key.split('.', 1)[1]}={value}"))
        else:
            raise ConfigError(
                f"{key}={value} is not a key of suite run; pass pipeline=NAME, run.dir=DIR, or "
                "<stage>.<key>=<value> (e.g. pretrain.train.max_steps=100)"
            )
    path = find_recipe(values.get("pipeline"))
    data = _read_yaml(path)
    name = path.stem
    unknown = set(data) - {"run", "stages", "gates"}
    if unknown:
        raise ConfigError(
            f"pipeline recipe {path}: unknown key '{sorted(unknown)[0]}'; keys: run, stages, gates"
        )
    run = data.get("run") or {}
    folder = Path(values.get("run.dir") or run.get("dir") or f"runs/pipeline-{name}").expanduser()
    fix = "pass run.dir={folder} (a folder you can write)"
    check_output_folder("run.dir", str(folder), fix if values.get("run.dir") else f"{fix} (or edit {path})")
    raw_stages = data.get("stages")
    if not isinstance(raw_stages, dict) or not raw_stages:
        raise ConfigError(f"pipeline recipe {path} has no stages: (a mapping of stage name to verb and args)")
    stages: list[Stage] = []
    for stage_name, body in raw_stages.items():
        stages.append(_stage(str(stage_name), body or {}, folder, stages, path))
    pipeline = Pipeline(name, path, folder, stages)
    for stage_name, arg in per_stage:
        stage = pipeline.stage(stage_name, f"override {stage_name}.{arg}")
        stage.args.append(_resolve(arg, stage, stages[: stages.index(stage)]))
        stage.overrides.append(stage.args[-1])
        _check_output_keys(stage, path)
    pipeline.gates = [_gate(g, pipeline, path) for g in data.get("gates") or []]
    for stage in stages:
        _check_stage_args(stage, pipeline)
    return pipeline


def _compose_stage(stage: Stage, args: list[str]) -> None:
    """`args` as the stage's verb would read them; ConfigError when it would refuse them."""
    verb = VERBS[stage.verb]
    args = expand_shortcuts([a for a in args if a.split("=", 1)[0] not in ("prompt", "generate.prompt")])
    if verb.default_recipe and not any(a.split("=", 1)[0] == "recipe" for a in args):
        args = [f"recipe={verb.default_recipe}", *args]
    check_keys(verb, args)
    to_object(compose_config(args))


def _check_stage_args(stage: Stage, pipeline: Pipeline) -> None:
    """Each stage's command composed here, before any stage runs or any folder is moved: a key its
    verb does not read or the config does not have, or a value of the wrong type, stops the whole
    run in one line naming the stage. (A prompt is taken verbatim by `suite generate`, not parsed.)
    A refused override from the command line is named as typed (`int8.optim.lr=...`), and so is the
    key its advice gives (`drop int8.optim.lr=`), so the advice can be typed as printed."""
    try:
        _compose_stage(stage, stage.args)
        return
    except ConfigError as exc:
        refused = exc
    base = stage.args[: len(stage.args) - len(stage.overrides)]
    for index, override in enumerate([None, *stage.overrides]):
        try:
            _compose_stage(stage, base + stage.overrides[:index])
        except ConfigError as exc:
            if override is None:  # the recipe's own args
                raise ConfigError(f"stage '{stage.name}' (suite {stage.verb}): {exc}") from None
            raise _override_error(stage, stage.overrides[index - 1], exc, pipeline) from None
    raise ConfigError(f"stage '{stage.name}' (suite {stage.verb}): {refused}") from None


def _override_error(stage: Stage, override: str, exc: ConfigError, pipeline: Pipeline) -> ConfigError:
    """The one line for a refused command-line override `<stage>.<override>`: the keys of its advice
    are the stage's (typed with the stage's name in front); an override of a section the stage's verb
    does not read (optim on quantize) is pointed at the stage it reads that does read it (the one
    that trains the model it quantizes), where the setting would take effect."""
    key, _, value = override.partition("=")
    key = key.lstrip("+~")
    section = key.split(".", 1)[0]
    verb = VERBS[stage.verb]
    lead = f"stage '{stage.name}' (suite {stage.verb}): "
    if section in verb.unused and key not in verb.hints:
        upstream = _reader_upstream(stage, section, pipeline)
        there = (
            f", or drop {stage.name}.{key}= and pass {upstream.name}.{override} (stage '{upstream.name}', "
            f"which '{stage.name}' reads, runs suite {upstream.verb}: the {section} settings take effect there)"
            if upstream
            else ""
        )
        return ConfigError(
            f"{lead}{stage.name}.{override}: suite {stage.verb} does not read {section}; "
            f"drop {stage.name}.{key}={there}"
        )
    text = str(exc)
    what, sep, advice = text.partition("; ")
    advice = STAGE_KEY.sub(lambda m: f"{m.group(1)}{stage.name}.{m.group(2)}=", advice)
    return ConfigError(f"{lead}{what}{sep}{advice}")


# a key=, in a refusal's advice, that names a key of the stage's command: given the stage's name in front
STAGE_KEY = re.compile(r"(^|[\s(\"'])([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*)=")


def _reader_upstream(stage: Stage, section: str, pipeline: Pipeline) -> Stage | None:
    """The nearest stage `stage` reads (directly or through others) whose verb reads `section`."""
    queue = list(stage.needs)
    while queue:
        other = pipeline.stage(queue.pop(0), "needs")
        if section not in VERBS[other.verb].unused:
            return other
        queue += other.needs
    return None


def _stage(name: str, body: Any, folder: Path, earlier: list[Stage], path: Path) -> Stage:
    where = f"pipeline recipe {path}, stage '{name}'"
    if not NAME.match(name) or name in RESERVED:
        raise ConfigError(
            f"{where}: a stage name is letters, digits, '-' and '_' (not {', '.join(RESERVED)})"
        )
    if not isinstance(body, dict) or set(body) - {"verb", "args"}:
        raise ConfigError(f"{where}: a stage has verb: and args: (a list of key=value strings)")
    verb = body.get("verb") or name
    if verb not in stage_verbs():
        raise ConfigError(
            f"{where}: verb '{verb}' is not one a pipeline runs; use one of: {', '.join(stage_verbs())}"
        )
    args = body.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
        raise ConfigError(f"{where}: args must be a list of key=value strings")
    stage = Stage(name, verb, [], [], folder / name)
    stage.args = [_resolve(str(a), stage, earlier) for a in args]
    _check_output_keys(stage, path)
    return stage


def _resolve(arg: str, stage: Stage, earlier: list[Stage]) -> str:
    def swap(match: re.Match) -> str:
        target = match.group(1).strip()
        for other in earlier:
            if other.name == target:
                if target not in stage.needs:
                    stage.needs.append(target)
                return str(other.folder)
        names = ", ".join(s.name for s in earlier) or "none"
        raise ConfigError(
            f"stage '{stage.name}': ${{stage:{target}}} is not an earlier stage; it can read: {names}"
        )

    return REF.sub(swap, arg)


def _check_output_keys(stage: Stage, path: Path) -> None:
    for arg in stage.args:
        key = arg.split("=", 1)[0]
        key = ALIASES.get(key, key)
        if key in ("run.dir", "export.out", "data.path") and key == VERBS[stage.verb].output_key:
            raise ConfigError(
                f"pipeline {path}, stage '{stage.name}' sets {arg.split('=', 1)[0]}; the pipeline gives every "
                f"stage its folder ({stage.folder}): drop it, and read other stages with ${{stage:NAME}}"
            )


def _gate(body: Any, pipeline: Pipeline, path: Path) -> Gate:
    where = f"pipeline recipe {path}, gate {body}"
    if not isinstance(body, dict):
        raise ConfigError(
            f"{where}: a gate is a mapping, e.g. {{metric: accuracy, of: int8, vs: sft, max_drop: 0.02}}"
        )
    unknown = set(body) - {"name", "metric", "of", "vs", *GATE_LIMITS}
    limits = [k for k in GATE_LIMITS if k in body]
    if unknown or len(limits) != 1 or "metric" not in body or "of" not in body:
        raise ConfigError(
            f"{where}: a gate has metric:, of:, optional vs: and name:, and one of {', '.join(GATE_LIMITS)}"
        )
    metric, limit = str(body["metric"]), limits[0]
    if metric not in METRICS:
        raise ConfigError(f"{where}: metric '{metric}' is not one of {', '.join(METRICS)}")
    if limit in ("max_drop", "max_rise") and "vs" not in body:
        raise ConfigError(f"{where}: {limit} compares two stages; add vs: <stage>")
    of = pipeline.stage(str(body["of"]), f"gate of: in {path}").name
    vs = pipeline.stage(str(body["vs"]), f"gate vs: in {path}").name if body.get("vs") else None
    try:
        value = float(body[limit])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {limit} must be a number") from None
    name = str(body.get("name") or f"{metric} {of}" + (f" vs {vs}" if vs else ""))
    return Gate(metric, of, vs, limit, value, name)
