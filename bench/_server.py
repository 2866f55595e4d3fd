"""One controller served by uvicorn in a thread, for benches that talk to it over HTTP only.

Shared by bench.traffic_api and bench.dashboard (they had grown two copies of it).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn


class Server:
    """A controller on SQLite in ``workdir`` with one random token per role."""

    def __init__(
        self,
        workdir: Path,
        roles: tuple[str, ...],
        *,
        client_timeout_s: float = 60.0,
        **settings: Any,
    ) -> None:
        from controller.api.app import create_app
        from controller.server import uvicorn_config
        from controller.settings import ControllerSettings

        self.tokens = {r: f"{r}-{secrets.token_hex(12)}" for r in roles}
        self.client_timeout_s = client_timeout_s
        config = ControllerSettings(
            database_url=f"sqlite:///{workdir / 'bench.db'}",
            host="127.0.0.1",
            port=0,
            tokens=[{"name": r, "role": r, "token": t} for r, t in self.tokens.items()],
            log_level="warning",
            # One agent token for every simulated node (the controller's default is off).
            **{"allow_shared_agent_tokens": True, **settings},
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(create_app(config), config))
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("controller did not start")
            time.sleep(0.02)

    def client(self, role: str) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.tokens[role]}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=self.client_timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
