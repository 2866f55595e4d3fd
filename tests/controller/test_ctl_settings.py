"""ControllerSettings: sources, token rules, and the auth module's constant-time lookup."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from controller.auth import Authenticator
from controller.errors import Forbidden, Unauthenticated
from controller.settings import ControllerSettings, generate_dev_tokens

GOOD = [{"name": "ops", "role": "operator", "token": "x" * 16}]


def test_defaults_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "TRAINGUARD_TOKENS", '[{"name": "a", "role": "agent", "token": "%s"}]' % ("k" * 20)
    )
    monkeypatch.setenv("TRAINGUARD_NODE_LOST_AFTER_S", "12.5")
    s = ControllerSettings()
    assert s.tokens[0].role == "agent" and s.node_lost_after_s == 12.5
    assert (s.host, s.port, s.ingest_flush_interval_s) == ("127.0.0.1", 8470, 0.02)
    assert s.database_url.startswith("sqlite:///") and s.database_url.endswith("trainguard.db")
    assert s.history_retention_s == 7 * 24 * 3600
    # Keyword arguments (the CLI) win over the environment.
    assert ControllerSettings(node_lost_after_s=3.0).node_lost_after_s == 3.0


def test_yaml_config_file_and_tokens_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = tmp_path / "tokens.yaml"
    digest = hashlib.sha256(b"from-a-file-token").hexdigest()
    tokens.write_text(yaml.safe_dump([{"name": "viewer", "role": "viewer", "sha256": digest}]))
    config = tmp_path / "controller.yaml"
    config.write_text(yaml.safe_dump({"port": 9000, "tokens_file": str(tokens)}))
    monkeypatch.setenv("TRAINGUARD_CONFIG_FILE", str(config))
    s = ControllerSettings()
    assert s.port == 9000 and s.tokens[0].name == "viewer"
    auth = Authenticator(s.tokens, allow_anonymous_read=False)
    assert auth.identify("Bearer from-a-file-token").role == "viewer"  # type: ignore[union-attr]


def test_yaml_config_file_refuses_unknown_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo in the file would silently keep the default; unknown environment variables
    stay ignored (the agents share the ``TRAINGUARD_`` prefix)."""
    from trainguard.cli.cmd_serve import controller_settings
    from trainguard.cli.errors import BadInput

    config = tmp_path / "controller.yaml"
    config.write_text(yaml.safe_dump({"node_lost_afer_s": 5, "PORT": 9000, "tokens": GOOD}))
    monkeypatch.setenv("TRAINGUARD_CONFIG_FILE", str(config))
    monkeypatch.setenv("TRAINGUARD_AGENT_INTERVAL_S", "1")
    with pytest.raises(BadInput) as refused:
        controller_settings()
    assert refused.value.exit_code == 2
    assert str(refused.value) == (
        f"config file {config}: unknown setting 'node_lost_afer_s' "
        "(did you mean 'node_lost_after_s'?)"
    )
    # Keys match case-insensitively, as pydantic-settings reads them; known ones pass.
    config.write_text(yaml.safe_dump({"node_lost_after_s": 5, "PORT": 9000, "tokens": GOOD}))
    settings = controller_settings()
    assert (settings.node_lost_after_s, settings.port) == (5, 9000)


def test_refuses_unsafe_tokens() -> None:
    with pytest.raises(ValidationError, match="no API tokens configured"):
        ControllerSettings(tokens=[])
    with pytest.raises(ValidationError, match="shorter than 16"):
        ControllerSettings(tokens=[{"name": "a", "role": "agent", "token": "short"}])
    with pytest.raises(ValidationError, match="exactly one of"):
        ControllerSettings(tokens=[{"name": "a", "role": "agent"}])
    with pytest.raises(ValidationError, match="64 hex"):
        ControllerSettings(tokens=[{"name": "a", "role": "agent", "sha256": "abc"}])
    with pytest.raises(ValidationError, match="unique"):
        ControllerSettings(tokens=GOOD + GOOD)
    # Dev mode may start without tokens (they get generated) and with short ones.
    assert ControllerSettings(dev_mode=True, tokens=[]).tokens == []


def test_dev_tokens_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "dev-tokens.yaml"
    tokens = generate_dev_tokens(path)
    assert {t.role for t in tokens} == {"agent", "viewer", "operator"}
    assert path.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(path.read_text())[0]["token"] == tokens[0].token


def test_authenticator_roles() -> None:
    auth = Authenticator(
        ControllerSettings(
            tokens=[
                {"name": "agent", "role": "agent", "token": "a" * 16},
                {"name": "ops", "role": "operator", "token": "o" * 16},
            ]
        ).tokens,
        allow_anonymous_read=False,
    )
    assert auth.authorize("Bearer " + "o" * 16, frozenset({"operator"}), read=False).name == "ops"
    with pytest.raises(Forbidden):
        auth.authorize("Bearer " + "a" * 16, frozenset({"viewer", "operator"}), read=True)
    with pytest.raises(Unauthenticated):
        auth.authorize(None, frozenset({"viewer"}), read=True)
    with pytest.raises(Unauthenticated):
        auth.authorize("Bearer " + "o" * 15, frozenset({"operator"}), read=False)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_a_float_setting_must_be_finite(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRAINGUARD_NODE_LOST_AFTER_S=inf`` was accepted: a node would never be lost."""
    from trainguard.cli.cmd_serve import controller_settings
    from trainguard.cli.errors import BadInput

    monkeypatch.setenv(
        "TRAINGUARD_TOKENS", '[{"name": "a", "role": "agent", "token": "%s"}]' % ("k" * 20)
    )
    monkeypatch.setenv("TRAINGUARD_NODE_LOST_AFTER_S", value)
    with pytest.raises(BadInput) as refused:
        controller_settings()
    assert refused.value.exit_code == 2 and "node_lost_after_s" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_webhook_secret_file_from_a_windows_editor_signs_with_the_secret(
    tmp_path: Path,
) -> None:
    """Notepad and PowerShell start a UTF-8 file with a byte-order mark; it is not part of
    the secret the receiver holds, so every delivery's HMAC would have failed to verify."""
    path = tmp_path / "webhook-secret"
    path.write_bytes(b"\xef\xbb\xbfs3cret-for-the-receiver\r\n")
    settings = ControllerSettings(
        dev_mode=True,
        remediation_webhook_url="http://127.0.0.1:1/hook",
        remediation_webhook_secret_file=path,
    )
    assert settings.webhook_secret() == b"s3cret-for-the-receiver"
