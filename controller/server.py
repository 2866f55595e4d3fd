"""Run a controller process: ``serve(settings)`` blocks until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import uvicorn

from controller.api.app import create_app
from controller.logs import configure_logging
from controller.runtime import Controller, prepare_database
from controller.settings import ControllerSettings
from controller.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before serving so ``port=0`` works and the real port can be logged.

    Created as ``IPPROTO_TCP`` explicitly: asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on connections whose socket says so, and a socket made with
    protocol 0 does not. With Nagle on, a response's body (written after its headers) waited
    for the client's delayed ACK: about 40 ms added to every keep-alive request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


#: Exit status after losing the leader lock (EX_TEMPFAIL: restart me).
EXIT_LEADERSHIP_LOST = 75


def exit_for_restart(reason: str) -> None:
    """Leave at once, without the graceful shutdown's last commit.

    The controller has already stopped its periodic tasks. Flushing the group-commit queue
    now could overwrite rows the new leader has written since it took over; the reports in
    that queue were never acknowledged, so the agents' spools resend them to the new leader.
    A fresh process comes back as a standby with nothing stale in memory.
    """
    log.critical(
        "exiting: lost the leader lock; the orchestrator restarts this replica as a standby",
        extra={"fields": {"reason": reason, "exit_status": EXIT_LEADERSHIP_LOST}},
    )
    logging.shutdown()
    os._exit(EXIT_LEADERSHIP_LOST)


def uvicorn_config(app: object, settings: ControllerSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        lifespan="on",
        timeout_graceful_shutdown=5,
        log_config=None,
    )


#: Exit status when the first try for the leader lock failed (uvicorn's own for a failed start).
EXIT_START_FAILED = 3


class Server(uvicorn.Server):
    """uvicorn's server: campaigns for leadership once it listens, and ends the
    dashboard's live streams as shutdown begins.

    The election starts after the sockets accept requests (``Controller.campaign``): a
    replica that can win the lock while it cannot yet answer would leave the API down for
    the rest of its start-up, see there. Until its first try has ended, ``/readyz`` says
    "starting", so the orchestrator (and every wait for readiness) sees a lone replica
    Ready only as the leader.

    uvicorn sends the ASGI lifespan shutdown only after every open response has ended, or
    after ``timeout_graceful_shutdown`` cancels them (an ``Exception in ASGI application``
    traceback each). A stream never ends by itself, so the app must hear of the stop first:
    here, once the listening sockets are closed (a page reconnecting finds another replica).
    """

    start_failed = False
    _campaign: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        controller = _controller_of(self.config.app)
        if controller is not None and not self.should_exit:
            self._campaign = asyncio.create_task(self._run_campaign(controller))

    async def _run_campaign(self, controller: Controller) -> None:
        try:
            await controller.campaign_once_serving()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            log.error(
                f"cannot take part in the leader election ({why}); stopping",
                exc_info=True,
                extra={"fields": {"exit_status": EXIT_START_FAILED}},
            )
            self.start_failed = self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting first (uvicorn's shutdown does it again)
            server.close()
        if self._campaign is not None:  # a first try still waiting or running
            await cancel_and_wait([self._campaign])
        controller = _controller_of(self.config.app)
        if controller is not None:
            controller.services.dashboard.close()
        await super().shutdown(sockets)


def _controller_of(app: object) -> Controller | None:
    controller = getattr(getattr(app, "state", None), "controller", None)
    return controller if isinstance(controller, Controller) else None


def serve(settings: ControllerSettings) -> None:
    """Migrate (SQLite) or check (PostgreSQL) the schema, then serve until signalled.

    Raises ``controller.errors.NotMigrated`` before binding when PostgreSQL needs
    ``trainguard db upgrade``.
    """
    configure_logging(settings.log_level)
    prepare_database(settings)
    app = create_app(settings, tune_gc=True, campaign_on_start=False)
    app.state.controller.on_leadership_lost = exit_for_restart
    sock = bind_socket(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    log.info(
        "controller listening",
        extra={
            "fields": {"url": f"http://{url_host}:{port}", "database": settings.database_kind()}
        },
    )
    server = Server(uvicorn_config(app, settings))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if server.start_failed:
        raise SystemExit(EXIT_START_FAILED)
