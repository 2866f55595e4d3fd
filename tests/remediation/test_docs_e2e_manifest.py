"""docs/kubernetes.md shows the JobSet and the PyTorchJob the end-to-end tests run, byte for
byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_k8s_jobset_e2e import JOBSET_YAML
from tests.e2e.test_k8s_pytorchjob_e2e import PYTORCHJOB_YAML

DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


@pytest.mark.parametrize(
    ("heading", "manifest"),
    [
        ("### End to end: a JobSet of torchrun pods survives a fatal XID", JOBSET_YAML),
        ("### End to end: a PyTorchJob of torchrun pods survives a fatal XID", PYTORCHJOB_YAML),
    ],
    ids=["jobset", "pytorchjob"],
)
def test_docs_show_the_e2e_manifest(heading: str, manifest: str) -> None:
    section = DOC.read_text().split(heading, 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert block == manifest
