"""Reading a file an operator wrote (policy, local jobs, power domains, topology, tokens,
controller config, job specs, plans): text or one short reason why not, never a traceback.

Every reader names its own file in its own message; what they share is the reason, so a
binary file, a directory or a YAML typo reads the same wherever it was given.
"""

from __future__ import annotations

from pathlib import Path

import yaml


class Unreadable(Exception):
    """A file that cannot be read as UTF-8 text; ``reason`` is one short line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_text(path: str | Path) -> str:
    """The file's text, or :class:`Unreadable` with the OS's reason ("No such file or
    directory", "Is a directory", ...) or "not UTF-8 text"."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise Unreadable(exc.strerror or type(exc).__name__) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable("not UTF-8 text") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for PyYAML's multi-line error: the problem and where it was found."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or (str(exc).strip().splitlines() or [""])[0]
    return " ".join(f"{problem or type(exc).__name__}{where}".split())
