"""The ways on that a one-line refusal prints, read one way for every refusal and applied to the command
that was refused, so a test runs each suggestion as a user would type it (issue 39: every fix we
suggest works).

A refusal reads `error: <what is wrong>; <what would work>`: the advice is what follows the first "; "
outside brackets, quotes and backticks (in a line without one: its closing ", e.g. <example>"). It offers ways on, separated by ", or " / " or " (outside
brackets); each way is made of

- commands in backticks (`iconv ... > NEW`, `suite prepare ...`), run first, as written, by a shell;
  a command that writes `> NEW`, or `cp OLD NEW` / `mv OLD NEW`, makes NEW stand in for the file it
  reads (every argument naming that file names NEW instead);
- `key=value` arguments, which replace the command's arguments of that key (a short key such as
  out= stands for export.out=); a value with spaces, commas or quotes comes in the double quotes the
  shell needs ("key='a b,c'") and is taken as the shell would hand it over;
- `--flag`s, added to the command;
- `drop key=`, which removes the command's arguments of that key.

A value with a placeholder (`<...>`, `...`, the grammar's `key=value`) is no way on: a refusal names the value to type. A part of
the advice with none of these (prose: "must be positive") offers no way.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from suite.config.compose import SHORTCUTS

_OPEN, _CLOSE = "([{", ")]}"
KEY = r"[a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*"
_QUOTED_ARG = re.compile(rf'"({KEY}=[^"]*)"')
_DROP = re.compile(rf"\bdrop ({KEY})=(?=[\s,;)]|$)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z-]*)\b")
_ARG = re.compile(rf"(?<![\w.=/'\"-])({KEY}=[^\s;,()'\"`]+)")


@dataclass
class Way:
    """One way on: shell commands to run first, then the refused command with these edits."""

    commands: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.commands or self.args or self.flags or self.drops)

    def apply(self, argv: list[str]) -> list[str]:
        """The refused command (verb and its arguments) with this way's edits."""
        replaced = {_key(a) for a in self.args} | {_full(k) for k in self.drops}
        out = [a for a in argv if "=" not in a or _key(a) not in replaced]
        for command in self.commands:
            if ">" in command:  # the file it writes stands in for the file it reads (`tool ... FILE`)
                new = shlex.split(command.rsplit(">", 1)[1])[0]
                read = shlex.split(command.split(">")[0].split("|")[0])[-1]
                out = [a.replace(read, new) for a in out]
            elif shlex.split(command)[0] in ("cp", "mv"):  # the copy (or new name) stands in for the file
                read, new = shlex.split(command)[-2:]
                out = [a.replace(read, new) for a in out]
        out += self.args
        out += [f for f in self.flags if f not in out]
        return out


def _full(key: str) -> str:
    return SHORTCUTS.get(key, key)


def _key(arg: str) -> str:
    return _full(arg.split("=", 1)[0].lstrip("+~"))


def _split_top(text: str, separators: re.Pattern) -> list[str]:
    """`text` cut at every match of `separators` outside brackets, double quotes and backticks."""
    parts, depth, quote, start, i = [], 0, None, 0, 0
    while i < len(text):
        char = text[i]
        if quote:
            quote = None if char == quote else quote
        elif char in '"`':
            quote = char
        elif char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth = max(0, depth - 1)
        elif depth == 0 and (match := separators.match(text, i)):
            parts.append(text[start:i])
            start = i = match.end()
            continue
        i += 1
    parts.append(text[start:])
    return parts


def advice(line: str) -> str:
    """What follows the first top-level "; " of a refusal, or in a line without one its closing
    example (`must be in (0, 1], e.g. generate.top_p=0.95`); empty when it gives no advice."""
    parts = _split_top(line.removeprefix("error: "), re.compile("; "))
    if len(parts) == 1:
        parts = _split_top(parts[0], re.compile(", e[.]g[.] "))
        return parts[-1] if len(parts) > 1 else ""
    return "; ".join(parts[1:])


SYNTAX = ("key=value", "group=option")  # the grammar's own names, not values to type


def _placeholder(value: str) -> bool:
    return "<" in value or "..." in value or value in SYNTAX


def ways_on(line: str) -> list[Way]:
    """Every way on the refusal `line` offers, in its order (see the module docstring)."""
    ways = []
    for part in _split_top(advice(line), re.compile(r",? or ")):
        way = Way()
        way.commands = [c for c in re.findall(r"`([^`]+)`", part) if not _placeholder(c)]
        rest = re.sub(r"`[^`]*`", " ", part)
        for quoted in _QUOTED_ARG.findall(rest):
            if not _placeholder(quoted):
                way.args.append(shlex.split(f'"{quoted}"')[0])
        rest = _QUOTED_ARG.sub(" ", rest)
        way.drops = _DROP.findall(rest)
        rest = _DROP.sub(" ", rest)
        way.flags = _FLAG.findall(rest)
        for arg in _ARG.findall(_FLAG.sub(" ", rest)):
            arg = arg.rstrip(".:?!")
            if not _placeholder(arg) and not arg.endswith("="):
                way.args = [a for a in way.args if _key(a) != _key(arg)] + [arg]
        if way:
            ways.append(way)
    return ways
