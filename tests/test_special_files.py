"""A file path a user gives is read only if it names a regular file of a sane size.

A FIFO made ``open()`` wait for a writer for ever (``trainguard --kubeconfig FIFO nodes``
hung, so did an agent with ``--token-file FIFO`` and a controller with a FIFO for its config,
tokens or webhook secret file, and an agent whose spool held a FIFO); ``/dev/zero`` and
``/dev/urandom`` never end; a directory or a file of gigabytes is a wrong path. Each is one
line (exit 2 from the CLI, the agent and the controller refusing to start), never a hang and
never a traceback. Every case here uses a real special file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agents.errors import AgentConfigError
from agents.settings import load_settings
from agents.spool import Spool
from trainguard.cli.app import run as cli_run
from trainguard.cli.cmd_serve import controller_settings
from trainguard.cli.errors import BadInput
from trainguard.textfile import Unreadable, read_text

pytestmark = pytest.mark.timeout(20)

#: Far past any cap on an operator's file (trainguard.textfile.MAX_TEXT_BYTES).
HUGE_BYTES = 64 * 1024 * 1024

#: Each maker returns a path of one kind, and the words its refusal must hold.
Maker = Callable[[Path], tuple[Path, str]]


def _fifo(tmp: Path) -> tuple[Path, str]:
    path = tmp / "fifo"
    os.mkfifo(path)
    return path, "FIFO"


def _zero(tmp: Path) -> tuple[Path, str]:
    return Path("/dev/zero"), "device"


def _urandom(tmp: Path) -> tuple[Path, str]:
    return Path("/dev/urandom"), "device"


def _directory(tmp: Path) -> tuple[Path, str]:
    path = tmp / "dir"
    path.mkdir()
    return path, "Is a directory"


def _huge(tmp: Path) -> tuple[Path, str]:
    path = tmp / "huge.yaml"
    with path.open("wb") as handle:  # sparse: no disk used
        handle.truncate(HUGE_BYTES)
    return path, "larger than"


def _dangling(tmp: Path) -> tuple[Path, str]:
    path = tmp / "link"
    path.symlink_to(tmp / "gone")
    return path, "dangling symbolic link"


#: The FIFO first: on the old code it hung, and the timeout failed the test before
#: ``/dev/zero`` was read until memory ran out.
KINDS: list[Maker] = [_fifo, _zero, _urandom, _directory, _huge, _dangling]


def _each(tmp_path: Path, kinds: list[Maker] = KINDS) -> list[tuple[Path, str]]:
    made = []
    for i, make in enumerate(kinds):
        where = tmp_path / str(i)
        where.mkdir()
        made.append(make(where))
    return made


def _one_line(text: str) -> str:
    assert text.count("\n") == 1 and "Traceback" not in text, text
    return text


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("TRAINGUARD_", "KUBERNETES_")) or name == "KUBECONFIG":
            monkeypatch.delenv(name)


# ---------------------------------------------------------------------- the shared reader


def test_read_text_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    for path, words in _each(tmp_path):
        with pytest.raises(Unreadable) as caught:
            read_text(path)
        assert words in caught.value.reason, (path, caught.value.reason)
    good = tmp_path / "good.yaml"
    good.write_text("a: 1\n")
    (tmp_path / "to-good").symlink_to(good)  # a link to a regular file is read
    assert read_text(tmp_path / "to-good") == "a: 1\n"
    assert read_text(good, max_bytes=5) == "a: 1\n"
    with pytest.raises(Unreadable, match="larger than 4 bytes"):
        read_text(good, max_bytes=4)


def test_a_leading_byte_order_mark_is_not_part_of_the_text(tmp_path: Path) -> None:
    """Notepad and PowerShell's ``Out-File`` start a UTF-8 file with one: a JSON topology
    was refused for it, and an agent's token began with U+FEFF."""
    import json

    from agents.reporter import read_token_file

    bom = b"\xef\xbb\xbf"
    doc = tmp_path / "topology.json"
    doc.write_bytes(bom + b'{"version": 1}\n')
    assert json.loads(read_text(doc)) == {"version": 1}
    token = tmp_path / "token"
    token.write_bytes(bom + b"s3cret-token-value\n")
    assert read_token_file(token) == "s3cret-token-value"
    inner = tmp_path / "inner"
    inner.write_bytes(b"a" + bom)  # only a leading mark goes
    assert read_text(inner) == "a\ufeff"


# ---------------------------------------------------------------------- the CLI's kubeconfig


def test_cli_kubeconfig_special_files_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path, words in _each(tmp_path):
        assert cli_run(["--kubeconfig", str(path), "nodes"]) == 2, path
        err = _one_line(capsys.readouterr().err)
        assert err.startswith(f"error: cannot use kubeconfig {path}: "), err
        assert words in err, err


def test_cli_kubeconfig_env_entry_that_is_a_fifo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo, _ = _fifo(tmp_path)
    # As kubectl, a $KUBECONFIG entry that does not exist is skipped; a FIFO is refused.
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'absent'}{os.pathsep}{fifo}")
    assert cli_run(["nodes"], prog_name="kubectl trainguard") == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(f"error: cannot use kubeconfig {fifo}: a FIFO, not a regular file")


# ---------------------------------------------------------------------- the agent


def test_agent_refuses_special_token_files_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``trainguard agent``, even in the background (where a token file not yet
    written is waited out): exit 2 before the agent starts. The old code hung in the
    start-up read of a FIFO (and in the reporter's, had it got that far)."""
    import agents.daemon

    def no_agent(*_args: object, **_kw: object) -> None:
        raise AssertionError("the agent started with an unusable token file")

    monkeypatch.setattr(agents.daemon, "Agent", no_agent)
    args = ["--controller", "http://127.0.0.1:9", "--gpus", "sim:1", "--no-foreground"]
    args += ["--spool-dir", str(tmp_path / "spool"), "--socket-path", "", "--metrics-port", "-1"]
    for path, words in _each(tmp_path, [_fifo, _zero, _urandom, _directory, _huge]):
        assert cli_run(["agent", *args, "--token-file", str(path)]) == 2, path
        err = _one_line(capsys.readouterr().err)
        assert err.startswith(f"error: token_file {path}: "), err
        assert words in err or "larger than 65536 bytes" in err, err


def test_agent_refuses_special_job_token_files_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 2 in one line before the spool, the GPU backend or a socket exists (it used to
    come from the TCP endpoint's start, after those)."""
    import agents.daemon

    def no_agent(*_args: object, **_kw: object) -> None:
        raise AssertionError("the agent started with an unusable job token file")

    monkeypatch.setattr(agents.daemon, "Agent", no_agent)
    args = ["--controller", "http://127.0.0.1:9", "--gpus", "sim:1", "--no-foreground"]
    args += ["--spool-dir", str(tmp_path / "spool"), "--socket-path", "", "--metrics-port", "-1"]
    args += ["--job-listen", "127.0.0.1:0"]
    made = _each(tmp_path, [_fifo, _zero, _urandom, _directory, _huge])
    for path, words in made:
        assert cli_run(["agent", *args, "--job-token-file", str(path)]) == 2, path
        err = _one_line(capsys.readouterr().err)
        assert err.startswith(f"error: job token file {path}: "), err
        assert words in err or "larger than" in err or "one token per line" in err, err
    fifo = made[0][0]
    assert cli_run(["agent", *args, "--job-token-file", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: job token file {fifo}: cannot read it (a FIFO, not a regular file)\n"
    assert not (tmp_path / "spool").exists()


def test_agent_refuses_a_spool_dir_that_is_not_a_directory(tmp_path: Path) -> None:
    """Before, ``mkdir`` failed inside the spool after the GPU backend started: exit 1."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    fifo, _ = _fifo(tmp_path)
    dangling, _ = _dangling(tmp_path)
    for path, words in ((afile, "a regular file"), (fifo, "a special file"), (dangling, "dang")):
        with pytest.raises(AgentConfigError) as caught:
            load_settings(controller_url="http://127.0.0.1:9", spool_dir=path)
        message = _one_line(str(caught.value) + "\n")
        assert message.startswith(f"invalid agent settings: spool_dir: {path}: "), message
        assert words in message


def test_spool_sets_aside_special_files_instead_of_hanging(tmp_path: Path) -> None:
    """A FIFO as state.json or as a report, a device linked in as a report: quarantined
    at start, as a torn file is; before, reading the FIFO never returned."""
    root = tmp_path / "spool"
    (root / "reports").mkdir(parents=True)
    os.mkfifo(root / "state.json")
    os.mkfifo(root / "reports" / "000000000001.json")
    (root / "reports" / "000000000002.json").symlink_to("/dev/zero")
    spool = Spool(root, max_bytes=1 << 20)
    assert spool.pending() == []
    assert spool.state.quarantined_total == 3
    assert sorted(p.name.split(".")[0] for p in (root / "quarantine").iterdir()) == [
        "000000000001",
        "000000000002",
        "state",
    ]
    assert spool.agent_instance  # a fresh instance, as for a torn state file


# ---------------------------------------------------------------------- the controller


@pytest.mark.parametrize(
    "setting", ["config_file", "tokens_file", "remediation_webhook_secret_file"]
)
def test_controller_refuses_special_files_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """``trainguard controller``'s settings loader: one line, exit 2 (BadInput)."""
    monkeypatch.setenv(
        "TRAINGUARD_TOKENS", '[{"name": "v", "role": "viewer", "token": "' + "t" * 32 + '"}]'
    )
    for path, words in _each(tmp_path):
        given: dict[str, object] = {"database_url": f"sqlite:///{tmp_path}/t.db"}
        if setting == "config_file":
            monkeypatch.setenv("TRAINGUARD_CONFIG_FILE", str(path))
        elif setting == "tokens_file":
            given["tokens_file"] = path
        else:
            given["remediation_webhook_url"] = "http://127.0.0.1:9/hook"
            given[setting] = path
        with pytest.raises(BadInput) as caught:
            controller_settings(**given)
        message = _one_line(caught.value.message + "\n")
        assert str(path) in message and words in message, message
        assert caught.value.exit_code == 2
