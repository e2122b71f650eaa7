"""The deployment examples in deploy/: validated offline, checked against Relay and the sample
app, and the compose example's services run as local processes.

There is no Docker daemon and no cluster here. The compose file is validated against the
compose-spec JSON schema (tests/schemas/compose-spec.json) and the Kubernetes manifests against
Kubernetes' own schemas (kubernetes-validate ships them; no network). What a schema cannot see
(keys, ports, probe paths, references between objects) is checked by tests/deploy_checks.py, and
each of those checks is shown to catch a broken copy of the files. Then the compose file's
services are started the way compose would start them (harness/compose.py) against the test
PostgreSQL, and the sample app's executor and workflows are read through Relay's API.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import socket
import subprocess
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import referencing.exceptions
import yaml

from harness.compose import ComposeError, build, compose_up, read_dockerfile
from harness.postgres import Postgres
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.config import parse_config
from tests.deploy_checks import (
    COMPOSE_FILE,
    COMPOSE_SCHEMA,
    ROOT,
    compose_problems,
    compose_schema_errors,
    k8s_problems,
    k8s_schema_errors,
    load_k8s,
)

# The README's demo API key (relay.yaml holds its hash; checked below).
DEMO_API_KEY = "demo-admin-key-change-me"
Doc = dict[str, Any]


def compose() -> Doc:
    document: Doc = yaml.safe_load(COMPOSE_FILE.read_text())
    return document


# --- schemas ---


def test_compose_file_follows_the_compose_spec() -> None:
    assert compose_schema_errors(compose()) == []


def test_compose_schema_catches_a_misspelled_key_and_a_wrong_type() -> None:
    document = compose()
    relay = document["services"]["relay"]
    relay["helthcheck"] = relay.pop("healthcheck")
    document["services"]["sample-app"]["depends_on"] = "relay"
    errors = compose_schema_errors(document)
    assert any("helthcheck" in e for e in errors), errors
    assert any(e.startswith("services.sample-app.depends_on") for e in errors), errors


def test_k8s_manifests_follow_the_kubernetes_schemas() -> None:
    _, documents = load_k8s()
    kinds = sorted(d["kind"] for d in documents)
    assert kinds == ["ConfigMap", "Namespace", "PodDisruptionBudget", "Secret", "Service", "Service", "StatefulSet"]
    assert k8s_schema_errors(documents) == []


def test_k8s_schemas_catch_a_misspelled_field_and_a_wrong_type() -> None:
    _, documents = load_k8s()
    sts = next(d for d in documents if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    errors = k8s_schema_errors([sts])
    assert errors and all("'readinesProbe' was unexpected" in e for e in errors), errors
    sts["spec"]["replicas"] = "three"
    errors = k8s_schema_errors([sts])
    assert errors and all("spec.replicas" in e for e in errors), errors


def test_schema_validation_needs_no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The schemas are read from files (vendored, or shipped in kubernetes-validate)."""
    tried: list[object] = []

    def no_network(*args: object, **_: object) -> None:
        tried.append(args)
        raise OSError("no network in this test")

    for name in ("getaddrinfo", "create_connection"):
        monkeypatch.setattr(socket, name, no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    _, documents = load_k8s()
    assert compose_schema_errors(compose()) == [] and k8s_schema_errors(documents) == []
    # A reference outside the vendored compose schema is an error, not a download (with
    # warnings as errors, jsonschema's warning before a download would hide one: let it pass).
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    schema["properties"]["name"] = {"$ref": "https://example.com/name.json"}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    with warnings.catch_warnings(), pytest.raises(referencing.exceptions.Unresolvable):
        warnings.simplefilter("ignore", DeprecationWarning)
        compose_schema_errors(compose(), tmp_path / "schema.json")
    assert tried == []


# --- what the files must agree on ---


def test_compose_file_agrees_with_relay_and_the_sample_app() -> None:
    assert compose_problems(compose()) == []


def _service(name: str) -> Callable[[Doc], Doc]:
    return lambda doc: doc["services"][name]


def _env(name: str) -> Callable[[Doc], Doc]:
    return lambda doc: doc["services"][name]["environment"]


def _set(where: Callable[[Doc], Doc], key: str, value: Any) -> Callable[[Doc], None]:
    return lambda doc: where(doc).__setitem__(key, value)


def _drop(where: Callable[[Doc], Doc], key: str) -> Callable[[Doc], None]:
    return lambda doc: where(doc).pop(key) and None


def _rename(where: Callable[[Doc], Doc], old: str, new: str) -> Callable[[Doc], None]:
    return lambda doc: where(doc).__setitem__(new, where(doc).pop(old))


COMPOSE_BREAKS: list[tuple[str, Callable[[Doc], None], str]] = [
    ("wrong conductor key", _set(_env("sample-app"), "DBOS_CONDUCTOR_KEY", "nope"), "not a conductorKey"),
    ("app env unset", _drop(_env("sample-app"), "TICK_SCHEDULE"), "reads TICK_SCHEDULE, which is not set"),
    ("conductor port", _set(_env("sample-app"), "DBOS_CONDUCTOR_URL", "ws://relay:8081/"), "conductor_url"),
    ("conductor host", _set(_env("sample-app"), "DBOS_CONDUCTOR_URL", "ws://localhost:8080/"), "conductor_url"),
    ("no instance id", _drop(_env("relay"), "RELAY_INSTANCE_ID"), "RELAY_INSTANCE_ID is not set"),
    ("misspelled var", _rename(_env("relay"), "RELAY_DATABASE_URL", "RELAY_DB_URL"), "sets RELAY_DB_URL, which"),
    ("db password", _set(_env("relay"), "RELAY_DATABASE_URL", "postgresql://relay:x@postgres:5432/relay"), "password"),
    ("db name", _set(_env("relay"), "RELAY_DATABASE_URL", "postgresql://relay:relay-demo-password@postgres/x"),
     "not the one the postgres service creates"),
    ("app db host", _set(_env("sample-app"), "DBOS_SYSTEM_DATABASE_URL", "postgresql://relay@db/s"), "not a postgres"),
    ("probe path", _set(_service("relay"), "healthcheck", {"test": ["CMD", "curl", "http://127.0.0.1:8080/healthz"]}),
     "checks /healthz, should be /readyz"),
    ("probe port", _set(_service("relay"), "healthcheck", {"test": ["CMD", "curl", "http://127.0.0.1:80/readyz"]}),
     "checks port 80"),
    ("published port", _set(_service("relay"), "ports", ["8081:8081"]), "listens on 8080"),
    ("relay command port", _set(_service("relay"), "command", ["relay", "serve", "--port", "9000"]), "listens on 9000"),
    ("relay.yaml missing", _set(_service("relay"), "volumes", ["./relay.yml:/etc/relay/relay.yaml:ro"]),
     "does not exist"),
    ("no build context", _set(_service("sample-app"), "build", "../nowhere"), "no Dockerfile"),
    ("image's check", _drop(_service("relay"), "healthcheck"), "checks /healthz, should be /readyz"),
    ("healthy without check", lambda doc: (
        doc["services"].__setitem__("cache", {"image": "redis:7"}),
        doc["services"]["sample-app"]["depends_on"].__setitem__("cache", {"condition": "service_healthy"})),
     "waits for cache to be healthy, which has no health check"),
]  # fmt: skip


@pytest.mark.parametrize(("break_it", "expected"), [b[1:] for b in COMPOSE_BREAKS], ids=[b[0] for b in COMPOSE_BREAKS])
def test_compose_checks_catch(break_it: Callable[[Doc], None], expected: str) -> None:
    document = compose()
    break_it(document)
    problems = compose_problems(document)
    assert any(expected in p for p in problems), problems


def test_k8s_manifests_agree_with_relay() -> None:
    assert k8s_problems(*load_k8s()) == []


def _kind(kind: str) -> Callable[[list[Doc]], Doc]:
    return lambda docs: next(d for d in docs if d["kind"] == kind)


def _container(docs: list[Doc]) -> Doc:
    container: Doc = _kind("StatefulSet")(docs)["spec"]["template"]["spec"]["containers"][0]
    return container


def _container_env(name: str) -> Callable[[list[Doc]], Doc]:
    return lambda docs: next(e for e in _container(docs)["env"] if e["name"] == name)


def _k8s_set(where: Callable[[list[Doc]], Doc], path: str, value: Any) -> Callable[[list[Doc]], None]:
    def change(docs: list[Doc]) -> None:
        target = where(docs)
        *parents, last = path.split(".")
        for key in parents:
            target = target[key]
        target[last] = value

    return change


K8S_BREAKS: list[tuple[str, Callable[[list[Doc]], None], str]] = [
    ("instance id fixed",
     _k8s_set(_container_env("RELAY_INSTANCE_ID"), "valueFrom", {"fieldRef": {"fieldPath": "metadata.uid"}}),
     "RELAY_INSTANCE_ID must come from the pod's name"),
    ("secret name", _k8s_set(_container_env("RELAY_DATABASE_URL"), "valueFrom.secretKeyRef.name", "relay-db"),
     "Secret relay-db with key url is not here"),
    ("database url inline", _k8s_set(_container_env("RELAY_DATABASE_URL"), "valueFrom", None),
     "must come from a Secret"),
    ("readiness path", _k8s_set(_container, "readinessProbe.httpGet.path", "/healthz"), "should be /readyz"),
    ("liveness path", _k8s_set(_container, "livenessProbe.httpGet.path", "/readyz"), "should be /healthz"),
    ("probe port", _k8s_set(_container, "readinessProbe.httpGet.port", 9090), "checks port 9090"),
    ("container port", _k8s_set(_container, "ports", [{"name": "http", "containerPort": 9090}]), "not a containerPort"),
    ("relay args", _k8s_set(_container, "args", ["relay", "serve", "--port", "9000"]), "listens on 9000"),
    ("service name", _k8s_set(_kind("StatefulSet"), "spec.serviceName", "relay-headless"), "not a headless Service"),
    ("replicas", _k8s_set(_kind("StatefulSet"), "spec.replicas", 1), "the example runs three"),
    ("config volume", _k8s_set(_kind("ConfigMap"), "metadata.name", "relay-conf"),
     "RELAY_CONFIG /etc/relay/relay.yaml"),
    ("bad relay.yaml", _k8s_set(_kind("ConfigMap"), "data", {"relay.yaml": "server: {port: x}"}),
     "invalid configuration"),
    ("service selector", _k8s_set(_kind("Service"), "spec.selector", {"app": "relay"}), "does not select Relay's pods"),
    ("service target", _k8s_set(_kind("Service"), "spec.ports", [{"port": 80, "targetPort": 8081}]), "does not lead"),
    ("pdb selector", _k8s_set(_kind("PodDisruptionBudget"), "spec.selector.matchLabels", {"a": "b"}),
     "does not select"),
    ("no requests", _k8s_set(_container, "resources", {}), "requests are not set"),
    ("relay var typo", lambda docs: _container(docs)["env"].append({"name": "RELAY_INSTANCE", "value": "x"}),
     "sets RELAY_INSTANCE, which Relay does not read"),
]  # fmt: skip


@pytest.mark.parametrize(("break_it", "expected"), [b[1:] for b in K8S_BREAKS], ids=[b[0] for b in K8S_BREAKS])
def test_k8s_checks_catch(break_it: Callable[[list[Doc]], None], expected: str) -> None:
    kustomization, documents = load_k8s()
    documents = copy.deepcopy(documents)
    break_it(documents)
    problems = k8s_problems(kustomization, documents)
    assert any(expected in p for p in problems), problems


def test_k8s_checks_catch_a_manifest_left_out_of_the_kustomization() -> None:
    kustomization, documents = load_k8s()
    kustomization["resources"].remove("poddisruptionbudget.yaml")
    assert any("kustomization.yaml lists" in p for p in k8s_problems(kustomization, documents))


# --- the images, built as their Dockerfiles say ---


def test_a_dockerfile_that_leaves_a_package_out_builds_an_image_that_cannot_run(tmp_path: Path) -> None:
    """The replay really builds from what the Dockerfile copies (the compose run uses the real one)."""
    broken = tmp_path / "Dockerfile"
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY workflows ./workflows\n" in text
    broken.write_text(text.replace("COPY workflows ./workflows\n", ""))
    image = build(read_dockerfile(broken), ROOT, tmp_path / "image")
    imported = subprocess.run(
        [str(image.python), "-c", "import relay.runtime"], cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert imported.returncode != 0 and "No module named 'workflows'" in imported.stderr, imported.stderr


def test_an_image_whose_files_are_missing_or_whose_requirements_are_not_met_does_not_build(tmp_path: Path) -> None:
    context = tmp_path / "app"
    shutil.copytree(ROOT / "deploy" / "sample-app", context)
    (context / "requirements.txt").write_text("dbos>=3.3\n")
    with pytest.raises(ComposeError, match=r"dbos>=3.3 wanted, 3\.2"):
        build(read_dockerfile(context / "Dockerfile"), context, tmp_path / "image1")
    (context / "requirements.txt").write_text("dbos>=3.2,<3.3\n")
    (context / "app.py").unlink()
    with pytest.raises(ComposeError, match=r"COPY app\.py: no such file"):
        build(read_dockerfile(context / "Dockerfile"), context, tmp_path / "image2")


# --- the compose example, run ---


def _demo_org(document: Doc) -> tuple[str, str]:
    """(org, app) of the sample app, as relay.yaml names them (the org of its conductor key)."""
    env = document["services"]["sample-app"]["environment"]
    config = parse_config((COMPOSE_FILE.parent / "relay.yaml").read_text())
    digest = hashlib.sha256(env["DBOS_CONDUCTOR_KEY"].encode()).hexdigest()
    org = next(o for o in config.orgs if any(k.sha256 == digest for k in o.conductor_keys))
    assert hashlib.sha256(DEMO_API_KEY.encode()).hexdigest() in [k.sha256 for k in org.api_keys]
    return org.name, env["APP_NAME"]


def test_compose_example_runs_as_local_processes(postgres: Postgres, tmp_path: Path) -> None:
    document = compose()
    org, app = _demo_org(document)
    app_env = document["services"]["sample-app"]["environment"]
    run_dir = tmp_path / "compose"
    run_dir.mkdir()
    # As the postgres image does, only POSTGRES_DB exists at first; DBOS creates its own.
    created = document["services"]["postgres"]["environment"]["POSTGRES_DB"]

    def database(name: str) -> str:
        return postgres.create_database(name) if name == created else postgres.reserve_database(name)

    with ExitStack() as stack:
        run = stack.enter_context(compose_up(COMPOSE_FILE, run_dir, database))
        relay, sample = run.services["relay"], run.services["sample-app"]
        try:
            run.wait_healthy(sample, 60)
            # Relay runs from what its Dockerfile built, not from this checkout.
            assert relay.image is not None
            where = subprocess.run(
                [str(relay.image.python), "-c", "import relay, workflows; print(relay.__file__, workflows.__file__)"],
                env=run.environment(relay), cwd=tmp_path, capture_output=True, text=True, check=True,
            ).stdout.split()  # fmt: skip
            assert all(Path(p).is_relative_to(relay.image.site) for p in where), where

            (relay_port,) = relay.ports
            (app_port,) = sample.ports
            api = httpx.Client(
                base_url=f"{run.url('relay', relay_port)}/v2/orgs/{org}/apps/{app}",
                headers={"Authorization": f"Bearer {DEMO_API_KEY}"},
                timeout=30,
                verify=TLS,
            )
            stack.callback(api.close)

            def connected() -> list[Doc]:
                executors: list[Doc] = api.get("/executors").json()
                return [e for e in executors if e["state"] == "HEALTHY"]

            (executor,) = assert_eventually(connected, 30, what="the sample app's executor HEALTHY in Relay")
            assert executor["relayInstance"] == document["services"]["relay"]["environment"]["RELAY_INSTANCE_ID"]
            assert executor["applicationVersion"] == app_env["APP_VERSION"]
            assert executor["dbosVersion"].startswith("3.2")

            # A workflow started on the app's HTTP endpoint, read through Relay.
            order = httpx.post(f"{run.url('sample-app', app_port)}/orders", timeout=10, verify=TLS)
            assert order.status_code == 202
            workflow_id = order.json()["workflowId"]

            def finished(workflow_id: str) -> Doc | None:
                response = api.get(f"/workflows/{workflow_id}")
                workflow: Doc = response.json() if response.status_code == 200 else {}
                return workflow if workflow.get("status") == "SUCCESS" else None

            workflow = assert_eventually(lambda: finished(workflow_id), 30, what="the order workflow SUCCESS")
            assert workflow["workflowName"] == "process_order" and "done" in (workflow["output"] or "")
            steps = [s["stepName"] for s in api.get(f"/workflows/{workflow_id}/steps").json()]
            assert steps == ["reserve_stock", "DBOS.sleep", "charge_card"], steps
            mine = httpx.get(f"{run.url('sample-app', app_port)}/orders/{workflow_id}", timeout=10, verify=TLS).json()
            assert mine["status"] == "SUCCESS"

            # The periodic workflow's schedule, as the app applied it, triggered through Relay.
            schedule = api.get("/schedules/tick").raise_for_status().json()
            assert schedule["cronExpression"] == app_env["TICK_SCHEDULE"] and schedule["workflowName"] == "tick"
            tick_id = api.post("/schedules/tick/trigger").raise_for_status().json()["workflowId"]
            assert_eventually(lambda: finished(tick_id), 30, what="the triggered tick SUCCESS")
        except BaseException:
            for service in (relay, sample):
                print(f"--- {service.name} log ---\n{service.log()[-6000:]}")
            raise
    # Stopped as compose stops containers (SIGTERM): both shut down cleanly.
    assert relay.proc is not None and relay.proc.returncode == 0, relay.log()[-3000:]
    assert sample.proc is not None and sample.proc.returncode == 0, sample.log()[-3000:]


# -- Reviewer's confirmations (ops): each fails on the code as it is. ------------------------------


def test_the_images_data_volume_is_writable_by_the_user_it_runs_as() -> None:
    """README: "mount ... a volume at /home/relay/data for the embedded database" (the image's RELAY_HOME).
    The image runs as `relay` (uid 10001), but nothing creates /home/relay/data before `VOLUME`: Docker
    then makes the mount point, and a new volume mounted there, owned by root (moby/moby#3124, #34916),
    so the embedded PostgreSQL cannot be created in it (`mkdir .../pgdata`: permission denied). A new
    named volume takes the owner of the image's folder only when the image has that folder."""
    recipe = read_dockerfile(ROOT / "Dockerfile")
    assert recipe.env["RELAY_HOME"] in recipe.volumes
    home = recipe.env["RELAY_HOME"]
    made = [cmd for _, cmd in recipe.runs if home in cmd and ("chown" in cmd or "install -d" in cmd)]
    assert made, f"no RUN creates {home} owned by the image's user before VOLUME: {recipe.runs}"
