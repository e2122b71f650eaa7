"""dbos-mcp's tools, called one by one against a Conductor API (Relay), for tests/test_dbos_mcp.py.

Runs with the Python of a virtual environment of its own where ``dbos-mcp`` is
installed (its ``mcp[cli]`` dependency brings version ranges of its own), as a
script: ``python harness/mcp_driver.py --conductor-url URL --token KEY --organization ORG``.
It imports nothing from this repository and nothing outside the standard library
but ``dbos_mcp`` and what that brings.

The client reads its credentials from ``~/.dbos-mcp/credentials`` and its base URL
from the module constant ``dbos_mcp.client.CONDUCTOR_URL`` (0.8.0 has no setting
for either), so the driver points ``HOME`` at a directory of its own before it
imports the client, writes the file there, and sets the constant.

Each line on stdin is a call, ``{"tool": "list_workflows", "args": {...}}``, with
an optional ``"conductorUrl"`` for that call alone; each answer is one line on
stdout: ``{"ok": true, "result": <what the tool returned>}``, or
``{"ok": false, "error": "...", "status": <HTTP status, if the server answered one>}``.
Tools are called through the MCP server object, as an MCP client's call reaches
them: arguments checked against the tool's schema, the result converted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def write_credentials(home: Path, token: str, organization: str) -> None:
    folder = home / ".dbos-mcp"
    folder.mkdir(parents=True, exist_ok=True)
    credentials = {"token": token, "userName": "relay-tests", "organization": organization}
    (folder / "credentials").write_text(json.dumps(credentials, indent=2))


def result_of(answer: Any) -> Any:
    """What the tool returned: the structured content of the call's result (every dbos-mcp tool
    returns an object), else its text, as JSON."""
    structured = getattr(answer, "structured_content", None)
    if structured is not None:
        return structured
    texts = [getattr(c, "text", "") for c in getattr(answer, "content", [])]
    return json.loads(texts[0]) if len(texts) == 1 else texts


def failure(exc: BaseException) -> dict[str, Any]:
    cause: BaseException = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    response = getattr(cause, "response", None)
    status = getattr(response, "status_code", None)
    return {"ok": False, "error": f"{type(cause).__name__}: {cause}", "status": status}


async def serve(default_url: str) -> None:
    from dbos_mcp import client  # imported once HOME is set: the client reads it at import time
    from dbos_mcp.server import mcp

    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        call = json.loads(line)
        client.CONDUCTOR_URL = call.get("conductorUrl") or default_url
        try:
            answer: dict[str, Any] = {"ok": True, "result": result_of(await mcp.call_tool(call["tool"], call["args"]))}
        except Exception as exc:
            answer = failure(exc)
        print(json.dumps(answer), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conductor-url", required=True, help="e.g. http://127.0.0.1:8080/conductor/v2")
    parser.add_argument("--token", required=True)
    parser.add_argument("--organization", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dbos-mcp-home-") as home:
        os.environ["HOME"] = home
        write_credentials(Path(home), args.token, args.organization)
        asyncio.run(serve(args.conductor_url))


if __name__ == "__main__":
    main()
