"""A served controller campaigns for the leader lock only once it answers requests.

Why it matters: in a rolling upgrade the old leader's lock is free the moment it exits,
and a replica still starting could take it from the standbys that already serve, leaving
the API without an answering leader for the rest of its start-up (tests/helm/
test_upgrade.py measured the gap that left: 1.09 s). Checked here in one process with the
production ``Server`` and lock: when the first try for the lock begins, the replica must
already answer, and say it is not ready yet (it does not know whether it leads).
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import httpx

from controller.api.app import create_app
from controller.server import EXIT_START_FAILED, Server, bind_socket, uvicorn_config
from controller.services.leader import STARTING_DETAIL
from controller.settings import ControllerSettings


def settings_for(tmp_path: Path, **overrides: Any) -> ControllerSettings:
    token = {"name": "ops", "role": "operator", "token": secrets.token_hex(16)}
    return ControllerSettings(
        database_url=f"sqlite:///{tmp_path / 'tg.db'}",
        host="127.0.0.1",
        port=0,
        tokens=[token],
        log_level="warning",
        **overrides,
    )


async def readyz(url: str) -> tuple[int, Any]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        reply = await client.get(f"{url}/readyz")
    return reply.status_code, reply.json()


def test_served_replica_answers_before_its_first_try_for_the_lock(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    app = create_app(settings, campaign_on_start=False)  # as controller.server.serve builds it
    controller = app.state.controller
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    lock = controller.leader.lock
    take_lock = lock.try_acquire
    seen_while_campaigning: list[Any] = []

    async def watched_try_acquire() -> bool:
        try:
            seen_while_campaigning.append(await readyz(url))
        except httpx.TransportError as exc:
            seen_while_campaigning.append(f"not answering: {type(exc).__name__}")
        return bool(await take_lock())

    lock.try_acquire = watched_try_acquire

    async def scenario() -> tuple[int, Any]:
        server = Server(uvicorn_config(app, settings))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            for _ in range(3000):
                if controller.leader.is_leader or serving.done():
                    break
                await asyncio.sleep(0.01)
            return await readyz(url)
        finally:
            server.should_exit = True
            await serving

    try:
        after = asyncio.run(scenario())
    finally:
        sock.close()
    assert seen_while_campaigning == [(503, {"status": "not_ready", "detail": STARTING_DETAIL})]
    assert after == (200, {"status": "ready", "detail": ""})
    assert controller.leader.role == "stopped"  # released on shutdown


def test_with_campaign_after_ready_the_first_passed_probe_starts_the_campaign(
    tmp_path: Path,
) -> None:
    """The chart's mode: nothing probes, nothing campaigns; the first probe answered 200
    (as a standby's: the kubelet may route to the pod from now on) starts the campaign."""
    settings = settings_for(tmp_path, leader_campaign_after_ready=True)
    app = create_app(settings, campaign_on_start=False)
    controller = app.state.controller
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def scenario() -> tuple[str, tuple[int, Any], str]:
        server = Server(uvicorn_config(app, settings))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # a campaign started at once would have won by now
            unprobed = controller.leader.role
            probed = await readyz(url)
            for _ in range(3000):
                if controller.leader.is_leader:
                    break
                await asyncio.sleep(0.01)
            return unprobed, probed, controller.leader.role
        finally:
            server.should_exit = True
            await serving

    try:
        unprobed, probed, after = asyncio.run(scenario())
    finally:
        sock.close()
    assert (unprobed, probed, after) == (
        "starting",
        (200, {"status": "ready", "detail": ""}),
        "leader",
    )


def test_a_first_try_for_the_lock_that_fails_stops_the_server(tmp_path: Path) -> None:
    """The campaign runs beside the server: an error in it must stop the server (exit
    status 3, as a failed start), not leave a replica answering "starting" for ever."""
    settings = settings_for(tmp_path)
    (tmp_path / "tg.db.leader").mkdir()  # the SQLite lock file cannot be opened
    app = create_app(settings, campaign_on_start=False)
    sock = bind_socket("127.0.0.1", 0)
    server = Server(uvicorn_config(app, settings))

    async def scenario() -> None:
        await asyncio.wait_for(server.serve(sockets=[sock]), timeout=60)

    try:
        asyncio.run(scenario())
    finally:
        sock.close()
    assert server.start_failed and EXIT_START_FAILED == 3
