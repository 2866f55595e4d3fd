"""``python -m agents``: run the node agent with flags mirroring ``trainguard agent``.

Flags override ``TRAINGUARD_AGENT_*`` environment variables, which override defaults. Bad
settings print one line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from agents.errors import AgentError
from agents.settings import load_settings

# (flag, settings field, type)
_FLAGS: list[tuple[str, str, Any]] = [
    ("--controller", "controller_url", str),
    ("--token", "token", str),
    ("--token-file", "token_file", str),
    ("--node-name", "node_name", str),
    ("--gpus", "gpus", str),
    ("--dev-dir", "dev_dir", str),
    ("--nvml-timeout", "nvml_timeout_s", float),
    ("--sysfs-root", "sysfs_root", str),
    ("--sim-seed", "sim_seed", int),
    ("--sim-fault-file", "sim_fault_file", str),
    ("--sample-interval", "sample_interval_s", float),
    ("--report-interval", "report_interval_s", float),
    ("--report-timeout", "report_timeout_s", float),
    ("--backoff-max", "backoff_max_s", float),
    ("--spool-dir", "spool_dir", str),
    ("--spool-max-bytes", "spool_max_bytes", int),
    ("--socket-path", "socket_path", str),
    ("--job-listen", "job_listen", str),
    ("--job-token-file", "job_token_file", str),
    ("--client-idle-timeout", "client_idle_timeout_s", float),
    ("--metrics-host", "metrics_host", str),
    ("--metrics-port", "metrics_port", int),
    ("--node-base-power-w", "node_base_power_w", float),
    ("--powercap-dir", "powercap_dir", str),
    ("--log-level", "log_level", str),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m agents", description="trainguard node agent")
    for flag, dest, kind in _FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, default=None)
    parser.add_argument(
        "--sim-fault",
        dest="sim_faults",
        action="append",
        default=None,
        help="fault spec, e.g. kind=xid,code=79,gpu=3,at=20 (repeatable)",
    )
    parser.add_argument(
        "--sim-no-permission", dest="sim_no_permission", action="store_true", default=None
    )
    parser.add_argument(
        "--foreground",
        dest="foreground",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="exit non-zero when NVML fails on a GPU node (default: when stdin is a terminal)",
    )
    parser.add_argument(
        "--label",
        dest="labels",
        action="append",
        default=None,
        help="node label key=value (repeatable)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    overrides = {k: v for k, v in args.items() if v is not None}
    if "labels" in overrides:
        labels = {}
        for item in overrides["labels"]:
            key, sep, value = item.partition("=")
            if not sep or not key:
                print(
                    f"python -m agents: error: --label {item!r}: expected key=value",
                    file=sys.stderr,
                )
                return 2
            labels[key] = value
        overrides["labels"] = labels
    try:
        settings = load_settings(**overrides)
        from agents.daemon import run

        run(settings)
    except AgentError as exc:
        print(f"python -m agents: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
