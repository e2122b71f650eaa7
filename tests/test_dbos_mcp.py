"""dbos-mcp 0.8.0, DBOS's MCP server for Conductor, pointed at Relay: each tool's answer checked
against what the executor's system database holds.

dbos-mcp runs in a virtual environment of its own (``.venv-mcp/`` at the repository root,
made on first use and kept; its ``mcp[cli]`` dependency brings version ranges of its own)
and is driven by harness/mcp_driver.py, which calls its tools one at a time. Relay serves a
real DBOS app (harness/workflow_app.py) with one executor; the test reads that app's system
database with psycopg, never through Relay.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.waiting import assert_eventually

ROOT = Path(__file__).resolve().parents[1]
MCP_VENV = ROOT / ".venv-mcp"
MCP_VERSION = "0.8.0"
DRIVER = ROOT / "harness" / "mcp_driver.py"
APP = "ledger"


def mcp_python() -> Path:
    """The Python of ``.venv-mcp``, with dbos-mcp installed there first if it is not yet."""
    python = MCP_VENV / "bin" / "python"
    probe = [str(python), "-c", "import dbos_mcp, importlib.metadata as m; print(m.version('dbos-mcp'))"]

    def installed() -> bool:
        if not python.exists():
            return False
        return subprocess.run(probe, capture_output=True, text=True).stdout.strip() == MCP_VERSION

    with open(ROOT / ".venv-mcp.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once make it once
        if not installed():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(MCP_VENV)], check=True)
            pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
            subprocess.run([*pip, f"dbos-mcp=={MCP_VERSION}"], check=True, timeout=900)
            assert installed(), "dbos-mcp did not install in .venv-mcp"
    return python


class McpDriver:
    """harness/mcp_driver.py in a subprocess: one tool call per line."""

    def __init__(self, python: Path, conductor_url: str, token: str, organization: str, log: Path) -> None:
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            [str(python), str(DRIVER), "--conductor-url", conductor_url, "--token", token,
             "--organization", organization],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT,
        )  # fmt: skip
        assert self._answer() == {"ok": True, "ready": True}

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the driver exited: {self.proc.poll()}"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, tool: str, conductor_url: str | None = None, **args: Any) -> Any:
        """The tool's result; fails the test with the client's error if the call failed."""
        answer = self.attempt(tool, conductor_url, **args)
        assert answer["ok"], f"{tool}({args}) failed: {answer}"
        return answer["result"]

    def attempt(self, tool: str, conductor_url: str | None = None, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"tool": tool, "args": args, "conductorUrl": conductor_url}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


class SystemDatabase:
    """The app's DBOS system database, read directly."""

    def __init__(self, url: str) -> None:
        self.url = url

    def rows(self, sql: str, *params: Any) -> list[dict[str, Any]]:
        with psycopg.connect(self.url, row_factory=dict_row) as conn:
            return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]

    def workflows(self, status: list[str] | None = None, names: list[str] | None = None) -> list[dict[str, Any]]:
        """Rows in Conductor's order (oldest first), filtered as ``list_workflows`` filters."""
        return self.rows(
            "SELECT * FROM dbos.workflow_status WHERE (%s::text[] IS NULL OR status = ANY(%s))"
            " AND (%s::text[] IS NULL OR name = ANY(%s)) ORDER BY created_at, workflow_uuid",
            status, status, names, names,
        )  # fmt: skip

    def workflow(self, workflow_id: str) -> dict[str, Any] | None:
        rows = self.rows("SELECT * FROM dbos.workflow_status WHERE workflow_uuid = %s", workflow_id)
        return rows[0] if rows else None

    def status(self, workflow_id: str) -> str | None:
        row = self.workflow(workflow_id)
        return row["status"] if row else None


def ms_iso(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@pytest.fixture(scope="module")
def world(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[McpDriver, SystemDatabase, ExecutorProcess, RelayProcess]]:
    python = mcp_python()
    workdir = tmp_path_factory.mktemp("mcp")
    failed_before = request.session.testsfailed
    with ExitStack() as stack:
        relay = RelayProcess(workdir, postgres.create_database("relay"), relay_yaml(free_port())).start()
        stack.callback(relay.stop)
        sysdb = SystemDatabase(postgres.create_database("sys"))
        env = {"RELAY_TEST_SEED": "1"}
        executor = ExecutorProcess(workdir, sysdb.url, relay.conductor_url, module="harness.workflow_app", env=env)
        stack.callback(executor.stop)
        driver = McpDriver(python, f"{relay.http}/conductor/v2", API_KEYS["acme"], "acme", workdir / "driver.log")
        stack.callback(driver.close)
        # A run of the hourly schedule must not land between a tool's answer and the check.
        driver.call("pause_schedule", application_name=APP, schedule_name="every-hour")
        paused = sysdb.rows("SELECT status FROM dbos.workflow_schedules WHERE schedule_name = 'every-hour'")
        assert paused == [{"status": "PAUSED"}]
        # The fixtures settle: the queue drains, the waiting workflow's child finishes (and any run
        # of the schedule that started before the pause).
        settling = ["job", "child", "tick"]
        assert_eventually(lambda: not sysdb.workflows(["ENQUEUED", "PENDING"], settling), 30, what="settled")
        yield driver, sysdb, executor, relay
        if request.session.testsfailed > failed_before:
            print(f"--- driver ---\n{(workdir / 'driver.log').read_text(errors='replace')[-4000:]}")
            print(f"--- relay ---\n{relay.log()[-6000:]}")


World = tuple[McpDriver, SystemDatabase, ExecutorProcess, RelayProcess]


def test_apps_and_executors(world: World) -> None:
    driver, sysdb, executor, relay = world
    apps = driver.call("list_applications")
    assert apps["count"] == 1 and apps["applications"][0]["name"] == APP
    assert apps["applications"][0]["status"] == "AVAILABLE"
    # The URL dbos-mcp is told to use may also be Relay's own /v2, without the /conductor prefix.
    assert driver.call("list_applications", f"{relay.http}/v2") == apps

    executors = driver.call("list_executors", application_name=APP)
    assert [(e["executorId"], e["status"]) for e in executors["executors"]] == [(executor.executor_id, "HEALTHY")]
    ran_on = {row["executor_id"] for row in sysdb.workflows()}
    assert ran_on == {executor.executor_id}, "the system database names the executor the tool lists"


@pytest.mark.parametrize(
    ("status", "names"),
    [
        (None, None),
        (["SUCCESS"], None),
        (["ERROR"], None),
        (["SUCCESS", "PENDING"], ["parent", "odd"]),
        (None, ["job"]),
    ],
)
def test_listed_workflows_are_the_system_databases(
    world: World, status: list[str] | None, names: list[str] | None
) -> None:
    driver, sysdb, _, _ = world
    listed = driver.call("list_workflows", application_name=APP, status=status, workflow_name=names)
    rows = sysdb.workflows(status, names)
    assert listed["count"] == len(rows) > 0
    got = {w["workflowId"]: (w["status"], w["workflowName"], w["createdAt"]) for w in listed["workflows"]}
    assert got == {r["workflow_uuid"]: (r["status"], r["name"], ms_iso(r["created_at"])) for r in rows}
    created = [w["createdAt"] for w in listed["workflows"]]
    assert created == sorted(created), "oldest first"


def test_a_limited_list_is_the_oldest_and_a_descending_one_the_newest(world: World) -> None:
    driver, sysdb, _, _ = world
    rows = sysdb.workflows(["SUCCESS"])
    assert len(rows) > 3
    for sort_desc in (False, True):
        listed = driver.call("list_workflows", application_name=APP, status="SUCCESS", limit=3, sort_desc=sort_desc)
        ids = [w["workflowId"] for w in listed["workflows"]]
        assert len(ids) == 3 and set(ids) <= {r["workflow_uuid"] for r in rows}
        kept = [r["created_at"] for r in rows if r["workflow_uuid"] in ids]
        left = [r["created_at"] for r in rows if r["workflow_uuid"] not in ids]
        if sort_desc:
            assert min(kept) >= max(left)
        else:
            assert max(kept) <= min(left)


def test_one_workflow_its_steps_and_its_events(world: World) -> None:
    driver, sysdb, executor, _ = world
    for workflow_id in ("done-1", "odd?x=1", "odd/steps", "odd#frag"):
        got = driver.call("get_workflow", application_name=APP, workflow_id=workflow_id)
        row = sysdb.workflow(workflow_id)
        assert row is not None
        assert (got["workflowId"], got["status"], got["workflowName"]) == (workflow_id, row["status"], row["name"])
        assert (got["executorId"], got["appVersion"]) == (executor.executor_id, row["application_version"])
        assert (got["createdAt"], got["updatedAt"]) == (ms_iso(row["created_at"]), ms_iso(row["updated_at"]))
        assert got["applicationName"] == row["application_name"] == APP

    steps = driver.call("list_steps", application_name=APP, workflow_id="done-1")
    rows = sysdb.rows(
        "SELECT function_id, function_name, child_workflow_id, started_at_epoch_ms FROM dbos.operation_outputs"
        " WHERE workflow_uuid = 'done-1' ORDER BY function_id"
    )
    assert steps["count"] == len(rows) > 5
    assert [(s["stepId"], s["stepName"], s["childWorkflowId"], s["startedAt"]) for s in steps["steps"]] == [
        (r["function_id"], r["function_name"], r["child_workflow_id"], ms_iso(r["started_at_epoch_ms"])) for r in rows
    ]
    page = driver.call("list_steps", application_name=APP, workflow_id="done-1", limit=2, offset=1)
    assert [s["stepId"] for s in page["steps"]] == [r["function_id"] for r in rows[1:3]]

    from dbos._serialization import DefaultSerializer, deserialize_value

    events = driver.call("get_workflow_events", application_name=APP, workflow_id="done-1")
    stored = sysdb.rows("SELECT key, value, serialization FROM dbos.workflow_events WHERE workflow_uuid = 'done-1'")
    assert events["count"] == len(stored) == 1
    assert {e["key"]: e["value"] for e in events["events"]} == {
        r["key"]: str(deserialize_value(r["value"], r["serialization"], DefaultSerializer())) for r in stored
    }

    missing = driver.attempt("get_workflow", application_name=APP, workflow_id="no-such-workflow")
    assert not missing["ok"] and missing["status"] == 404


def test_one_workflow_comes_with_its_input_output_and_error(world: World) -> None:
    """Conductor's getWorkflow takes no loadInput/loadOutput: dbos-mcp's get_workflow "always returns" them."""
    from dbos._serialization import DefaultSerializer, deserialize_value

    def stored(workflow_id: str) -> dict[str, str | None]:
        """The workflow's input, output and error as the executor writes them in text (DBOS 3.2
        keeps them in tables of their own)."""
        [row] = sysdb.rows(
            "SELECT i.inputs, o.output, o.error, s.serialization FROM dbos.workflow_status s"
            " JOIN dbos.workflow_input i USING (workflow_uuid) JOIN dbos.workflow_output o USING (workflow_uuid)"
            " WHERE workflow_uuid = %s",
            workflow_id,
        )
        return {
            name: None if row[column] is None else str(deserialize_value(row[column], row["serialization"], serializer))
            for name, column in (("input", "inputs"), ("output", "output"), ("error", "error"))
        }

    driver, sysdb, _, _ = world
    serializer = DefaultSerializer()
    for workflow_id in ("done-1", "failed-1"):
        got = driver.call("get_workflow", application_name=APP, workflow_id=workflow_id)
        assert {k: got[k] for k in ("input", "output", "error")} == stored(workflow_id)
    done = driver.call("get_workflow", application_name=APP, workflow_id="done-1")
    assert (done["input"], done["output"], done["error"]) == (
        "{'args': (1, 30.0), 'kwargs': {}}",
        "TOTAL 2 2 hello",
        None,
    )
    failed = driver.call("get_workflow", application_name=APP, workflow_id="failed-1")
    assert (failed["status"], failed["output"], failed["error"]) == ("ERROR", None, "failed on purpose with 3")
    # A list leaves them out unless asked.
    listed = driver.call("list_workflows", application_name=APP, workflow_uuids=["done-1"])["workflows"]
    assert [(w["input"], w["output"]) for w in listed] == [(None, None)]
    listed = driver.call("list_workflows", application_name=APP, workflow_uuids=["done-1"], load_output=True)
    assert [w["output"] for w in listed["workflows"]] == ["TOTAL 2 2 hello"]


def test_versions(world: World) -> None:
    driver, sysdb, _, _ = world
    versions = driver.call("list_application_versions", application_name=APP)
    rows = sysdb.rows("SELECT * FROM dbos.application_versions")
    assert versions["count"] == len(rows) == 1
    assert [
        (v["versionId"], v["versionName"], v["versionTimestamp"], v["createdAt"]) for v in versions["versions"]
    ] == [(r["version_id"], r["version_name"], ms_iso(r["version_timestamp"]), ms_iso(r["created_at"])) for r in rows]


def test_cancel_resume_fork_and_bulk_cancel_reach_the_system_database(world: World) -> None:
    driver, sysdb, _, _ = world
    assert sysdb.status("waiting-1") == "PENDING"
    done = driver.call("cancel_workflow", application_name=APP, workflow_id="waiting-1")
    assert done == {"message": "Workflow cancelled", "workflow_id": "waiting-1"}
    assert sysdb.status("waiting-1") == "CANCELLED"

    driver.call("resume_workflow", application_name=APP, workflow_id="waiting-1")
    assert_eventually(lambda: sysdb.status("waiting-1") == "PENDING", 15, what="waiting-1 resumed")

    fork = driver.call("fork_workflow", application_name=APP, workflow_id="queued-0", start_step=1)
    assert fork["forked_from"] == "queued-0" and fork["workflow_id"]
    forked = assert_eventually(lambda: sysdb.workflow(fork["workflow_id"]), 10, what="the fork's row")
    assert forked["forked_from"] == "queued-0" and forked["name"] == "job"
    assert_eventually(lambda: sysdb.status(fork["workflow_id"]) == "SUCCESS", 15, what="the fork finished")
    source = sysdb.workflow("queued-0")
    assert source is not None and source["was_forked_from"] is True
    listed = driver.call("list_workflows", application_name=APP, forked_from="queued-0")
    assert [w["workflowId"] for w in listed["workflows"]] == [fork["workflow_id"]]

    bulk = driver.call("bulk_cancel_workflows", application_name=APP, workflow_ids=["waiting-1", "done-1"])
    assert bulk["count"] == 2
    assert sysdb.status("waiting-1") == "CANCELLED"
    assert sysdb.status("done-1") == "SUCCESS", "a finished workflow stays as it finished"
