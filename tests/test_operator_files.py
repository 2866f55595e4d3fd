"""Operator files (topology, policy, controller config, tokens, power domains, power
traces) that a typo, a truncation or a generated file can break: each is refused in one
line with exit status 2, where before it was silently half-read or died with a traceback.

* a key given twice (``nodes:`` twice) lost the first value without a word;
* an empty policy file became the built-in policy, which isolates and restarts;
* deep nesting raised RecursionError (exit 1, traceback);
* a trace CSV with a column twice, a field over 128 KiB or an Excel byte-order mark.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from controller.logic.remediation.rules import PolicyError, Step, load_policy
from tests.environ import clean_env
from trainguard.cli.app import run
from trainguard.textfile import TOO_DEEP, Unparsable, load_json, load_yaml

if TYPE_CHECKING:
    from tests.conftest import Tg

Cli = Callable[..., tuple[int, str, str]]

#: Deeper than the parsers' recursion allows (json and PyYAML both recurse per level).
DEEP_YAML = "a: " + "[" * 5000 + "]" * 5000 + "\n"
DEEP_JSON = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"

TOPOLOGY_TWO_NODES_KEYS = """\
switches:
  - {name: leaf0, tier: 1}
  - {name: spine0, tier: 2}
cables:
  - {lower: leaf0, upper: spine0}
nodes:
  - {name: n0, nics: [{ports: [{leaf: leaf0}]}]}
nodes:
  - {name: n1, nics: [{ports: [{leaf: leaf0}]}]}
"""


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    """The CLI in-process: (exit status, stdout, stderr)."""
    monkeypatch.delenv("TRAINGUARD_DEBUG", raising=False)

    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = run(list(args), prog_name="trainguard")
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return invoke


def _one_line(result: tuple[int, str, str]) -> str:
    """The single ``error:`` line of a run refused with exit status 2."""
    code, out, err = result
    assert code == 2, (code, out, err)
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("error: "), err
    return err.strip()


# ---------------------------------------------------------------------------- the loader


def test_yaml_key_given_twice_is_refused_with_its_line() -> None:
    with pytest.raises(Unparsable) as info:
        load_yaml("rules: []\nguards: {}\nrules: [x]\n")
    assert info.value.reason == "duplicate key 'rules' at line 3"
    with pytest.raises(Unparsable, match="duplicate key 'a' at line 3"):
        load_yaml("- {x: 1}\n- {a: 1, b: 2,\n   a: 3}\n")


def test_yaml_merge_may_still_override_what_it_brings_in() -> None:
    text = "base: &b {a: 1, b: 2}\nmine: {<<: *b, a: 5}\n"
    assert load_yaml(text)["mine"] == {"a": 5, "b": 2}


def test_yaml_loader_stays_safe() -> None:
    with pytest.raises(Unparsable, match="could not determine a constructor"):
        load_yaml("x: !!python/object/apply:os.system [echo hi]\n")
    assert load_yaml("a: &x [1]\nb: *x\n") == {"a": [1], "b": [1]}  # aliases as before
    assert load_yaml("") is None


def test_json_key_given_twice_is_refused() -> None:
    with pytest.raises(Unparsable, match="duplicate key 'nodes'"):
        load_json('{"nodes": [1], "nodes": [2]}')
    assert load_json('{"a": {"b": 1}}') == {"a": {"b": 1}}


def test_deep_nesting_is_one_reason_not_a_recursion_error() -> None:
    for load, text in ((load_yaml, DEEP_YAML), (load_json, DEEP_JSON)):
        with pytest.raises(Unparsable) as info:
            load(text)
        assert info.value.reason == TOO_DEEP


# ------------------------------------------------------------------------- the policy


@pytest.mark.parametrize("text", ["", "# rules to come\n", "---\n"])
def test_an_empty_policy_file_is_refused_not_defaulted(tmp_path: Path, text: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value).startswith(f"policy file {path} is empty")


def test_a_policy_of_braces_asks_for_the_defaults_on_purpose(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("{}\n")
    assert load_policy(path).rule_for("gpu_fault", "critical").steps[-1] is Step.RESTART  # type: ignore[union-attr]


# ------------------------------------------------------------------ the CLI, exit status 2


def test_plan_simulate_refuses_a_topology_with_nodes_twice(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "topology.yaml"
    path.write_text(TOPOLOGY_TWO_NODES_KEYS)
    assert _one_line(cli("plan", "simulate", "-t", str(path))) == (
        f"error: {path}: cannot parse: duplicate key 'nodes' at line 8"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "simulate", "-t", "{file}"], "error: {file}: cannot parse: nested too deeply"),
        (["power", "domains", "{file}"], "error: {file}: not valid JSON: nested too deeply"),
    ],
)
def test_deeply_nested_json_is_one_line(
    cli: Cli, tmp_path: Path, args: list[str], message: str
) -> None:
    path = tmp_path / "deep.json"
    path.write_text(DEEP_JSON)
    filled = [a.replace("{file}", str(path)) for a in args]
    assert _one_line(cli(*filled)) == message.replace("{file}", str(path))


def test_power_domains_refuses_a_key_given_twice(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "domains.yaml"
    path.write_text("name: row1\nkind: row\nbudget_w: 100\nbudget_w: 200\n")
    assert _one_line(cli("power", "domains", str(path))) == (
        f"error: {path}: not valid YAML: duplicate key 'budget_w' at line 4"
    )


TRACE_ROWS = (
    "0,a,800,high,training\n1,a,800,high,training\n2,a,810,high,training\n"
    "0,b,700,low,inference\n1,b,700,low,inference\n2,b,710,low,inference\n"
)
TRACE_HEADER = "time_s,server,gpu_power_w,priority,workload"


def _simulate(cli: Cli, path: Path) -> tuple[int, str, str]:
    return cli("power", "simulate", str(path), "--base-servers", "2", "--extra", "1")


def test_power_trace_with_a_column_twice_is_refused(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    rows = "".join(line + "," + line.split(",")[0] + "\n" for line in TRACE_ROWS.splitlines())
    path.write_text(TRACE_HEADER + ",time_s\n" + rows)
    assert _one_line(_simulate(cli, path)) == (
        f"error: {path}: column 'time_s' appears more than once"
    )


def test_power_trace_with_a_huge_field_names_its_line(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(TRACE_HEADER + "\n" + TRACE_ROWS + "3,a," + "9" * 200_000 + ",high,training\n")
    message = _one_line(_simulate(cli, path))
    assert message == f"error: {path}:8: not valid CSV: field larger than field limit (131072)"


def test_power_trace_saved_by_excel_with_a_byte_order_mark_reads(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (TRACE_HEADER + "\n" + TRACE_ROWS).encode())
    code, out, err = _simulate(cli, path)
    assert (code, err) == (0, "")
    assert "3 (2 + 1, +50.0%)" in out


# ------------------------------------------------------------- the controller refuses to start


def _controller_refuses(tg: Tg, tmp_path: Path, config: str) -> str:
    """Start ``trainguard controller --config`` as a process of its own (a start that wrongly
    succeeds would serve forever: the timeout ends it and fails the test) and return its
    one-line refusal: exit 2, no traceback (a dev-mode warning may come first)."""
    path = tmp_path / "controller.yaml"
    path.write_text(config)
    env = clean_env()
    database = f"sqlite:///{tmp_path / 'tg.db'}"
    done = tg(
        "controller", "--dev", "--port", "0", "--database-url", database, "--config", str(path),
        env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert all(not line.startswith("error: ") for line in lines[:-1]), done.stderr
    return lines[-1]


def test_controller_refuses_an_empty_policy_file(tmp_path: Path, tg: Tg) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("# truncated\n")
    message = _controller_refuses(tg, tmp_path, f"policy_file: {policy}\n")
    assert message.startswith(f"error: policy file {policy} is empty")


def test_controller_refuses_a_policy_with_rules_twice(tmp_path: Path, tg: Tg) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "rules:\n  - {kind: '*', steps: [alert]}\nrules:\n  - {kind: gpu_fault, steps: [isolate]}\n"
    )
    message = _controller_refuses(tg, tmp_path, f"policy_file: {policy}\n")
    assert (
        message == f"error: policy file {policy} is not valid YAML: duplicate key 'rules' at line 3"
    )


def test_controller_refuses_a_config_file_with_a_setting_twice(tmp_path: Path, tg: Tg) -> None:
    message = _controller_refuses(tg, tmp_path, "node_lost_after_s: 5\nnode_lost_after_s: 7\n")
    path = tmp_path / "controller.yaml"
    assert message == (
        f"error: config file {path}: not valid YAML: duplicate key 'node_lost_after_s' at line 2"
    )


def test_controller_refuses_a_deeply_nested_config_file(tmp_path: Path, tg: Tg) -> None:
    message = _controller_refuses(tg, tmp_path, DEEP_YAML)
    path = tmp_path / "controller.yaml"
    assert message == f"error: config file {path}: not valid YAML: nested too deeply"


def test_controller_refuses_a_tokens_file_with_a_field_twice(tmp_path: Path, tg: Tg) -> None:
    tokens = tmp_path / "tokens.yaml"
    token = "t" * 32
    tokens.write_text(f"- {{name: a, role: viewer, token: {token},\n   role: operator}}\n")
    message = _controller_refuses(tg, tmp_path, f"tokens_file: {tokens}\n")
    assert message == (
        f"error: invalid controller settings: tokens_file {tokens}: not valid YAML: "
        "duplicate key 'role' at line 2"
    )


def test_controller_refuses_a_topology_file_with_nodes_twice(tmp_path: Path, tg: Tg) -> None:
    topology = tmp_path / "topology.yaml"
    topology.write_text(TOPOLOGY_TWO_NODES_KEYS)
    message = _controller_refuses(tg, tmp_path, f"topology_file: {topology}\n")
    assert (
        message == f"error: topology_file {topology}: cannot parse: duplicate key 'nodes' at line 8"
    )


def test_a_mapping_merged_from_deeper_in_the_file_is_no_duplicate() -> None:
    """PyYAML flattens an anchored mapping in place when a shallower one merges it,
    before that mapping is itself constructed: its merged keys then sat beside its own and
    the file was refused as giving ``k`` twice (found in review of 41c9ae9). The loader
    reads what ``yaml.safe_load`` reads."""
    text = "a:\n  b: &y\n    <<: {k: 1}\n    k: 2\nc:\n  <<: *y\n"
    assert load_yaml(text) == yaml.safe_load(text)


def test_the_controller_refuses_bad_topology_labels_in_one_line(tmp_path: Path, tg: Tg) -> None:
    """``topology_labels: {spines: 2.5}`` was taken as 2 spines, planned on in silence."""
    refusal = _controller_refuses(tg, tmp_path, "topology_labels: {spines: 2.5}\n")
    assert refusal == "error: topology_labels: spines must be a whole number, got 2.5"
