"""Reading a file an operator wrote (policy, local jobs, power domains, topology, tokens,
controller config, job specs, plans): text or one short reason why not, never a traceback.

Every reader names its own file in its own message; what they share is the reason, so a
binary file, a directory or a YAML typo reads the same wherever it was given.

Only regular files are read, and only up to a size: a path a user gives may name a FIFO
(``open()`` waits for a writer forever), a device (``/dev/zero`` never ends), a directory
or a file of gigabytes, and each must be one line, not a hang or a traceback. The type is
checked with ``stat`` before opening (opening a device may itself do something), and again
with ``fstat`` on a descriptor opened ``O_NONBLOCK`` (the path may change in between).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

#: The most bytes :func:`read_text` reads: an operator's file (policy, settings, tokens, a
#: spelled-out topology of thousands of nodes) stays far below it; anything larger is a
#: wrong path, and decoding it would hold start-up for minutes.
MAX_TEXT_BYTES = 8 * 1024 * 1024
#: The most bytes of a secret or token file (a JWT is a few KiB).
MAX_SECRET_BYTES = 64 * 1024

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class Unreadable(Exception):
    """A file that cannot be read as UTF-8 text; ``reason`` is one short line.

    ``missing``: the path names nothing (or a dangling link), which a reader may wait out
    (a token the kubelet has not written yet). ``special``: it names a FIFO, a device, a
    directory or a file over the size limit, which no rewrite in progress explains.
    """

    def __init__(self, reason: str, *, missing: bool = False, special: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.missing = missing
        self.special = special


def _kind(mode: int) -> str:
    """What a non-regular file is, in the words ``ls -l`` users know."""
    if stat.S_ISDIR(mode):
        return "Is a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO, not a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, not a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a regular file"
    return "not a regular file"


def _refuse(st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable(_kind(st.st_mode), special=True)
    if st.st_size > max_bytes:
        raise Unreadable(
            f"larger than {max_bytes} bytes ({st.st_size}); not a file to read", special=True
        )


def _os_reason(exc: OSError, path: str | Path) -> Unreadable:
    reason = exc.strerror or type(exc).__name__
    missing = exc.errno == errno.ENOENT
    if missing and os.path.islink(path):
        reason = "a dangling symbolic link (its target does not exist)"
    return Unreadable(reason, missing=missing)


def check_file(path: str | Path, *, max_bytes: int = MAX_TEXT_BYTES) -> None:
    """Refuse, without opening it, a path that is not a regular file of at most
    ``max_bytes``: for a path another library opens itself (a kubeconfig). Raises
    :class:`Unreadable` (``missing`` set when nothing is there)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        if isinstance(exc, OSError):
            raise _os_reason(exc, path) from None
        raise Unreadable("not a valid path") from None
    _refuse(st, max_bytes)


def read_bytes(path: str | Path, *, max_bytes: int = MAX_TEXT_BYTES) -> bytes:
    """A regular file's bytes, never more than ``max_bytes``, never waiting on a FIFO or
    reading a device; else :class:`Unreadable` with one short reason."""
    check_file(path, max_bytes=max_bytes)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _os_reason(exc, path) from None
    try:
        _refuse(os.fstat(fd), max_bytes)  # swapped for something else since the stat
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise _os_reason(exc, path) from None
    finally:
        os.close(fd)
    if size > max_bytes:  # grew while being read
        raise Unreadable(f"larger than {max_bytes} bytes; not a file to read", special=True)
    return b"".join(chunks)


def read_text(path: str | Path, *, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The file's text, or :class:`Unreadable` with the OS's reason ("No such file or
    directory", "Is a directory", ...), "a FIFO, not a regular file", "larger than ..."
    or "not UTF-8 text". See :func:`read_bytes`.

    A leading byte-order mark is dropped: Windows editors and PowerShell write one, and it
    is never part of a config, a token or a topology (JSON's parser refused such a file
    while YAML's read it, and a token kept it as its first character)."""
    data = read_bytes(path, max_bytes=max_bytes)
    try:
        return data.decode("utf-8-sig")
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
