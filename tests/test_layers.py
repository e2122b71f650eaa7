"""The layout's promises, read from the source: who imports whom, and who writes executor rows."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXECUTOR_WRITES = re.compile(r"\b(UPDATE\s+executors|DELETE\s+FROM\s+executors|INSERT\s+INTO\s+executors)\b", re.I)


def modules(package: str) -> dict[str, Path]:
    base = ROOT / package
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted(base.rglob("*.py"))
    }


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def importers(package: str, imported: str) -> set[str]:
    return {
        name
        for name, path in modules(package).items()
        if any(i == imported or i.startswith(imported + ".") for i in imports_of(path))
    }


def test_only_the_composition_root_imports_workflows() -> None:
    assert importers("relay", "workflows") == {"relay.runtime"}


def test_workflows_never_import_the_composition_root() -> None:
    # relay -> workflows only through relay.runtime, and workflows -> relay never back to it: no cycle.
    assert importers("workflows", "relay.runtime") == set()


def test_the_core_is_pure() -> None:
    allowed = set(sys.stdlib_module_names) | {"relay.core"}
    for name, path in modules("relay/core").items():
        outside = {i for i in imports_of(path) if i.split(".")[0] not in allowed and not i.startswith("relay.core")}
        assert not outside, f"{name} imports {outside}"


@pytest.mark.parametrize("package", ["bench", "chaos", "harness"])
def test_tooling_imports_nothing_from_tests(package: str) -> None:
    assert importers(package, "tests") == set()


def test_one_module_writes_the_executors_table() -> None:
    writers = {
        name
        for package in ("relay", "workflows")
        for name, path in modules(package).items()
        if EXECUTOR_WRITES.search(path.read_text())
    }
    assert writers == {"relay.store.executors"}


def test_the_protocol_module_needs_only_the_standard_library() -> None:
    # The open executor client ships it without Relay's server dependencies.
    allowed = set(sys.stdlib_module_names) | {"relay_protocol"}
    for name, path in modules("protocol/relay_protocol").items():
        outside = {i for i in imports_of(path) if i.split(".")[0] not in allowed}
        assert not outside, f"{name} imports {outside}"
