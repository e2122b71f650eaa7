"""Relay's database URL as SQLAlchemy takes it, for DBOS's engine and the grace-period starter's.

``database.url`` is what libpq reads: a ``postgresql://`` URL, perhaps of several hosts
(``postgresql://u@primary:5432,standby:5432/db?target_session_attrs=read-write``, how libpq reaches
a database that fails over), or ``key=value`` pairs. Relay's own connections hand it to libpq as it
is; SQLAlchemy parses URLs its own way (``sa.make_url``), refusing key=value pairs and reading a
host list as one host with a bad port. Here libpq's parse of it (psycopg's ``conninfo_to_dict``)
becomes a ``postgresql+psycopg`` URL: user, password and database in their places, every other
parameter in the query, several hosts as ``?host=h1,h2&port=p1,p2``, which SQLAlchemy's PostgreSQL
dialects pass on to libpq as such.
"""

from __future__ import annotations

import sqlalchemy as sa
from psycopg.conninfo import conninfo_to_dict

DRIVER = "postgresql+psycopg"


def sqlalchemy_url(conninfo: str) -> sa.URL:
    """``conninfo`` (a URL or key=value pairs that libpq reads) as a SQLAlchemy URL to the same
    database, with the same parameters."""
    params = {name: str(value) for name, value in conninfo_to_dict(conninfo).items()}
    user, password, database = params.pop("user", None), params.pop("password", None), params.pop("dbname", None)
    host, port = params.get("host", ""), params.get("port", "")
    # One host by name or address (not a Unix socket's folder): in the URL's place, as it is usually written.
    single = host and "," not in host and "," not in port and not host.startswith("/") and (not port or port.isdigit())
    if single:
        del params["host"]
        params.pop("port", None)
    return sa.URL.create(
        DRIVER,
        username=user,
        password=password,
        host=host if single else None,
        port=int(port) if single and port else None,
        database=database,
        query=params,
    )


def sqlalchemy_url_text(conninfo: str) -> str:
    """:func:`sqlalchemy_url` as a string (DBOS takes its ``system_database_url`` as one); it holds
    the password, so it is never logged (DBOS logs its URLs with the password hidden)."""
    return sqlalchemy_url(conninfo).render_as_string(hide_password=False)
