"""Names with a trailing newline, token names, and invisible characters in the CLI.

Python's ``re`` lets ``$`` match just before a final newline, so ``re.match(r"^...$", s)``
accepted ``"dc1\\n"`` where ``"dc1"`` was meant: the validators now use ``fullmatch``. Token
names reach logs, audit rows and the CLI, so they must be printable. The CLI's display
sanitizer escapes format (bidi, zero-width) characters so a stored hostname cannot reorder a
table row on screen.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import TypeAdapter, ValidationError

from agents.settings import AgentSettings
from agents.spool import Spool
from collectives.config import validate_job_name
from collectives.errors import CollectivesConfigError
from controller.logic.traffic.errors import TopologyError
from controller.logic.traffic.topofile import LabelFabric, topology_from_labels
from controller.settings import TokenConfig, load_tokens_file
from power.domains import parse_domains
from power.errors import ConfigError
from tests import http_calls
from tests.environ import clean_env
from trainguard import wire
from trainguard.cli.client import node_name
from trainguard.cli.errors import BadInput
from trainguard.cli.output import OutputFormat
from trainguard.cli.replies import printable, without_escapes
from trainguard.cli.views import NODES, render_list, render_node

if TYPE_CHECKING:
    from tests.conftest import LiveController, Tg

LABELS = "topology.trainguard.io/"
HEX = "ab" * 32


def _tree(*names: str) -> dict[str, Any]:
    children = [{"name": n, "kind": "server", "budget_w": 1000} for n in names]
    return {"name": "dc1", "kind": "datacenter", "budget_w": 5000, "children": children}


# ---------------------------------------------------------------- trailing newlines


def test_pydantic_patterns_refuse_a_trailing_newline() -> None:
    """pydantic-core runs ``pattern=`` with Rust's regex engine, where ``$`` is the end of the
    text: the wire's names never had the quirk (kept here so a switch to ``python-re``
    shows)."""
    name = TypeAdapter(wire.Name)
    assert name.validate_python("node-1") == "node-1"
    with pytest.raises(ValidationError):
        name.validate_python("node-1\n")


def test_power_domains_refuse_a_name_with_a_trailing_newline() -> None:
    with pytest.raises(ConfigError, match=r"children\[1\]\.name: must be a lowercase DNS"):
        parse_domains(_tree("node-1", "node-1\n"))
    with pytest.raises(ConfigError, match=r"^domains\.name: "):
        parse_domains({**_tree("node-1"), "name": "dc1\n"})


def test_put_power_domains_refuses_dc1_newline(live_controller: LiveController) -> None:
    """Before: 200, and ``node-1`` and ``node-1\\n`` were two domains of one tree."""
    live = live_controller
    with http_calls.client(base_url=live.url, headers=live.headers("operator")) as op:
        r = op.put("/api/v1/power/domains", json=_tree("node-1", "node-1\n"))
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert "children[1].name" in detail and "\n" not in detail
        assert op.put("/api/v1/power/domains", json=_tree("node-1")).status_code == 200


def test_topology_refuses_a_node_name_with_a_newline() -> None:
    fabric = LabelFabric(spines=2)
    assert topology_from_labels({"n1": {f"{LABELS}nic0": "tor-a"}}, fabric).nodes[0].name == "n1"
    with pytest.raises(TopologyError, match="node name 'n1\\\\n' is invalid"):
        topology_from_labels({"n1\n": {f"{LABELS}nic0": "tor-a"}}, fabric)


def test_topology_refuses_a_nic_label_with_a_newline() -> None:
    with pytest.raises(TopologyError, match="unknown label"):
        topology_from_labels({"n1": {f"{LABELS}nic0\n": "tor-a"}}, LabelFabric(spines=2))


def test_agent_node_name_refuses_a_trailing_newline() -> None:
    assert AgentSettings(node_name="node-1").node_name == "node-1"
    with pytest.raises(ValidationError, match="lower-case RFC 1123 name"):
        AgentSettings(node_name="node-1\n")


def test_cli_node_name_refuses_a_trailing_newline() -> None:
    assert node_name("node-1") == "node-1"
    with pytest.raises(BadInput, match="invalid node name"):
        node_name("node-1\n")


def test_job_name_refuses_a_trailing_newline() -> None:
    assert validate_job_name("job-a") == "job-a"
    with pytest.raises(CollectivesConfigError, match="not a lowercase RFC 1123 name"):
        validate_job_name("job-a\n")


def test_token_sha256_with_a_trailing_newline_is_refused() -> None:
    """Before: accepted, stored with its newline, and no presented token ever matched it."""
    assert TokenConfig(name="ops", role="viewer", sha256=HEX.upper()).digest() == HEX
    with pytest.raises(ValidationError, match="sha256 must be 64 hex characters"):
        TokenConfig(name="ops", role="viewer", sha256=HEX + "\n")


def test_spool_refuses_a_newline_in_its_instance(tmp_path: Path) -> None:
    """A 64-character instance plus a newline passed the 1-64 check and then failed the wire's
    ``max_length=64`` in every report."""
    root = tmp_path / "spool"
    long_id = "a" * 64
    root.mkdir()
    (root / "state.json").write_text(json.dumps({"agent_instance": long_id + "\n", "next_seq": 0}))
    spool = Spool(root, max_bytes=1 << 20)
    assert spool.state.agent_instance not in (long_id, long_id + "\n")
    assert len(list((root / "quarantine").iterdir())) == 1


def test_spool_quarantines_a_report_file_name_with_a_newline(tmp_path: Path) -> None:
    """Before: ``000000000003.json\\n`` was taken as report 3 (next_seq moved to 4)."""
    root = tmp_path / "spool"
    (root / "reports").mkdir(parents=True)
    identity = wire.NodeIdentity(name="node-1", gpus=[], backend="sim")
    report = wire.Report(node=identity, agent_instance="i1", seq=3, sent_unix_s=1.0)
    (root / "reports" / "000000000003.json\n").write_text(report.model_dump_json())
    spool = Spool(root, max_bytes=1 << 20)
    assert spool.state.next_seq == 0
    assert not list((root / "reports").iterdir())
    assert [p.name[:18] for p in (root / "quarantine").iterdir()] == ["000000000003.json\n"]


# ---------------------------------------------------------------- token names


@pytest.mark.parametrize(
    ("name", "code"),
    [("ops\n[WARN] forged", "U+000A"), ("ops\u202e", "U+202E"), ("o\u200bps", "U+200B")],
)
def test_token_names_must_be_printable(name: str, code: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(f"character {code} at position")):
        TokenConfig(name=name, role="operator", token="t" * 24)
    with pytest.raises(ValidationError, match="start or end with a space"):
        TokenConfig(name=" ops", role="operator", token="t" * 24)
    assert TokenConfig(name="ci bot", role="operator", token="t" * 24).name == "ci bot"


def test_tokens_file_names_the_entry_not_the_secret(tmp_path: Path) -> None:
    secret = "s3cret-" + "x" * 20
    path = tmp_path / "tokens.yaml"
    entries = [{"name": "ok", "role": "viewer", "token": "v" * 24}]
    entries.append({"name": "evil\u202eadmin", "role": "operator", "token": secret})
    path.write_text(json.dumps(entries))
    with pytest.raises(ValueError, match=r"\[1\]\.name: token name: character U\+202E") as err:
        load_tokens_file(path)
    assert secret not in str(err.value) and "\u202e" not in str(err.value)


@pytest.mark.slow  # runs the CLI as a process of its own
def test_controller_start_refuses_a_token_name_with_a_newline(tmp_path: Path, tg: Tg) -> None:
    secret = "s3cret-" + "y" * 20
    tokens = [{"name": "ops\nroot", "role": "operator", "token": secret}]
    env = clean_env(TRAINGUARD_TOKENS=json.dumps(tokens))
    proc = tg("controller", "--port", "0", "--database-url", f"sqlite:///{tmp_path}/x.db", env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "error: invalid controller settings: tokens.0.name: token name: character U+000A"
    )
    assert proc.stderr.count("\n") == 1 and secret not in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- invisible characters


#: Bidi override and isolates, zero-width space and joiner, word joiner, BOM.
INVISIBLE = ["\u202e", "\u2066", "\u2069", "\u200b", "\u200d", "\u2060", "\ufeff"]


@pytest.mark.parametrize("char", INVISIBLE)
def test_printable_escapes_bidi_and_zero_width_characters(char: str) -> None:
    shown = printable(f"gpu{char}-node", None)
    assert char not in shown and shown == f"gpu\\u{ord(char):04x}-node"
    assert char not in without_escapes(f"line one\nline{char} two")
    assert printable("caf\u00e9 \u4e2d\u6587", None) == "caf\u00e9 \u4e2d\u6587"  # text stays


def test_a_hostname_with_an_rtl_override_cannot_reorder_a_table_row() -> None:
    node = {
        "name": "node-1",
        "health": "healthy",
        "hostname": "\u202egpu-evil",
        "labels": {"team\u2067": "a\u200bb"},
        "gpu_count": 8,
    }
    table = render_list(NODES, [node], OutputFormat.WIDE, now_unix_s=0.0)
    assert table is not None and "\\u202egpu-evil" in table
    detail = render_node(node, OutputFormat.TABLE, now_unix_s=0.0)
    for text in (table, detail):
        assert not any(c in text for c in "\u202e\u2067\u200b"), text
    assert "team\\u2067=a\\u200bb" in detail


def test_agent_controller_url_with_a_newline_is_trimmed_or_refused() -> None:
    """Before: ``http://ctl:8470\\n`` passed a prefix check and the agent then died on
    httpx's ``InvalidURL`` at start; a space or a control character inside did the same."""
    url = AgentSettings(node_name="n", controller_url="http://ctl:8470/\n").controller_url
    assert url == "http://ctl:8470"
    for bad in ("http://ctl:8470 x", "http://ctl\n:8470", "http://ctl:8470/\u202e"):
        with pytest.raises(ValidationError, match="no spaces or control characters"):
            AgentSettings(node_name="n", controller_url=bad)
