"""Reading a file an operator wrote (policy, local jobs, power domains, topology, tokens,
controller config, job specs, plans): text or one short reason why not, never a traceback.

Every reader names its own file in its own message; what they share is the reason, so a
binary file, a directory or a YAML typo reads the same wherever it was given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


#: The ``json`` module's and PyYAML's parsers recurse once per level; past Python's limit
#: they raise RecursionError, which no caller expects. No operator file nests this deep.
TOO_DEEP = "nested too deeply"


class Unparsable(Exception):
    """Text that does not decode as the document it claims to be; ``reason`` is one line
    with no file name ("duplicate key 'rules' at line 4"), so each reader names its file."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader (the same tags, the same aliases), refusing a mapping
    that gives a key twice.

    PyYAML keeps the last value silently: a file with two ``nodes:`` keys loses the first
    list, and a policy with two ``rules:`` loses the first rules, with no word to anyone.
    Keys a merge (``<<: *base``) brings in may still be overridden: that is what a merge
    is for; only keys written in the mapping itself must be unique.
    """

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        # Checked as composed, before any merge flattens a mapping in place: a mapping
        # merged from deeper in the file is flattened before it is constructed, and its
        # merged keys would then sit beside its own as if written twice.
        node: yaml.MappingNode = super().compose_mapping_node(anchor)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: construction says so
                continue
            if duplicate:
                raise Unparsable(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
            seen.add(key)
        return node


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` object hook: as YAML, a key given twice is refused, not overwritten."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise Unparsable(f"duplicate key {key!r}")
        out[key] = value
    return out


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` that refuses duplicate keys and deep nesting: the one way
    every operator file is decoded, so a mistake reads the same in every reader.

    :class:`Unparsable` carries the reason: PyYAML's problem and where (see
    :func:`yaml_problem`), a duplicate key and its line, or :data:`TOO_DEEP`.
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise Unparsable(yaml_problem(exc)) from None
    except RecursionError:
        raise Unparsable(TOO_DEEP) from None


def load_json(text: str) -> Any:
    """``json.loads(text)`` refusing duplicate keys and deep nesting (see :func:`load_yaml`);
    a syntax error reads "<problem> at line N" as it always did."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise Unparsable(f"{exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise Unparsable(TOO_DEEP) from None


def load_document(text: str, *, suffix: str = "") -> Any:
    """JSON for a ``.json`` suffix, YAML otherwise: the rule every reader follows."""
    return load_json(text) if suffix.lower() == ".json" else load_yaml(text)
