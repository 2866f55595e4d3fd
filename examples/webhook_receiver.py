"""A receiver for trainguard's ``webhook`` remediation step: verify, deduplicate, act.

Run it where trainguard can reach it, with the secret the controller has
(``remediation_webhook_secret`` or ``remediation_webhook_secret_file``)::

    TRAINGUARD_WEBHOOK_SECRET=... python examples/webhook_receiver.py --port 8089

and point the controller at it: ``remediation_webhook_url: http://<host>:8089/trainguard``,
with ``webhook`` among a policy rule's steps (or a job's ``trainguard.io/policy`` steps).

Standard library only, so it can be copied into any site's tooling. What it shows:

* the signature check: HMAC-SHA256 over ``<X-Trainguard-Timestamp>.<body>``, compared in
  constant time, and a timestamp at most 5 minutes old (a replayed request is refused);
* idempotence on ``X-Trainguard-Delivery``: trainguard retries a delivery (connection
  error, timeout, 429, 5xx) under the same id, so a retry must not open a second ticket;
* the answer: 2xx with a JSON body (trainguard records it in the action's outcome, e.g. the
  ticket number); 4xx says "never send this again"; 5xx asks for a retry.

``open_ticket`` is where a site plugs in its own flow (ticketing, a repair queue, a page).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_AGE_S = 300
MAX_BODY = 1 << 20


def signature_ok(secret: bytes, timestamp: str, body: bytes, signature: str) -> bool:
    """``X-Trainguard-Signature`` is ``sha256=<hex HMAC of "<timestamp>.<body>">``."""
    if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > MAX_AGE_S:
        return False
    digest = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(f"sha256={digest}", signature)


class Tickets:
    """The site's side: one ticket per delivery (a retry gets the same ticket back)."""

    def __init__(self) -> None:
        self.by_delivery: dict[str, str] = {}
        self.lock = threading.Lock()

    def open_ticket(self, delivery: str, event: dict[str, Any]) -> str:
        with self.lock:
            if delivery not in self.by_delivery:
                ticket = f"OPS-{len(self.by_delivery) + 1}"
                self.by_delivery[delivery] = ticket
                payload = event["payload"]
                incident = payload.get("incident") or {}
                print(  # a real site files it in its tracker here
                    f"{ticket}: {incident.get('kind')} on {incident.get('node') or '-'} "
                    f"(job {payload['remediation'].get('job')}): {incident.get('summary')}",
                    flush=True,
                )
            return self.by_delivery[delivery]


def make_handler(secret: bytes, tickets: Tickets) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._answer(413, {"error": "too large"})
                return
            body = self.rfile.read(length)
            if not signature_ok(
                secret,
                self.headers.get("X-Trainguard-Timestamp", ""),
                body,
                self.headers.get("X-Trainguard-Signature", ""),
            ):
                self._answer(401, {"error": "bad or old signature"})
                return
            event = json.loads(body)
            delivery = self.headers.get("X-Trainguard-Delivery") or event["delivery"]
            self._answer(200, {"ticket": tickets.open_ticket(delivery, event)})

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8089)
    args = parser.parse_args()
    secret = os.environ.get("TRAINGUARD_WEBHOOK_SECRET", "").encode()
    if not secret:
        parser.exit(2, "set TRAINGUARD_WEBHOOK_SECRET to the controller's webhook secret\n")
    server = ThreadingHTTPServer((args.host, args.port), make_handler(secret, Tickets()))
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
