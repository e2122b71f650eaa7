"""README's REST API lists the members of each answer, which scripts and Conductor's clients are
written against: every member an answer's model has is named there (read from README, not from a
running Relay, so this costs no time)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from relay.api.alerts import AlertingRule
from relay.api.apps import Application
from relay.api.audit import AuditEntry
from relay.api.executors import Executor
from relay.api.org import Instance, WhoAmI
from relay.api.recoveries import Recovery
from relay.api.tokens import Token

README = Path(__file__).resolve().parents[1] / "README.md"

# Where README names each model's members: the start of its line (a row of the REST API's table,
# or the paragraph of the alerting-rules API).
PLACES: list[tuple[str, type[BaseModel]]] = [
    ("| `GET /v2/orgs/{org}/whoami` |", WhoAmI),
    ("| `GET /v2/orgs/{org}/instances` |", Instance),
    ("| `GET /v2/orgs/{org}/apps[?blockedFirst=true]` |", Application),
    ("| `GET /v2/orgs/{org}/apps/{app}/executors[?state=HEALTHY]` |", Executor),
    ("| `GET /v2/orgs/{org}/apps/{app}/recoveries[", Recovery),
    ("| `GET /v2/orgs/{org}/tokens` |", Token),
    ("| `GET /v2/orgs/{org}/audit[", AuditEntry),
    ("**The API.** `GET /v2/orgs/{org}/apps/{app}/alerting-rules`", AlertingRule),
]


def named_members(text: str) -> set[str]:
    """The names README gives in code spans: `a, b, c`, `a (x or y)`, `secretSet`... (not a path's
    `{org}` or `{app}`, which are no members)."""
    names: set[str] = set()
    for span in re.findall(r"`([^`]*)`", text):
        if "/" not in span:
            names |= set(re.findall(r"\b([a-z][A-Za-z0-9]*)\b", span))
    return names


@pytest.mark.parametrize(("start", "model"), PLACES, ids=[m.__name__ for _, m in PLACES])
def test_readme_names_every_member_of_the_answer(start: str, model: type[BaseModel]) -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    found = [n for n, line in enumerate(lines) if line.startswith(start)]
    assert len(found) == 1, f"README has {len(found)} lines starting {start!r}"
    # A table row is one line; a paragraph runs to its blank line.
    end = next((n for n in range(found[0], len(lines)) if not lines[n].strip()), len(lines))
    text = lines[found[0]] if start.startswith("|") else " ".join(lines[found[0] : end])
    missing = set(model.model_fields) - named_members(text)
    assert missing == set(), f"README does not name {sorted(missing)} of {model.__name__}"
