"""The rank's pod identity from the downward API env (issue 18 placement)."""

from __future__ import annotations

from pathlib import Path

from trainguard.podinfo import pod_identity


def test_downward_api_env_and_fallbacks(tmp_path: Path) -> None:
    ns_file = tmp_path / "namespace"
    assert pod_identity({}, ns_file) == ("", "")
    assert pod_identity({"POD_NAME": "p", "POD_NAMESPACE": "n"}, ns_file) == ("p", "n")
    env = {"POD_NAME": "p", "TRAINGUARD_POD_NAME": "q", "TRAINGUARD_POD_NAMESPACE": "m"}
    assert pod_identity(env, ns_file) == ("q", "m")
    ns_file.write_text("train\n")
    assert pod_identity({"POD_NAME": "p"}, ns_file) == ("p", "train")
