"""The krew manifest of ``kubectl trainguard`` (plugins/trainguard.yaml).

Checked against krew's manifest rules (the fields ``krew install`` validates), against the
archive rebuilt from this tree (its sha256, its files), and by running the unpacked launcher
through a real kubectl's plugin mechanism.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cli.cli_k8s_tools import ToolUnavailable, kubectl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))
try:
    import build_krew
finally:
    sys.path.remove(str(ROOT / "plugins"))

MANIFEST: dict[str, Any] = yaml.safe_load((ROOT / "plugins" / "trainguard.yaml").read_text())
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _archive_files(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def test_manifest_follows_krew_rules() -> None:
    assert MANIFEST["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2"
    assert MANIFEST["kind"] == "Plugin"
    name = MANIFEST["metadata"]["name"]
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", name)
    spec = MANIFEST["spec"]
    assert spec["version"] == f"v{VERSION}"  # krew wants a v-prefixed semver
    assert 0 < len(spec["shortDescription"]) <= 80 and spec["description"].strip()
    assert spec["platforms"]
    for platform in spec["platforms"]:
        assert platform["selector"]
        assert platform["uri"].startswith("https://") and platform["uri"].endswith(".tar.gz")
        assert f"/v{VERSION}/" in platform["uri"]
        assert re.fullmatch(r"[0-9a-f]{64}", platform["sha256"])
        # kubectl finds the plugin as kubectl-<name> on PATH.
        assert platform["bin"] == f"kubectl-{name}"
        assert {f["to"] for f in platform["files"]} == {"."}


def test_manifest_sha256_is_the_archive_built_from_this_tree() -> None:
    data = build_krew.build_archive()
    assert data == build_krew.build_archive()  # reproducible, byte for byte
    files = _archive_files(data)
    for platform in MANIFEST["spec"]["platforms"]:
        assert platform["sha256"] == hashlib.sha256(data).hexdigest(), (
            "plugins/trainguard.yaml is stale: run python plugins/build_krew.py DIR --update"
        )
        assert {f["from"] for f in platform["files"]} <= set(files)
        assert files[platform["bin"]].mode & 0o111  # executable


@pytest.mark.slow
def test_unpacked_plugin_runs_under_kubectl(tmp_path: Path) -> None:
    try:
        kubectl_bin = kubectl()
    except ToolUnavailable as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no kubectl here: {exc}")
    bindir = tmp_path / "krew-bin"
    bindir.mkdir()
    with tarfile.open(fileobj=io.BytesIO(build_krew.build_archive()), mode="r:gz") as tar:
        tar.extractall(bindir, filter="data")
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    ran = subprocess.run(
        [str(kubectl_bin), "trainguard", "--help"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**env, "TRAINGUARD_PYTHON": sys.executable},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert "Usage: kubectl trainguard" in ran.stdout and "--kubeconfig" in ran.stdout
    # A python without the package: one line that says what to install, exit 2.
    missing = subprocess.run(
        [str(kubectl_bin), "trainguard", "nodes"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**env, "TRAINGUARD_PYTHON": "/usr/bin/python3"},
    )  # fmt: skip
    if missing.returncode == 0:
        pytest.skip("/usr/bin/python3 has trainguard installed")
    assert missing.returncode == 2
    assert missing.stderr.strip().endswith("-m pip install trainguard")
