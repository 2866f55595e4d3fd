"""``-o json`` and ``-o yaml`` keep text readable but never print a hidden character raw.

A label that a server holds may carry a bidi override (U+202E flips the rest of the line on
screen), a tag character or a zero-width space (two names that look alike), a C1 control,
or a lone surrogate (``"\\udc80"`` is valid JSON; as text it cannot even be written as
UTF-8). Each must come out escaped, the document must still parse to the same data, and
ordinary non-ASCII text (a CJK label, an accent) must stay as it is.
"""

from __future__ import annotations

import json

import pytest
import yaml

from trainguard.cli.output import dump_json, dump_yaml

HIDDEN = [
    "\u202e",
    "\u2066",
    "\u200b",
    "\ufeff",
    "\U000e0041",
    "\udc80",
    "\x85",
    "\u2028",
    "\u3164",
]


@pytest.mark.parametrize("char", HIDDEN, ids=[f"U+{ord(c):04X}" for c in HIDDEN])
def test_a_hidden_character_is_escaped_and_the_data_survives(char: str) -> None:
    data = {"node": f"gpu{char}-a", "labels": [f"team{char}", "研究"], f"k{char}": 1}
    for text, load in ((dump_json(data), json.loads), (dump_yaml(data), yaml.safe_load)):
        assert char not in text
        text.encode("utf-8")  # a lone surrogate raised here (or was written as a bad byte)
        assert load(text) == data


def test_ordinary_text_stays_readable() -> None:
    data = {"node": "nœud-研究-1", "note": "ok \\u202e as typed, a backslash and all"}
    out = dump_json(data)
    assert "nœud-研究-1" in out and json.loads(out) == data
    assert '"ok \\\\u202e as typed' in out  # a backslash in the text is not an escape
    out = dump_yaml(data)
    assert "nœud-研究-1" in out and yaml.safe_load(out) == data
