"""Run a controller process: ``serve(settings)`` blocks until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import os
import socket

import uvicorn

from controller.api.app import create_app
from controller.logs import configure_logging
from controller.runtime import prepare_database
from controller.settings import ControllerSettings

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


class Server(uvicorn.Server):
    """uvicorn's server, ending the dashboard's live streams as shutdown begins.

    uvicorn sends the ASGI lifespan shutdown only after every open response has ended, or
    after ``timeout_graceful_shutdown`` cancels them (an ``Exception in ASGI application``
    traceback each). A stream never ends by itself, so the app must hear of the stop first:
    here, once the listening sockets are closed (a page reconnecting finds another replica).
    """

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting first (uvicorn's shutdown does it again)
            server.close()
        controller = getattr(getattr(self.config.app, "state", None), "controller", None)
        if controller is not None:
            controller.services.dashboard.close()
        await super().shutdown(sockets)


def serve(settings: ControllerSettings) -> None:
    """Migrate (SQLite) or check (PostgreSQL) the schema, then serve until signalled.

    Raises ``controller.errors.NotMigrated`` before binding when PostgreSQL needs
    ``trainguard db upgrade``.
    """
    configure_logging(settings.log_level)
    prepare_database(settings)
    app = create_app(settings, tune_gc=True)
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
