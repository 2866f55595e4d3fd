"""Secrets stay out of ``repr``: an object logged by mistake (an f-string in a log line, a
traceback's locals, a debugger's dump) must not carry a token or a signing key with it.

The objects that hold one in memory: a freshly issued agent token and its API answer, the
webhook's HMAC key, the drill's operator token.
"""

from __future__ import annotations

from pathlib import Path

from controller.api.agent_credentials import AgentTokenIssued
from controller.services.agent_identity import IssuedToken, NodeCredential
from controller.services.webhook import Webhook
from trainguard.cli.drill import Drill, DrillConfig
from trainguard.cli.procs import ProcessSet

SECRET = "s3cret-0123456789abcdef0123456789"


def test_an_issued_agent_token_is_not_in_its_repr() -> None:
    credential = NodeCredential(node="n1", digest="d" * 64, created_unix_s=1.0, expires_unix_s=None)
    issued = IssuedToken(token=SECRET, credential=credential, previous_valid_until_unix_s=None)
    assert SECRET not in repr(issued) and "n1" in repr(issued)
    answer = AgentTokenIssued(
        node="n1", created_unix_s=1.0, expires_unix_s=None,
        token=SECRET, previous_valid_until_unix_s=None,
    )  # fmt: skip
    assert SECRET not in repr(answer) and SECRET not in str(answer)
    assert answer.model_dump()["token"] == SECRET  # the answer's body still carries it


def test_the_webhook_key_and_the_drills_token_are_not_in_their_repr(tmp_path: Path) -> None:
    hook = Webhook(url="https://example.invalid/hook", secret=SECRET.encode())
    assert SECRET not in repr(hook) and "example.invalid" in repr(hook)
    drill = Drill(config=DrillConfig(), workdir=tmp_path, procs=ProcessSet(tmp_path))
    drill.operator_token = SECRET
    assert SECRET not in repr(drill)
