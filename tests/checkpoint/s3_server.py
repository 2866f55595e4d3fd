"""A real S3-compatible server for the tiering tests: moto's standalone server (``make
s3-server`` installs it into .tools/s3venv, apart from .venv), started on 127.0.0.1 on a
free port and spoken to over HTTP by boto3 exactly as a bucket elsewhere would be."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER_PYTHON = ROOT / ".tools" / "s3venv" / "bin" / "python"
#: The smallest multipart part the server accepts (AWS: 5 MiB). Lowered so that the tests
#: upload many parts of a small checkpoint; the code path is the same.
MIN_PART_BYTES = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"S3 test server: {reason}")
    pytest.skip(f"S3 test server: {reason} (run `make s3-server`)")


@contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """Start the server; yield its endpoint URL; stop it."""
    if not SERVER_PYTHON.exists():
        _unavailable(f"{SERVER_PYTHON} missing")
    env = dict(os.environ, S3_UPLOAD_PART_MIN_SIZE=str(MIN_PART_BYTES))
    for attempt in range(3):  # another process may take the free port before the server
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(log_dir / f"moto-{port}.log", "wb")  # noqa: SIM115 closed below
        proc = subprocess.Popen(
            [str(SERVER_PYTHON), "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 30
        up = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                    up = True
                    break
            except OSError:
                time.sleep(0.1)
        if up:
            try:
                yield url
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                log.close()
            return
        proc.kill()
        proc.wait()
        log.close()
        if attempt == 2:
            tail = (log_dir / f"moto-{port}.log").read_text(errors="replace")[-500:]
            _unavailable(f"did not start on {url}: {tail}")


@contextmanager
def s3_endpoint(log_dir: Path, secret: str) -> Iterator[str]:
    """:func:`moto_server` with the test's credentials in the standard environment chain
    (as in production: boto3 reads them there), put back as they were afterwards."""
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["AWS_ACCESS_KEY_ID"] = "AKIATRAINGUARDTEST"
    os.environ["AWS_SECRET_ACCESS_KEY"] = secret
    try:
        with moto_server(log_dir) as url:
            yield url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
