"""A small DBOS 3.2 application connected to Relay: the executor of the deployment examples.

Everything comes from the environment (docker-compose.yml sets it):

- DBOS_SYSTEM_DATABASE_URL: the app's DBOS system database (created on first start);
- DBOS_CONDUCTOR_URL, DBOS_CONDUCTOR_KEY: Relay's address and a conductor key of its
  relay.yaml (the key itself; relay.yaml holds its SHA-256);
- APP_NAME, APP_VERSION: the app as Relay lists it, and its version;
- TICK_SCHEDULE: a cron schedule (seconds first) of the periodic ``tick`` workflow;
- HOST, PORT: where its HTTP endpoint listens.

HTTP:

- ``POST /orders`` starts the ``process_order`` workflow and answers ``{"workflowId": ...}``;
- ``GET /orders/<id>`` answers the workflow's status and output;
- ``GET /healthz`` answers 200 once DBOS is launched.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dbos import DBOS, DBOSConfig, SetWorkflowID


@DBOS.step()
def reserve_stock(order_id: str) -> str:
    DBOS.logger.info(f"order {order_id}: stock reserved")
    return "reserved"


@DBOS.step()
def charge_card(order_id: str) -> str:
    DBOS.logger.info(f"order {order_id}: card charged")
    return "charged"


@DBOS.workflow()
def process_order(order_id: str) -> str:
    reserve_stock(order_id)
    # A durable sleep: kill the app here and the workflow resumes after it on restart,
    # or on a peer that Relay asks to recover it.
    DBOS.sleep(1)
    charge_card(order_id)
    return f"order {order_id} done"


@DBOS.workflow()
def tick(scheduled_at: datetime, context: Any) -> None:
    DBOS.logger.info(f"tick scheduled at {scheduled_at.isoformat()}")


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        if self.path != "/orders":
            self._send(404, {"error": f"no route {self.path}"})
            return
        workflow_id = f"order-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            DBOS.start_workflow(process_order, workflow_id)
        self._send(202, {"workflowId": workflow_id})

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, {"status": "ok"})
        elif self.path.startswith("/orders/"):
            status = DBOS.get_workflow_status(self.path.removeprefix("/orders/"))
            if status is None:
                self._send(404, {"error": "no such order"})
            else:
                self._send(200, {"workflowId": status.workflow_id, "status": status.status, "output": status.output})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per health check would drown DBOS's own log


def main() -> None:
    config: DBOSConfig = {
        "name": os.environ["APP_NAME"],
        "application_version": os.environ["APP_VERSION"],
        "system_database_url": os.environ["DBOS_SYSTEM_DATABASE_URL"],
        "conductor_url": os.environ["DBOS_CONDUCTOR_URL"],
        "conductor_key": os.environ["DBOS_CONDUCTOR_KEY"],
    }
    DBOS(config=config)
    DBOS.launch()
    # Create or replace: every replica of the app may apply it at start.
    DBOS.apply_schedules([{"schedule_name": "tick", "workflow_fn": tick, "schedule": os.environ["TICK_SCHEDULE"]}])
    host, port = os.environ["HOST"], int(os.environ["PORT"])
    server = ThreadingHTTPServer((host, port), Handler)
    # As a container's first process, SIGTERM does nothing unless handled: stop at once.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"{config['name']} listening on {host}:{port}", flush=True)
    try:
        server.serve_forever()
    finally:
        DBOS.destroy(workflow_completion_timeout_sec=5)


if __name__ == "__main__":
    main()
