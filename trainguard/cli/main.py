"""Entry point placeholder; the CLI is built in trainguard.cli.app."""

import sys


def main() -> None:
    from trainguard.cli.app import run

    sys.exit(run())
