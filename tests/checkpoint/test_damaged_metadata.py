"""Damaged metadata is an error, not a crash, and never wrong data (issue 19).

Two committed checkpoints of a two-rank job are saved once by the real engine. Every
example copies them, damages one file (``MANIFEST.json``, a rank manifest, ``latest``) in
one way (truncation, a field deleted or replaced by a wrong type, a huge or negative number,
NaN, an off-by-a-few integer, an extra rank, garbage), then loads as each rank. Accepted:
a :class:`CheckpointError`, or the exact state of the step it says it loaded. Rank
manifests are pinned by their SHA-256 in ``MANIFEST.json``; a second property re-pins the
edited manifest (a buggy writer rather than a bad disk) so that the field validators
themselves are exercised, and accepts no exception but ``CheckpointError`` there either.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint import (
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointStore,
    load,
    verify,
)
from checkpoint.manifest import MANIFEST_NAME, rank_data_name, step_dir_name

STEPS = (1, 2)
RANKS = (0, 1)
FILES = (
    f"{step_dir_name(2)}/{MANIFEST_NAME}",
    f"{step_dir_name(2)}/rank-00000.json",
    f"{step_dir_name(2)}/rank-00001.json",
    f"{step_dir_name(1)}/{MANIFEST_NAME}",
    "latest",
)


def _model(step: int, rank: int) -> torch.nn.Linear:
    torch.manual_seed(100 * step + rank)
    return torch.nn.Linear(6, 3)


def _extra(step: int, rank: int) -> torch.Tensor:
    return torch.arange(5, dtype=torch.float64) * step + rank


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt-template")
    engines = [
        Checkpointer(
            CheckpointConfig(root=root, writer="thread", include_rng=False, when_busy="wait"),
            rank=rank,
            world_size=len(RANKS),
        )
        for rank in RANKS
    ]
    for step in STEPS:
        for rank, engine in enumerate(engines):
            engine.save({"model": _model(step, rank), "v": _extra(step, rank)}, step)
        for engine in reversed(engines):
            engine.wait()
    for engine in engines:
        engine.close()
    return root


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, (*prefix, index))
    return out


WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.integers(-3, 3).map(lambda d: ("delta", d)),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.just("../../rank-00000.json"),
    st.lists(st.integers(-2, 2**40), max_size=4),
    st.just({}),
)


@st.composite
def damage(draw: st.DrawFn) -> tuple[str, str, int, Any]:
    """(file, kind of damage, which field / where to cut, the value to put there)."""
    name = draw(st.sampled_from(FILES))
    kind = draw(st.sampled_from(["truncate", "set", "delete", "garbage", "extra_rank"]))
    return name, kind, draw(st.integers(0, 10**6)), draw(WRONG)


def _apply(root: Path, name: str, kind: str, pick: int, value: Any) -> None:
    path = root / name
    raw = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(raw[: pick % max(1, len(raw))])
        return
    if kind == "garbage" or name == "latest":
        path.write_bytes(b"\x00step-\xff" + repr(value).encode()[:20] if kind != "delete" else b"")
        return
    doc = json.loads(raw)
    if kind == "extra_rank":
        if "ranks" not in doc:
            doc["world_size"] = doc["world_size"] + 1
        else:
            doc["ranks"].append(dict(doc["ranks"][-1]))
    else:
        paths = _paths(doc)
        where = paths[pick % len(paths)]
        parent = doc
        for key in where[:-1]:
            parent = parent[key]
        last = where[-1]
        if kind == "delete":
            if isinstance(parent, dict):
                del parent[last]
            else:
                parent.pop(last)
        elif isinstance(value, tuple):  # an integer nudged by a few
            old = parent[last]
            parent[last] = old + value[1] if type(old) is int else value[1]
        else:
            parent[last] = value
    path.write_bytes(json.dumps(doc).encode())


def _repin(root: Path, name: str) -> None:
    """Record the edited rank manifest's SHA-256 in MANIFEST.json, as a writer would."""
    step_dir = (root / name).parent
    manifest = step_dir / MANIFEST_NAME
    try:
        doc = json.loads(manifest.read_bytes())
        rank = int(Path(name).stem.split("-")[1])
        doc["ranks"][rank]["manifest_sha256"] = hashlib.sha256(
            (root / name).read_bytes()
        ).hexdigest()
    except (ValueError, KeyError, IndexError, TypeError):
        return
    manifest.write_bytes(json.dumps(doc).encode())


def _load_all(root: Path, *, check_values: bool) -> None:
    for rank in RANKS:
        fresh = torch.nn.Linear(6, 3)
        try:
            got = load(root, {"model": fresh, "v": None}, rank=rank, restore_rng=False)
        except CheckpointError:
            continue
        assert got.step in STEPS
        if check_values:
            want = _model(got.step, rank)
            assert torch.equal(fresh.weight, want.weight) and torch.equal(fresh.bias, want.bias)
            assert torch.equal(got.values["v"], _extra(got.step, rank))
    with contextlib.suppress(CheckpointError):
        verify(root)
    for info in CheckpointStore(root).list():
        try:
            with CheckpointStore(root).open(info.step) as reader:
                for rank in RANKS:
                    reader.entries(rank)
        except CheckpointError:
            pass


SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(hit=damage())
def test_damaged_manifest_is_an_error_or_the_right_data(template: Path, hit: Any) -> None:
    name, kind, pick, value = hit
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        shutil.copytree(template, root)
        _apply(root, name, kind, pick, value)
        _load_all(root, check_values=True)


@SETTINGS
@given(hit=damage())
def test_repinned_bad_rank_manifest_is_an_error_not_a_crash(template: Path, hit: Any) -> None:
    name, kind, pick, value = hit
    if "rank-" not in name:
        name = f"{step_dir_name(2)}/rank-0000{pick % 2}.json"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        shutil.copytree(template, root)
        _apply(root, name, kind, pick, value)
        _repin(root, name)
        _load_all(root, check_values=False)


def _copy(template: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(template, root)
    return root


def test_error_names_the_file_and_the_field(template: Path, tmp_path: Path) -> None:
    root = _copy(template, tmp_path)
    path = root / step_dir_name(2) / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    doc["ranks"][1]["size_bytes"] = -4
    path.write_bytes(json.dumps(doc).encode())
    with pytest.raises(
        CheckpointCorruptError, match=r"MANIFEST\.json: field ranks\[1\]\.size_bytes"
    ):
        load(root, {"model": torch.nn.Linear(6, 3)}, step=2, restore_rng=False)
    got = load(root, {"model": torch.nn.Linear(6, 3)}, restore_rng=False)  # falls back
    assert got.step == 1 and "ranks[1].size_bytes" in got.skipped[0]
    doc["ranks"][1]["size_bytes"] = math.nan
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match=r"size_bytes: expected an integer"):
        verify(root, step=2)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "missing"),
        (b"step-000000000009\n", "step 9, which is missing"),
        (b"\xff\xfe garbage", "bad content"),
        (b"step-000000000001\n", "step 2 is committed and newer"),
    ],
)
def test_latest_is_a_hint(template: Path, tmp_path: Path, content: bytes | None, says: str) -> None:
    root = _copy(template, tmp_path)
    if content is None:
        (root / "latest").unlink()
    else:
        (root / "latest").write_bytes(content)
    fresh = torch.nn.Linear(6, 3)
    got = load(root, {"model": fresh, "v": None}, rank=1, restore_rng=False)
    assert got.step == 2 and says in got.latest_note
    assert torch.equal(fresh.weight, _model(2, 1).weight)


def test_verify_without_step_checks_what_load_resumes_from(
    template: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``verify(root)`` answers what ``load()`` would resume from, by the CLI's rule: a newest
    step with a bad byte is passed over and said, and the older one that verifies is the
    answer (it used to raise on step 2 although every rank resumes from step 1)."""
    root = _copy(template, tmp_path)
    for rank in RANKS:
        path = root / step_dir_name(2) / rank_data_name(rank)
        raw = bytearray(path.read_bytes())
        raw[0] ^= 1
        path.write_bytes(bytes(raw))
    for rank in RANKS:
        state = {"model": torch.nn.Linear(6, 3), "v": None}
        assert load(root, state, rank=rank, restore_rng=False).step == 1
    skipped: list[str] = []
    with caplog.at_level("WARNING", logger="checkpoint"):
        assert verify(root, skipped=skipped) == 1
    assert len(skipped) == 1 and skipped[0].startswith(f"step 2: {root / step_dir_name(2)}")
    assert "rank-00000.bin: CRC mismatch" in skipped[0]
    assert f"skipping checkpoint {skipped[0]}" in caplog.messages
    assert verify(root) == 1  # callers that pass no list get the same answer
    assert verify(root, deep=False) == 2  # manifests and sizes only: the byte is not read
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000\.bin: CRC mismatch"):
        verify(root, step=2)
    (root / step_dir_name(1) / rank_data_name(1)).unlink()
    with pytest.raises(CheckpointCorruptError, match="no checkpoint verifies") as none:
        verify(root)
    assert "(step 2: " in str(none.value) and "; step 1: " in str(none.value)


def test_latest_naming_an_incomplete_step_falls_back_and_says_so(
    template: Path, tmp_path: Path
) -> None:
    root = _copy(template, tmp_path)
    (root / step_dir_name(2) / MANIFEST_NAME).unlink()  # step 2 never committed
    got = load(root, {"model": torch.nn.Linear(6, 3)}, restore_rng=False)
    assert got.step == 1 and "step 2, which is incomplete" in got.latest_note
    assert verify(root) == 1
