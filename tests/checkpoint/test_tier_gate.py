"""Without the S3 test server the tiering tests skip and say why; under CI=true they fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint import s3_server


@pytest.mark.parametrize("ci", ["", "true"])
def test_missing_server_skips_locally_and_fails_in_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    monkeypatch.setattr(s3_server, "SERVER_PYTHON", tmp_path / "no-such-venv" / "python")
    monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(expected) as info, s3_server.moto_server(tmp_path):
        pass
    assert "no-such-venv" in str(info.value) and "S3 test server" in str(info.value)
    if not ci:
        assert "make s3-server" in str(info.value)
