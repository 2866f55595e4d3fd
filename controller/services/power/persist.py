"""The power-domain tree in the ``power_domains`` table, one row per domain.

The tree is stored as the operator wrote it (budgets, kinds, per-domain policy overrides in
``labels["policy"]``, sibling order in ``labels["order"]``), not as the resolved policy, so
a tree read back and shown again looks like the one that was put. Priority overrides set
through the API live on their server's row (``labels["priority"]``): the priority only
matters to the power policy, and only for servers in the tree. Job priorities live on the
root's row (``labels["job_priorities"]``, job name -> class): they too only steer capping.

A replace is one transaction (delete every row, insert the new tree parents first), so a
crash mid-write leaves the old tree or the new one, never a mix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from controller.db.models import PowerDomain
from controller.db.repositories import power as repo
from power import ConfigError, DomainTree, Priority, parse_domains
from power.domains import read_domains_document

Raw = dict[str, Any]


class Stored(NamedTuple):
    """What the table holds: the raw tree (None: no tree) and the priority overrides."""

    raw: Raw | None
    priorities: dict[str, Priority]
    job_priorities: dict[str, Priority]


def read_domains_file(path: Path) -> tuple[DomainTree, Raw]:
    """The validated tree and its raw document; :class:`ConfigError` names the bad path."""
    raw = read_domains_document(path)  # one read: the tree and the document stored agree
    return parse_domains(raw), _plain(raw)


def validate(raw: Any) -> tuple[DomainTree, Raw]:
    """Parse a document from the API; the error message names ``domains.<path>``."""
    tree = parse_domains(raw)
    return tree, _plain(raw)


def _plain(raw: Any) -> Raw:
    """A JSON-safe copy (YAML may hold dates or tuples the JSON column cannot store)."""
    out = json.loads(json.dumps(raw, default=str))
    if not isinstance(out, dict):
        raise ConfigError("domains: must be a mapping with name, kind, budget_w")
    return out


def _walk(raw: Raw, parent: str | None, order: int) -> Iterator[tuple[Raw, str | None, int]]:
    yield raw, parent, order
    for i, child in enumerate(raw.get("children") or []):
        yield from _walk(child, str(raw["name"]), i)


def to_rows(
    raw: Raw,
    priorities: Mapping[str, Priority],
    job_priorities: Mapping[str, Priority] | None = None,
) -> list[dict[str, Any]]:
    """Rows in pre-order, so every parent is inserted before its children."""
    rows = []
    for dom, parent, order in _walk(raw, None, 0):
        kind = str(dom["kind"]).lower()
        labels: dict[str, Any] = {"order": order}
        if "policy" in dom:
            labels["policy"] = dom["policy"]
        name = str(dom["name"])
        if kind == "server" and name in priorities:
            labels["priority"] = priorities[name].value
        if parent is None and job_priorities:
            labels["job_priorities"] = {j: p.value for j, p in sorted(job_priorities.items())}
        rows.append(
            {
                "name": name,
                "kind": kind,
                "parent": parent,
                "provisioned_power_w": float(dom["budget_w"]),
                "node_name": name if kind == "server" else (parent if kind == "gpu" else None),
                "gpu_index": dom.get("gpu_index"),
                "labels": labels,
            }
        )
    return rows


def from_rows(rows: list[PowerDomain]) -> Stored:
    """The raw tree and the priority overrides stored with it (None when there is none)."""
    if not rows:
        return Stored(None, {}, {})
    docs: dict[str, Raw] = {}
    orders: dict[str, int] = {}
    priorities: dict[str, Priority] = {}
    jobs: dict[str, Priority] = {}
    for row in rows:
        doc: Raw = {"name": row.name, "kind": row.kind, "budget_w": row.provisioned_power_w}
        labels = dict(row.labels or {})
        if "policy" in labels:
            doc["policy"] = labels["policy"]
        if row.gpu_index is not None:
            doc["gpu_index"] = row.gpu_index
        if labels.get("priority") in ("high", "low"):
            priorities[row.name] = Priority(labels["priority"])
        if row.parent is None and isinstance(labels.get("job_priorities"), dict):
            jobs.update(
                {
                    str(j): Priority(p)
                    for j, p in labels["job_priorities"].items()
                    if p in ("high", "low")
                }
            )
        docs[row.name] = doc
        orders[row.name] = int(labels.get("order", 0))
    root: Raw | None = None
    for row in sorted(rows, key=lambda r: orders[r.name]):
        if row.parent is None:
            root = docs[row.name]
        elif row.parent in docs:
            docs[row.parent].setdefault("children", []).append(docs[row.name])
    return Stored(root, priorities, jobs)


def load(session: Session) -> Stored:
    return from_rows(list(repo.load_domains(session)))


def replace(
    conn: Connection,
    raw: Raw,
    priorities: Mapping[str, Priority],
    job_priorities: Mapping[str, Priority] | None = None,
) -> None:
    """Swap the stored tree for ``raw`` in the caller's transaction."""
    repo.replace_domains(conn, to_rows(raw, priorities, job_priorities))


__all__ = [
    "Raw",
    "Stored",
    "from_rows",
    "load",
    "read_domains_file",
    "replace",
    "to_rows",
    "validate",
]
