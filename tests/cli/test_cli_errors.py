"""Exit statuses and one-line errors: 2 for what the user typed, 1 for outages."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli.cli_testkit import CliResult, CliServer
from trainguard.cli.app import run
from trainguard.ports import free_port

Cli = Callable[..., CliResult]


def _one_line(result: CliResult, code: int) -> str:
    assert result.code == code, (result.out, result.err)
    assert result.out == ""
    assert result.err.endswith("\n") and result.err.count("\n") == 1, result.err
    assert result.err.startswith("error: ")
    assert "Traceback" not in result.err
    return result.err.strip()


def test_unknown_node_is_exit_2(cli: Cli) -> None:
    assert _one_line(cli("node", "nope"), 2) == 'error: node "nope" not found'


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["nodes", "-o", "xml"], "'xml' is not one of"),
        (["nodes", "--bogus"], "no such option: --bogus"),
        (["nodes", "--health", "sick"], "'sick' is not one of"),
        (["incidents", "--state", "closed"], "'closed' is not one of"),
        (["node"], "missing argument"),
        (["frobnicate"], "no such command 'frobnicate'"),
        (["status", "-o", "name"], 'output format "name" is not supported by status'),
        (
            ["nodes", "--server", "localhost:8470"],
            'invalid controller URL "localhost:8470" (--server or TRAINGUARD_SERVER)',
        ),
        (["controller", "--port", "70000"], "'--port'"),
        (["controller", "--config", "/nonexistent/tg.yaml"], "does not exist"),
        (["agent", "--gpus", "tpu:4", "--controller", "http://127.0.0.1:1"], "gpus"),
        (
            ["agent", "--sim-fault", "kind=xid,gpu=x", "--controller", "http://127.0.0.1:1"],
            "sim_faults",
        ),
        (["demo", "--scenario", "meteor"], "'--scenario'"),
    ],
)
def test_usage_errors_are_one_line_exit_2(cli: Cli, args: list[str], fragment: str) -> None:
    message = _one_line(cli(*args), 2)
    assert fragment in message


def test_usage_error_names_the_command_to_get_help(cli: Cli) -> None:
    assert _one_line(cli("nodes", "--bogus"), 2).endswith("(see 'trainguard nodes --help')")


def test_unreachable_controller_is_exit_1(cli: Cli) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    message = _one_line(cli("nodes", "--server", url), 1)
    assert message == (
        f"error: cannot reach controller at {url}: connection refused; is it running? "
        "In a cluster use your kubeconfig (--context, -n) or `kubectl port-forward`"
    )


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://[zz]", "'zz' does not appear to be an IPv4 or IPv6 address"),
        ("http://[::1]:99999", "Port out of range 0-65535"),
        ("http://host:port", "Port could not be cast to integer value as 'port'"),
    ],
)
def test_a_server_url_that_does_not_parse_is_exit_2(cli: Cli, url: str, problem: str) -> None:
    assert _one_line(cli("nodes", "--server", url), 2) == (
        f'error: invalid controller URL "{url}": {problem}'
    )


def test_kubectl_short_server_flag_is_refused_with_a_hint(cli: Cli) -> None:
    """kubectl's -s names the API server; taking it as the controller would be a trap."""
    message = _one_line(cli("nodes", "-s", "https://10.0.0.1:6443"), 2)
    assert "-s is kubectl's API-server flag" in message and "--server URL" in message


def test_server_flag_and_kubeconfig_flags_exclude_each_other(cli: Cli) -> None:
    message = _one_line(cli("nodes", "--server", "http://127.0.0.1:1", "--context", "x"), 2)
    assert "give one or the other" in message


def test_missing_and_wrong_token_are_explained(
    cli: Cli, cli_server: CliServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINGUARD_TOKEN")
    assert _one_line(cli("nodes"), 1) == "error: unauthorized: set --token or TRAINGUARD_TOKEN"
    wrong = _one_line(cli("nodes", "--token", "not-the-token-at-all"), 1)
    assert wrong.startswith("error: unauthorized: the controller rejected the token")


BAD_TOKEN = (
    "error: invalid token (--token or TRAINGUARD_TOKEN): it may hold only visible ASCII "
    "characters, no spaces or line breaks inside it"
)


def test_a_token_read_from_a_secret_keeps_working_with_its_newline(
    cli: Cli, cli_server: CliServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = cli_server.viewer_token
    assert cli("nodes", "-o", "name", "--token", f"{token}\n").code == 0
    monkeypatch.setenv("TRAINGUARD_TOKEN", f" {token}\r\n")
    assert cli("nodes", "-o", "name").code == 0


@pytest.mark.parametrize("token", ["s3cr3t\r\nX-Evil: 1", "s3cr3t s3cr3t", "s3cr3t\x00"])
def test_a_token_that_cannot_be_a_header_is_exit_2_and_never_printed(
    cli: Cli, cli_server: CliServer, token: str
) -> None:
    # The controller listens: without the check the request would be tried, and httpx's
    # complaint (which quotes the header, secret and all) reported as an outage.
    assert _one_line(cli("nodes", "--token", token), 2) == BAD_TOKEN


@pytest.mark.parametrize("token", ["é", "s3cr3t-é", "s3cr3t\u00a0s3cr3t"])
def test_a_token_that_is_not_ascii_is_exit_2_and_never_printed(cli: Cli, token: str) -> None:
    # httpx would fail encoding the header (UnicodeEncodeError, exit 1) or send it as Latin-1.
    assert _one_line(cli("nodes", "--token", token), 2) == BAD_TOKEN


def test_a_blank_token_is_exit_2(cli: Cli) -> None:
    message = _one_line(cli("nodes", "--token", " \n"), 2)
    assert message == "error: the token (--token or TRAINGUARD_TOKEN) is blank"


def test_the_token_is_checked_on_the_service_proxy_path_too() -> None:
    from trainguard.cli.client import ApiClient
    from trainguard.cli.errors import BadInput
    from trainguard.cli.kubeproxy import TOKEN_HEADER, ProxyEndpoint

    proxy = ProxyEndpoint(base_url=f"http://127.0.0.1:{free_port()}", verify=False)
    with pytest.raises(BadInput) as info:
        ApiClient.through(proxy, "s3cr3t\nX-Evil: 1")
    assert "s3cr3t" not in str(info.value)
    with ApiClient.through(proxy, "s3cr3t\n") as api:
        assert api._http.headers[TOKEN_HEADER] == "s3cr3t"


def test_a_header_httpx_cannot_send_is_not_an_outage_nor_printed(cli_server: CliServer) -> None:
    """Whatever header is refused (a kubeconfig's credentials, say), its value stays out."""
    import httpx

    from trainguard.cli.client import ApiClient
    from trainguard.cli.errors import BadInput

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.LocalProtocolError("Illegal header value b'Bearer s3cr3t\\n'", request=request)

    api = ApiClient(cli_server.url)
    api.close()
    api._http = httpx.Client(base_url=api.server, transport=httpx.MockTransport(refuse))
    with api, pytest.raises(BadInput) as info:
        api.status()
    assert str(info.value) == (
        f"cannot send the request to controller at {cli_server.url}: a header is not valid "
        "HTTP (check the token and your kubeconfig's credentials)"
    )


def test_agent_token_is_forbidden_for_reads(cli: Cli, cli_server: CliServer) -> None:
    message = _one_line(cli("nodes", "--token", cli_server.agent_token), 1)
    assert message.startswith("error: forbidden:")


def test_server_and_token_come_from_the_environment(cli: Cli, cli_server: CliServer) -> None:
    result = cli("nodes", "-o", "name")
    assert result.code == 0 and result.out.startswith("node/")


def test_connection_flags_before_or_after_the_command(
    cli: Cli, cli_server: CliServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINGUARD_SERVER")
    monkeypatch.delenv("TRAINGUARD_TOKEN")
    url, token = cli_server.url, cli_server.viewer_token
    dead = f"http://127.0.0.1:{free_port()}"
    before = cli("--server", url, "--token", token, "nodes", "-o", "name")
    assert before.code == 0 and len(before.out.split()) == 3
    after = cli("nodes", "--server", url, "--token", token, "-o", "name")
    assert after.out == before.out
    # The flag after the command wins over the one before it, which wins over the env.
    monkeypatch.setenv("TRAINGUARD_SERVER", dead)
    assert cli("--server", url, "--token", token, "nodes").code == 0
    assert cli("--server", dead, "--token", token, "nodes", "--server", url).code == 0
    assert _one_line(cli("--server", url, "--token", token, "nodes", "--server", dead), 1)


def test_no_arguments_prints_help_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert run([], prog_name="trainguard") == 0
    assert "Usage: trainguard" in capsys.readouterr().out


def test_console_script_exit_codes_and_no_traceback() -> None:
    port = free_port()
    bad = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "nodes", "-o", "bogus"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1
    down = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "status", "--server", f"http://127.0.0.1:{port}"],
        capture_output=True,
        text=True,
    )
    assert down.returncode == 1
    assert down.stderr.startswith(
        f"error: cannot reach controller at http://127.0.0.1:{port}: connection refused; "
    )
    assert down.stderr.count("\n") == 1


def test_debug_env_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_DEBUG", "1")
    from trainguard.cli.errors import Unreachable

    with pytest.raises(Unreachable):
        run(["nodes", "--server", f"http://127.0.0.1:{free_port()}"])


def test_agent_nvml_without_a_driver_is_one_line_exit_2(cli: Cli, tmp_path: Path) -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # pragma: no cover - a machine with a GPU driver would start a real agent
        pynvml.nvmlShutdown()
        pytest.skip("NVML works here; this test is about its absence")
    args = ["--controller", "http://127.0.0.1:9", "--gpus", "nvml"]
    args += ["--spool-dir", str(tmp_path), "--socket-path", "", "--metrics-port", "-1"]
    message = _one_line(cli("agent", *args), 2)
    assert "NVML not available" in message


def test_bad_policy_file_refuses_to_start_with_exit_2(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules: [{kind: hang, steps: [reboot]}]\n")
    monkeypatch.setenv("TRAINGUARD_POLICY_FILE", str(policy))
    database = f"sqlite:///{tmp_path / 'tg.db'}"
    result = cli("controller", "--dev", "--port", "0", "--database-url", database)
    assert result.code == 2, result.err
    last = result.err.strip().splitlines()[-1]  # a dev-mode warning may come first
    assert last.startswith("error: policy file") and "rules.0.steps.0" in last


BINARY = b"\xff\xfe\x00\x01 not text"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["power", "domains", "{file}"], "error: {file}: cannot read: not UTF-8 text"),
        (["plan", "show", "{file}"], "error: {file}: not UTF-8 text"),
        (["power", "domains", "{dir}"], "error: {dir}: cannot read: Is a directory"),
        (["plan", "show", "{dir}"], "error: {dir}: Is a directory"),
    ],
)
def test_a_file_that_is_not_text_is_one_line_exit_2(
    cli: Cli, tmp_path: Path, args: list[str], message: str
) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(BINARY)
    where = {"{file}": str(binary), "{dir}": str(tmp_path)}

    def fill(text: str) -> str:
        for key, value in where.items():
            text = text.replace(key, value)
        return text

    assert _one_line(cli(*map(fill, args)), 2) == fill(message)


@pytest.mark.parametrize(
    ("variable", "message"),
    [
        ("TRAINGUARD_POLICY_FILE", "error: cannot read policy file {file}: not UTF-8 text"),
        ("TRAINGUARD_LOCAL_JOBS_FILE", "error: cannot read local_jobs_file {file}: not UTF-8 text"),
    ],
)
def test_controller_refuses_a_file_that_is_not_text_with_exit_2(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, message: str
) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(BINARY)
    monkeypatch.setenv(variable, str(binary))
    assert _controller_refuses(cli, tmp_path) == message.format(file=binary)


def _controller_refuses(cli: Cli, tmp_path: Path, *args: str) -> str:
    """Start ``trainguard controller`` (dev mode, its own SQLite) and return its one-line
    refusal: exit 2, no traceback (a dev-mode warning may come first)."""
    database = f"sqlite:///{tmp_path / 'tg.db'}"
    result = cli("controller", "--dev", "--port", "0", "--database-url", database, *args)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err
    lines = result.err.strip().splitlines()
    assert all(not line.startswith("error: ") for line in lines[:-1]), result.err
    return lines[-1]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "error: topology_file {file}: No such file or directory"),
        (BINARY, "error: topology_file {file}: not UTF-8 text"),
        (
            b"nodes: [\n  x: 1\n",
            "error: topology_file {file}: cannot parse: expected ',' or ']', but got "
            "'<stream end>' at line 3, column 1",
        ),
        (
            b"- a\n- b\n",
            "error: topology_file {file}: topology: expected a mapping at the top level",
        ),
    ],
)
def test_controller_refuses_a_bad_topology_file_with_exit_2(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes | None, message: str
) -> None:
    topology = tmp_path / "topology.yaml"
    if content is not None:
        topology.write_bytes(content)
    monkeypatch.setenv("TRAINGUARD_TOPOLOGY_FILE", str(topology))
    assert _controller_refuses(cli, tmp_path) == message.format(file=topology)
    monkeypatch.setenv("TRAINGUARD_TOPOLOGY_FILE", str(tmp_path))
    assert _controller_refuses(cli, tmp_path) == f"error: topology_file {tmp_path}: Is a directory"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (BINARY, "error: config file {file}: not UTF-8 text"),
        (
            b"port: [8470\nhost: x\n",
            "error: config file {file}: not valid YAML: expected ',' or ']', but got ':' "
            "at line 2, column 5",
        ),
        (
            b"- port: 8470\n",
            "error: config file {file}: expected a mapping of settings (name: value), got a list",
        ),
    ],
)
@pytest.mark.parametrize("given_by", ["--config", "TRAINGUARD_CONFIG_FILE"])
def test_controller_refuses_a_bad_config_file_with_exit_2(
    cli: Cli,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    content: bytes,
    message: str,
    given_by: str,
) -> None:
    config = tmp_path / "controller.yaml"
    config.write_bytes(content)
    monkeypatch.setenv("TRAINGUARD_CONFIG_FILE", str(config))  # --config sets it: undone after
    args = ["--config", str(config)] if given_by == "--config" else []
    assert _controller_refuses(cli, tmp_path, *args) == message.format(file=config)


def test_controller_refuses_a_missing_config_file_from_the_environment(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pydantic-settings skips a YAML file that is not there; a named one must be.
    missing = tmp_path / "nope.yaml"
    monkeypatch.setenv("TRAINGUARD_CONFIG_FILE", str(missing))
    # Were the file skipped, this bad setting would refuse the start (not serve forever).
    monkeypatch.setenv("TRAINGUARD_LOG_LEVEL", "loud")
    message = _controller_refuses(cli, tmp_path)
    assert message == f"error: config file {missing}: No such file or directory"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (BINARY, "not UTF-8 text"),
        (b"- {name: a, role: [x\n", "not valid YAML: expected ',' or ']', but got '<stream end>'"),
    ],
)
def test_controller_refuses_a_bad_tokens_file_in_one_line(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes, problem: str
) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_bytes(content)
    monkeypatch.setenv("TRAINGUARD_TOKENS_FILE", str(tokens))
    message = _controller_refuses(cli, tmp_path)
    assert message.startswith(
        f"error: invalid controller settings: tokens_file {tokens}: {problem}"
    )


def test_controller_refuses_tokens_that_are_not_json_with_exit_2(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_TOKENS", "not json")
    assert _controller_refuses(cli, tmp_path) == (
        "error: invalid controller settings: tokens: TRAINGUARD_TOKENS is not valid JSON "
        "(Expecting value at line 1, column 1)"
    )


USAGE = "use sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("bogus://x", f"unsupported database 'bogus'; {USAGE}"),
        ("mysql://db/tg", f"unsupported database 'mysql'; {USAGE}"),
        ("not a url", f"not a database URL; {USAGE}"),
        (
            "postgresql+nodriver://db/tg",
            f"no driver 'postgresql+nodriver' in this install; {USAGE}",
        ),
    ],
)
def test_an_unusable_database_url_is_one_line_exit_2(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, problem: str
) -> None:
    expected = f"error: invalid controller settings: database_url: {problem}"
    monkeypatch.setenv("TRAINGUARD_DATABASE_URL", url)
    result = cli("controller", "--dev", "--port", "0")
    assert result.code == 2 and result.err.strip().splitlines()[-1] == expected, result.err
    monkeypatch.delenv("TRAINGUARD_DATABASE_URL")
    assert _controller_refuses(cli, tmp_path, "--database-url", url) == expected
    assert _one_line(cli("db", "upgrade", "--database-url", url), 2) == (
        f"error: --database-url: {problem}"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["node", ""], "node name must not be empty"),
        (["node", "  "], "node name must not be empty"),
        (["goodput", ""], "job name must not be empty"),
        (["plan", "get", ""], "plan id must not be empty"),
        (["isolate", "", "--reason", "drill"], "node name must not be empty"),
        (["release", ""], "node name must not be empty"),
        (["agent-token", "issue", ""], "node name must not be empty"),
        (["agent-token", "revoke", ""], "node name must not be empty"),
        (["preflight", "node-a", ""], "node name must not be empty"),
        (["incidents", "--node", ""], "node name must not be empty"),
        (["incidents", "--job", " "], "job name must not be empty"),
    ],
)
def test_an_empty_name_is_refused_before_any_request(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    # Nothing listens here: a request would be exit 1 (unreachable), not this usage error.
    monkeypatch.setenv("TRAINGUARD_SERVER", f"http://127.0.0.1:{free_port()}")
    assert _one_line(cli(*args), 2) == f"error: {message}"


@pytest.mark.parametrize("name", ["a/b", "ghost/history", ".", ".."])
def test_a_name_is_one_path_segment(cli: Cli, name: str) -> None:
    # Not another endpoint ("/nodes/ghost/history") nor a folded path ("/nodes/.."): no
    # node can have that name, so it is refused before a request (test_cli_node_names).
    assert _one_line(cli("node", name), 2).startswith("error: invalid node name ")


def test_a_redirect_is_an_error_not_a_json_parse(cli_server: CliServer) -> None:
    from trainguard.cli.client import ApiClient
    from trainguard.cli.errors import ServerError

    with (
        ApiClient(cli_server.url, cli_server.viewer_token) as api,
        pytest.raises(ServerError) as info,
    ):
        api._get("/api/v1/nodes/")
    assert str(info.value) == (
        f"controller at {cli_server.url} redirected GET /api/v1/nodes/ to "
        f"{cli_server.url}/api/v1/nodes instead of answering; check --server"
    )


@pytest.mark.parametrize(
    ("status", "headers", "message"),
    [
        (
            400,
            {"server": "nginx/1.25"},
            "controller rejected the request: HTTP 400 Bad Request with no detail, "
            "from {url} (Server: nginx/1.25)",
        ),
        (404, {}, "HTTP 404 Not Found with no detail, from {url}"),
        (
            503,
            {},
            "controller at {url} answered 503: HTTP 503 Service Unavailable with no detail, "
            "from {url}",
        ),
    ],
)
def test_an_error_with_an_empty_body_names_the_status_and_who_answered(
    status: int, headers: dict[str, str], message: str
) -> None:
    """An ingress or another service on the port answers errors with an empty body."""
    import httpx

    from trainguard.cli.client import ApiClient
    from trainguard.cli.errors import CliError

    url = f"http://127.0.0.1:{free_port()}"
    api = ApiClient(url)
    api.close()
    answer = httpx.MockTransport(lambda _request: httpx.Response(status, headers=headers))
    api._http = httpx.Client(base_url=api.server, transport=answer)
    with api, pytest.raises(CliError) as info:
        api.status()
    assert str(info.value) == message.format(url=url)


def test_agent_bad_token_file_is_one_line_exit_2_in_the_foreground(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agents.daemon

    def no_agent(*_args: object, **_kw: object) -> None:
        raise AssertionError("the agent started with an unusable token file")

    monkeypatch.setattr(agents.daemon, "Agent", no_agent)
    (tmp_path / "binary").write_bytes(b"\x80 not a token\n")
    (tmp_path / "empty").write_text("")
    args = ["--controller", "http://127.0.0.1:9", "--gpus", "sim:1", "--foreground"]
    args += ["--spool-dir", str(tmp_path / "spool"), "--socket-path", "", "--metrics-port", "-1"]
    for name, reason in [
        ("missing", "No such file or directory"),
        ("binary", "not UTF-8 text"),
        ("empty", "empty; it must hold the agent's token"),
        ("", "Is a directory"),
    ]:
        path = tmp_path / name
        message = _one_line(cli("agent", *args, "--token-file", str(path)), 2)
        assert message == f"error: token_file {path}: {reason}"
