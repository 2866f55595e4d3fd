"""docs/kubernetes.md shows the JobSet the end-to-end test runs, byte for byte."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.test_k8s_jobset_e2e import JOBSET_YAML

DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


def test_docs_show_the_e2e_jobset() -> None:
    text = DOC.read_text()
    section = text.split("### End to end: a JobSet of torchrun pods survives a fatal XID", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert block == JOBSET_YAML
