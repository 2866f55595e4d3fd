"""TRAINGUARD_FAULTS that the training process cannot act on is refused when it is read,
as a one-line :class:`FaultSpecError`, never an exception that kills the rank later.

Before: a non-UTF-8 file raised UnicodeDecodeError and deep nesting RecursionError in the
rank; ``delay_s: Infinity`` and ``factor: 1e999`` were accepted and then ``time.sleep``
raised OverflowError at the fault's step (a "delay" that crashed the rank); ``signal:
99999`` was accepted and ``os.kill`` refused it at the crash point.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from collectives.errors import FaultSpecError
from collectives.faults import MAX_NUMBER, injector_from_env, load_faults


def _refused(value: str) -> str:
    with pytest.raises(FaultSpecError) as info:
        injector_from_env(0, {"TRAINGUARD_FAULTS": value})
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_fault_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_bytes(b'[{"kind": "delay", "rank": 0, "delay_s": 1, "seed": "\xe9"}]')
    assert _refused(str(path)) == (
        f"TRAINGUARD_FAULTS: cannot read fault file {path}: not UTF-8 text"
    )


def test_deeply_nested_faults_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert _refused(str(path)) == (f"TRAINGUARD_FAULTS ({path}): invalid JSON: nested too deeply")
    assert _refused("[" * 100_000 + "]" * 100_000) == (
        "TRAINGUARD_FAULTS: invalid JSON: nested too deeply"
    )


@pytest.mark.parametrize(
    ("fault", "field"),
    [
        ('{"kind": "delay", "rank": 0, "delay_s": Infinity}', "delay_s"),
        ('{"kind": "delay", "rank": 0, "delay_s": 1, "jitter_s": 1e999}', "jitter_s"),
        ('{"kind": "slowdown", "rank": 0, "factor": 1e999}', "factor"),
        ('{"kind": "slow_link", "ranks": [0, 1], "delay_s": 1e300}', "delay_s"),
        ('{"kind": "hang", "rank": 0, "at_step": 1, "duration_s": 1e20}', "duration_s"),
        ('{"kind": "delay", "rank": 0, "delay_s": 1' + "0" * 400 + "}", "delay_s"),
    ],
)
def test_a_number_sleep_cannot_take_is_refused(fault: str, field: str) -> None:
    message = _refused(f"[{fault}]")
    assert f"'{field}' must be at most {MAX_NUMBER:g} (a day)" in message


def test_numbers_within_a_day_still_parse() -> None:
    (fault,) = load_faults(f'[{{"kind": "delay", "rank": 0, "delay_s": {MAX_NUMBER}}}]')
    assert fault.delay_s == MAX_NUMBER


@pytest.mark.parametrize("number", [99_999, 65, 10**30])
def test_a_signal_number_the_system_lacks_is_refused(number: int) -> None:
    message = _refused(f'[{{"kind": "crash", "rank": 0, "at_step": 1, "signal": {number}}}]')
    assert message.endswith(f"'signal' {number} is not a signal of this system")


def test_a_real_signal_number_still_parses() -> None:
    spec = f'[{{"kind": "crash", "rank": 0, "at_step": 1, "signal": {int(signal.SIGTERM)}}}]'
    (fault,) = load_faults(spec)
    assert fault.signal == signal.SIGTERM


def test_a_key_given_twice_is_refused_as_in_every_operator_file() -> None:
    """Read through trainguard.textfile.load_json, as the other operator files: the first
    ``delay_s`` was silently dropped before."""
    spec = '[{"kind": "delay", "rank": 0, "delay_s": 0.5, "delay_s": 5}]'
    assert _refused(spec) == "TRAINGUARD_FAULTS: invalid JSON: duplicate key 'delay_s'"
