"""A webhook receiver: a small real HTTP server, in a thread, that records every POST.

Tests and chaos runs aim alert rules at it and read what arrived. It can be
told to fail (answer 503) for a while, as a receiver that is down does.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Delivery:
    at: float
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    status: int  # what the receiver answered

    @property
    def payload(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.body)
        return value

    @property
    def accepted(self) -> bool:
        return 200 <= self.status < 300


class WebhookReceiver:
    def __init__(self) -> None:
        self._deliveries: list[Delivery] = []
        self._lock = threading.Lock()
        self.fail_until = 0.0
        self.fail_status = 503
        self.refused_prefix: str | None = None  # POSTs to paths starting with it are answered 400, always
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status = receiver.fail_status if time.time() < receiver.fail_until else 200
                if receiver.refused_prefix is not None and self.path.startswith(receiver.refused_prefix):
                    status = 400
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver._lock:
                    receiver._deliveries.append(Delivery(time.time(), self.path, headers, body, status))
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def url(self, path: str = "/hooks/relay") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def fail_for(self, seconds: float, status: int = 503) -> None:
        self.fail_status = status
        self.fail_until = time.time() + seconds

    def deliveries(self, kind: str | None = None, accepted: bool | None = None) -> list[Delivery]:
        with self._lock:
            found = list(self._deliveries)
        return [
            d
            for d in found
            if (kind is None or d.headers.get("x-relay-event") == kind) and (accepted is None or d.accepted == accepted)
        ]

    def payloads(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The bodies of the deliveries it accepted (of ``kind``), in the order they came."""
        return [d.payload for d in self.deliveries(kind, accepted=True)]
