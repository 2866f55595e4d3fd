"""An operator's file read as text, or one short reason why not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from trainguard.textfile import Unreadable, read_text, yaml_problem


def test_utf8_text_is_read(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("name: caf\u00e9\n", encoding="utf-8")
    assert read_text(path) == "name: caf\u00e9\n"


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: p.write_bytes(b"\xff\xfe\x00binary"), "not UTF-8 text"),
        (lambda p: p.write_text("caf\u00e9", encoding="latin-1"), "not UTF-8 text"),
        (lambda p: p.mkdir(), "Is a directory"),
        (lambda p: None, "No such file or directory"),
    ],
)
def test_why_not_is_one_short_reason(
    tmp_path: Path, make: Callable[[Path], object], reason: str
) -> None:
    path = tmp_path / "f.yaml"
    make(path)
    with pytest.raises(Unreadable) as info:
        read_text(path)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a: [1, 2\n", "expected ',' or ']', but got '<stream end>' at line 2, column 1"),
        ("a: b\n c: d\n  - e\n", "mapping values are not allowed here at line 2, column 3"),
        ("a: \x00\n", "unacceptable character #x0000: special characters are not allowed"),
    ],
)
def test_yaml_problem_is_one_line_with_its_place(text: str, problem: str) -> None:
    with pytest.raises(yaml.YAMLError) as info:
        yaml.safe_load(text)
    assert "\n" in str(info.value)  # what PyYAML says: several lines
    assert yaml_problem(info.value) == problem
