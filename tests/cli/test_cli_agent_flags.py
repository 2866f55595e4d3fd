"""``trainguard agent``: every flag lands on its ``AgentSettings`` field.

The README promises a flag for each ``TRAINGUARD_AGENT_*`` setting. The daemon's entry
point is replaced by one that records the settings it was given, so the test checks the
CLI's translation without starting a long-running agent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agents.settings import AgentSettings
from trainguard.cli.app import run

#: Settings a flag may set, with the flag; ``python -m agents`` takes the same names.
FLAGS = {
    "controller_url": ("--controller", "http://ctl:8470", "http://ctl:8470"),
    "node_name": ("--node-name", "gpu-17", "gpu-17"),
    "gpus": ("--gpus", "sim:4", "sim:4"),
    "sample_interval_s": ("--sample-interval", "0.5", 0.5),
    "report_interval_s": ("--report-interval", "2", 2.0),
    "report_timeout_s": ("--report-timeout", "7.5", 7.5),
    "backoff_max_s": ("--backoff-max", "45", 45.0),
    "spool_max_bytes": ("--spool-max-bytes", "1048576", 1048576),
    "metrics_host": ("--metrics-host", "0.0.0.0", "0.0.0.0"),
    "metrics_port": ("--metrics-port", "-1", -1),
    "node_base_power_w": ("--node-base-power-w", "350", 350.0),
    "log_level": ("--log-level", "DEBUG", "debug"),
    "sim_seed": ("--sim-seed", "7", 7),
    "nvml_timeout_s": ("--nvml-timeout", "2.5", 2.5),
    "client_idle_timeout_s": ("--client-idle-timeout", "30", 30.0),
    "job_listen": ("--job-listen", "127.0.0.1:9471", "127.0.0.1:9471"),
    "preflight_load_s": ("--preflight-load-s", "4", 4.0),
    "preflight_load_grace_s": ("--preflight-load-grace", "90", 90.0),
    "job_flush_steps": ("--job-flush-steps", "0", 0),
    "job_flush_min_interval_s": ("--job-flush-min-interval", "2.5", 2.5),
    "gpu_unreachable_after": ("--gpu-unreachable-after", "7", 7),
    "xid_wait_failing_s": ("--xid-wait-failing", "45", 45.0),
}

#: Flags whose values ``test_every_flag_reaches_its_setting`` checks one by one.
OTHER_FLAGS = {
    "token": "--token",
    "token_file": "--token-file",
    "labels": "--label",
    "powercap_dir": "--powercap-dir",
    "sim_no_permission": "--sim-no-permission",
    "sim_faults": "--sim-fault",
    "sim_fault_file": "--sim-fault-file",
    "spool_dir": "--spool-dir",
    "socket_path": "--socket-path",
    "dev_dir": "--dev-dir",
    "foreground": "--foreground",
    "sysfs_root": "--sysfs-root",
    "job_token_file": "--job-token-file",
    "preflight_load": "--preflight-load",
    "preflight_load_command": "--preflight-load-command",
}


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[AgentSettings]:
    """The settings each ``trainguard agent`` run would have started the daemon with."""
    import agents.daemon

    for name in [k for k in os.environ if k.startswith("TRAINGUARD_AGENT_")]:
        monkeypatch.delenv(name)
    seen: list[AgentSettings] = []
    monkeypatch.setattr(agents.daemon, "run", seen.append)
    return seen


def _agent(tmp_path: Path, *args: str) -> int:
    base = ["agent", "--gpus", "sim:2", "--spool-dir", str(tmp_path / "spool")]
    return run([*base, "--socket-path", "", *args], prog_name="trainguard")


def test_every_flag_reaches_its_setting(started: list[AgentSettings], tmp_path: Path) -> None:
    args = [word for flag, value, _ in FLAGS.values() for word in (flag, value)]
    args += ["--label", "rack=r7", "--label", "zone=b", "--label", "rack=r8"]
    args += ["--powercap-dir", str(tmp_path / "rapl"), "--sim-no-permission"]
    args += ["--sim-fault-file", str(tmp_path / "faults")]
    args += ["--dev-dir", str(tmp_path / "dev"), "--sysfs-root", str(tmp_path / "sys")]
    args += ["--no-foreground", "--token-file", str(tmp_path / "token")]
    args += ["--job-token-file", str(tmp_path / "job-tokens")]
    args += ["--sim-fault", "kind=xid,code=79,gpu=1,at=5", "--token", "t" * 20]
    args += ["--no-preflight-load", "--preflight-load-command", "burn --gpu '{uuid}' -t {seconds}"]
    assert _agent(tmp_path, *args) == 0
    (settings,) = started
    for field, (_flag, _value, expected) in FLAGS.items():
        assert getattr(settings, field) == expected, field
    assert settings.labels == {"rack": "r8", "zone": "b"}
    assert settings.powercap_dir == tmp_path / "rapl"
    assert settings.sim_no_permission is True
    assert settings.sim_faults == ["kind=xid,code=79,gpu=1,at=5"]
    assert settings.sim_fault_file == tmp_path / "faults"
    assert settings.dev_dir == tmp_path / "dev" and settings.sysfs_root == tmp_path / "sys"
    assert settings.foreground is False
    assert settings.token is not None and settings.token.get_secret_value() == "t" * 20
    assert settings.token_file == tmp_path / "token"
    assert settings.job_token_file == tmp_path / "job-tokens"
    assert settings.resolved_spool_dir == tmp_path / "spool"
    assert settings.preflight_load is False
    assert settings.preflight_load_command == ["burn", "--gpu", "{uuid}", "-t", "{seconds}"]


def test_every_settings_field_has_a_flag() -> None:
    """A new ``AgentSettings`` field without a ``trainguard agent`` flag fails here."""
    import typer

    from trainguard.cli.app import build_app

    flags = {field: flag for field, (flag, _, _) in FLAGS.items()} | OTHER_FLAGS
    assert set(AgentSettings.model_fields) == set(flags)
    command = typer.main.get_command(build_app(["agent"]))
    agent = command.commands["agent"]  # type: ignore[attr-defined]
    offered = {opt for param in agent.params for opt in param.opts}
    assert set(flags.values()) <= offered, set(flags.values()) - offered


def test_flags_left_out_keep_environment_and_defaults(
    started: list[AgentSettings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_AGENT_LABELS", '{"rack": "from-env"}')
    monkeypatch.setenv("TRAINGUARD_AGENT_BACKOFF_MAX_S", "12")
    monkeypatch.setenv("TRAINGUARD_AGENT_SIM_NO_PERMISSION", "true")
    assert _agent(tmp_path, "--log-level", "warning") == 0
    (settings,) = started
    assert settings.labels == {"rack": "from-env"}
    assert settings.backoff_max_s == 12.0
    assert settings.sim_no_permission is True  # the unset flag does not turn it off
    assert settings.node_base_power_w == 0.0 and settings.log_level == "warning"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--label", "rack"], "--label 'rack': expected key=value"),
        (["--label", "=r1"], "--label '=r1': expected key=value"),
        (["--log-level", "loud"], "log_level: must be one of debug, info, warning, error"),
        (["--spool-max-bytes", "1024"], "spool_max_bytes: Input should be greater than"),
        (["--node-base-power-w", "-5"], "node_base_power_w: Input should be greater than"),
        (["--preflight-load-command", "burn '{gpu}"], "--preflight-load-command: No closing"),
        (["--preflight-load-command", " "], "--preflight-load-command: empty command"),
    ],
)
def test_bad_values_are_one_line_exit_2(
    started: list[AgentSettings],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    assert _agent(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert started == []
