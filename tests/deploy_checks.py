"""What the deployment examples (deploy/) must agree on, beyond what a schema can say.

Each check returns a list of problems, one sentence each, so that a test can show that the
real files have none and that a broken copy of them has the one expected.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import posixpath
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import referencing
import yaml

from harness.compose import Service, build_context, container_ports, is_postgres, read_dockerfile
from relay.api import build_api
from relay.cli.serve import serve as relay_serve_command
from relay.config import RelayConfig, parse_config
from relay.errors import ConfigError
from relay.net.guard import PROBES

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose" / "docker-compose.yml"
K8S_DIR = DEPLOY / "k8s"
COMPOSE_SCHEMA = ROOT / "tests" / "schemas" / "compose-spec.json"
RELAY_DOCKERFILE = ROOT / "Dockerfile"
# The oldest Kubernetes the manifests are meant for, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
URL_IN_TEXT = re.compile(r"https?://[^\s'\"]+")


# --- schemas ---


def compose_schema_errors(document: dict[str, Any], schema_file: Path = COMPOSE_SCHEMA) -> list[str]:
    schema = json.loads(schema_file.read_text())
    # An empty registry, which retrieves nothing: a $ref outside the vendored file is an error,
    # never a download (jsonschema's default registry would fetch it).
    validator = jsonschema.Draft7Validator(schema, registry=referencing.Registry())
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(document)]


def k8s_schema_errors(documents: Iterable[dict[str, Any]], versions: Iterable[str] = K8S_VERSIONS) -> list[str]:
    """Strict: a field the schema does not know is an error (a typo is never ignored)."""
    errors = []
    for doc in documents:
        for version in versions:
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')} (Kubernetes {version})"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{name}: {'.'.join(map(str, exc.path))}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                errors.append(f"{name}: {exc.message}")
    return errors


# --- what the code reads ---


def environment_reads(files: Iterable[Path]) -> set[str]:
    """Names read with ``os.environ[...]``, ``os.environ.get(...)`` or ``os.getenv(...)``."""
    names: set[str] = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            key: ast.expr | None = None
            if isinstance(node, ast.Subscript) and _is_environ(node.value):
                key = node.slice
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                if (isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value)) or (
                    isinstance(func, ast.Attribute) and func.attr == "getenv"
                ):
                    key = node.args[0]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
    return names


def _is_environ(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


@functools.cache
def relay_environment() -> set[str]:
    """Every environment variable Relay's code reads."""
    return environment_reads([*ROOT.glob("relay/**/*.py"), *ROOT.glob("workflows/**/*.py")])


def dbos_config_environment(files: Iterable[Path]) -> dict[str, str]:
    """DBOS config key -> the environment variable that a DBOSConfig literal takes it from."""
    found: dict[str, str] = {}
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(value, ast.Subscript)
                    and _is_environ(value.value)
                    and isinstance(value.slice, ast.Constant)
                ):
                    found[str(key.value)] = str(value.slice.value)
    return found


def relay_port(argv: list[str], config: RelayConfig) -> int:
    """The port ``relay serve`` listens on with these arguments and this relay.yaml."""
    if argv[:2] != ["relay", "serve"]:
        raise ValueError(f"not a `relay serve` command: {argv}")
    port = relay_serve_command.make_context("serve", argv[2:]).params["port"]
    return int(port if port is not None else config.server.port)


@functools.cache
def relay_get_routes() -> frozenset[str]:
    """The paths Relay answers GET on (from its OpenAPI document)."""
    paths: dict[str, dict[str, Any]] = build_api(None).openapi()["paths"]
    return frozenset(path for path, methods in paths.items() if "get" in methods)


def probe_problems(where: str, path: str, port: int, relay_port: int, expected: str) -> list[str]:
    problems = []
    if path != expected:
        problems.append(f"{where}: checks {path}, should be {expected}")
    if path not in relay_get_routes() or path not in PROBES:
        problems.append(f"{where}: {path} is not a probe Relay serves ({sorted(PROBES)})")
    if port != relay_port:
        problems.append(f"{where}: checks port {port}, Relay listens on {relay_port}")
    return problems


def conductor_key_problems(where: str, key: str, app: str, config: RelayConfig) -> list[str]:
    digest = hashlib.sha256(key.encode()).hexdigest()
    for org in config.orgs:
        for conductor_key in org.conductor_keys:
            if conductor_key.sha256 == digest:
                listed = [a.name for a in org.apps]
                if conductor_key.apps is not None and app not in conductor_key.apps:
                    return [f"{where}: its conductor key may not connect app {app!r}"]
                if app not in listed and not config.auto_register_apps:
                    return [f"{where}: app {app!r} is not in org {org.name!r} and autoRegisterApps is false"]
                return []
    return [f"{where}: the SHA-256 of its conductor key is not a conductorKey of relay.yaml"]


# --- docker compose ---


def _compose_env(spec: dict[str, Any]) -> dict[str, str]:
    declared = spec.get("environment", {})
    if isinstance(declared, list):
        declared = dict(item.split("=", 1) for item in declared)
    return {k: str(v) for k, v in declared.items()}


def _bind_mounts(spec: dict[str, Any], compose_dir: Path) -> dict[str, Path]:
    """Container path -> local path, for ``./x:/y`` volumes."""
    mounts = {}
    for entry in spec.get("volumes", []):
        source, _, rest = str(entry).partition(":")
        if source.startswith((".", "/")):
            mounts[rest.split(":")[0]] = (compose_dir / source).resolve()
    return mounts


def _healthcheck_argv(spec: dict[str, Any]) -> list[str]:
    test = spec.get("healthcheck", {}).get("test", [])
    return [test] if isinstance(test, str) else [str(part) for part in test]


def _urls(argv: Iterable[str]) -> list[Any]:
    return [urlsplit(url) for arg in argv for url in URL_IN_TEXT.findall(arg)]


def _database_problems(where: str, url: str, services: dict[str, Any]) -> list[str]:
    parts = urlsplit(url)
    db = services.get(parts.hostname or "")
    if db is None or not is_postgres(db):
        return [f"{where}: its database host {parts.hostname!r} is not a postgres service"]
    env = _compose_env(db)
    user = env.get("POSTGRES_USER", "postgres")
    problems = []
    if (parts.username, parts.password) != (user, env.get("POSTGRES_PASSWORD")):
        problems.append(f"{where}: its database user or password is not the postgres service's")
    if (parts.port or 5432) != 5432:
        problems.append(f"{where}: its database port {parts.port} is not the postgres image's 5432")
    return problems


def compose_problems(document: dict[str, Any], compose_dir: Path = COMPOSE_FILE.parent) -> list[str]:
    services: dict[str, Any] = document["services"]
    problems: list[str] = []
    recipes = {}
    for name, spec in services.items():
        if "build" in spec:
            context, dockerfile = build_context(compose_dir, spec)
            if not dockerfile.is_file():
                problems.append(f"{name}: no Dockerfile at {dockerfile}")
                continue
            recipes[name] = recipe = read_dockerfile(dockerfile)
            for sources, _ in recipe.copies:
                problems += [
                    f"{name}: COPY {s}: not in the build context" for s in sources if not (context / s).exists()
                ]
        for target, local in _bind_mounts(spec, compose_dir).items():
            if not local.exists():
                problems.append(f"{name}: the volume for {target} comes from {local}, which does not exist")
        for dependency, condition in _depends(spec).items():
            if dependency not in services:
                problems.append(f"{name}: depends on {dependency!r}, which is not a service")
            elif condition == "service_healthy" and not services[dependency].get("healthcheck"):
                if dependency not in recipes or recipes[dependency].healthcheck is None:
                    problems.append(f"{name}: waits for {dependency} to be healthy, which has no health check")

    relays = [n for n in recipes if build_context(compose_dir, services[n])[1] == RELAY_DOCKERFILE]
    if len(relays) != 1:
        return [*problems, f"one service must be built from the repository's Dockerfile, found {relays}"]
    relay = relays[0]
    spec, recipe = services[relay], recipes[relay]
    env = {**recipe.env, **_compose_env(spec)}
    problems += [f"{relay}: sets {v}, which Relay does not read" for v in env if v.startswith("RELAY_")
                 if v not in relay_environment()]  # fmt: skip
    for needed in ("RELAY_DATABASE_URL", "RELAY_INSTANCE_ID", "RELAY_CONFIG"):
        if not env.get(needed):
            problems.append(f"{relay}: {needed} is not set")
    if env.get("RELAY_DATABASE_URL"):
        problems += _database_problems(relay, env["RELAY_DATABASE_URL"], services)
        db_service = services.get(urlsplit(env["RELAY_DATABASE_URL"]).hostname or "")
        if db_service is not None:
            db_env = _compose_env(db_service)
            created = db_env.get("POSTGRES_DB", db_env.get("POSTGRES_USER", "postgres"))
            if urlsplit(env["RELAY_DATABASE_URL"]).path.lstrip("/") != created:
                problems.append(f"{relay}: its database is not the one the postgres service creates ({created})")
    config_file = _bind_mounts(spec, compose_dir).get(env.get("RELAY_CONFIG", ""))
    if config_file is None or not config_file.is_file():
        return [*problems, f"{relay}: RELAY_CONFIG {env.get('RELAY_CONFIG')} is not a file mounted from this folder"]
    try:
        config = parse_config(config_file.read_text(), str(config_file))
    except ConfigError as exc:
        return [*problems, f"{relay}: {exc}"]
    command = spec.get("command", recipe.cmd)
    port = relay_port(command.split() if isinstance(command, str) else command, config)
    if port not in container_ports(spec, None) or port not in recipe.expose:
        problems.append(f"{relay}: listens on {port}, which its ports and the image's EXPOSE must publish")
    # Compose's health check, else the image's.
    checks = _urls(_healthcheck_argv(spec) if "healthcheck" in spec else recipe.healthcheck or [])
    if not checks:
        problems.append(f"{relay}: its health check requests no URL")
    for url in checks:
        problems += probe_problems(f"{relay} health check", url.path, url.port or 80, port, "/readyz")

    for name, spec in services.items():
        if name == relay or is_postgres(spec):
            continue
        problems += _app_problems(name, spec, services, relay, port, config, compose_dir)
    return problems


def _depends(spec: dict[str, Any]) -> dict[str, str]:
    return Service("", spec).depends_on


def _app_problems(
    name: str, spec: dict[str, Any], services: dict[str, Any], relay: str, port: int, config: RelayConfig,
    compose_dir: Path,
) -> list[str]:  # fmt: skip
    """A DBOS app of the compose file: its settings reach Relay and its database."""
    if "build" not in spec:
        return [f"{name}: an app service must be built here, so that its code can be checked"]
    context, dockerfile = build_context(compose_dir, spec)
    sources = sorted(context.glob("**/*.py"))
    if not dockerfile.is_file():
        return []  # said above
    env = {**read_dockerfile(dockerfile).env, **_compose_env(spec)}
    problems = [f"{name}: reads {v}, which is not set" for v in sorted(environment_reads(sources)) if v not in env]
    settings = dbos_config_environment(sources)
    for key in ("name", "system_database_url", "conductor_url", "conductor_key"):
        if key not in settings:
            problems.append(f"{name}: its DBOS config does not take {key} from the environment")
    if problems:
        return problems
    conductor = urlsplit(env[settings["conductor_url"]])
    if conductor.scheme not in ("ws", "wss") or conductor.hostname != relay or conductor.port != port:
        problems.append(f"{name}: conductor_url {conductor.geturl()} is not ws://{relay}:{port}/")
    problems += conductor_key_problems(name, env[settings["conductor_key"]], env[settings["name"]], config)
    problems += _database_problems(name, env[settings["system_database_url"]], services)
    if _depends(spec).get(relay) != "service_healthy":
        problems.append(f"{name}: should wait for {relay} to be healthy")
    for url in _urls(_healthcheck_argv(spec)):
        if (url.port or 80) not in container_ports(spec, None):
            problems.append(f"{name}: its health check asks port {url.port}, which it does not publish")
    return problems


# --- Kubernetes ---


def load_k8s() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(kustomization, every document of the files it lists)."""
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    documents = []
    for resource in kustomization.get("resources", []):
        path = K8S_DIR / resource
        if path.is_file():
            documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return kustomization, documents


def _find(documents: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in documents if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _port_number(port: int | str, container: dict[str, Any]) -> int | None:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return named[0] if named else None


def k8s_problems(kustomization: dict[str, Any], documents: list[dict[str, Any]], k8s_dir: Path = K8S_DIR) -> list[str]:
    problems: list[str] = []
    listed = sorted(kustomization.get("resources", []))
    present = sorted(p.name for p in k8s_dir.glob("*.yaml") if p.name != "kustomization.yaml")
    if listed != present:
        problems.append(f"kustomization.yaml lists {listed}, the folder has {present}")
    namespace = kustomization.get("namespace")
    for doc in documents:
        if doc["kind"] != "Namespace" and doc["metadata"].get("namespace", namespace) != namespace:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: not in namespace {namespace}")
    if namespace and not _find(documents, "Namespace", namespace):
        problems.append(f"no Namespace {namespace}")

    sets = _find(documents, "StatefulSet")
    if len(sets) != 1:
        return [*problems, f"one StatefulSet expected, found {len(sets)}"]
    sts = sets[0]
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    labels = sts["spec"]["template"]["metadata"].get("labels", {})
    if spec.get("replicas", 1) < 3:
        problems.append(f"StatefulSet: {spec.get('replicas', 1)} replicas, the example runs three")
    if not _selects(spec["selector"].get("matchLabels", {}), labels):
        problems.append("StatefulSet: its selector does not select its pods")
    governing = _find(documents, "Service", spec.get("serviceName"))
    if not governing or governing[0]["spec"].get("clusterIP") != "None":
        problems.append(f"StatefulSet: serviceName {spec.get('serviceName')!r} is not a headless Service here")
    container = pod["containers"][0]
    env = {e["name"]: e for e in container.get("env", [])}
    recipe = read_dockerfile(RELAY_DOCKERFILE)
    image_env = dict(recipe.env)
    problems += [f"StatefulSet: sets {v}, which Relay does not read" for v in env if v.startswith("RELAY_")
                 if v not in relay_environment()]  # fmt: skip

    instance = ((env.get("RELAY_INSTANCE_ID", {}).get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
    if instance != "metadata.name":
        problems.append("StatefulSet: RELAY_INSTANCE_ID must come from the pod's name (fieldRef metadata.name)")
    secret_ref = (env.get("RELAY_DATABASE_URL", {}).get("valueFrom") or {}).get("secretKeyRef")
    if secret_ref is None:
        problems.append("StatefulSet: RELAY_DATABASE_URL must come from a Secret")
    else:
        secrets = _find(documents, "Secret", secret_ref["name"])
        keys = {*secrets[0].get("stringData", {}), *secrets[0].get("data", {})} if secrets else set()
        if secret_ref["key"] not in keys:
            problems.append(f"StatefulSet: the Secret {secret_ref['name']} with key {secret_ref['key']} is not here")

    config_path = env.get("RELAY_CONFIG", {}).get("value") or image_env.get("RELAY_CONFIG", "")
    config_text = _mounted_file(config_path, container, pod, documents)
    if config_text is None:
        return [
            *problems,
            f"StatefulSet: RELAY_CONFIG {config_path} is not a file of a ConfigMap or Secret mounted here",
        ]
    try:
        config = parse_config(config_text, f"{config_path} in the StatefulSet")
    except ConfigError as exc:
        return [*problems, str(exc)]
    argv = [
        *container.get("command", recipe.entrypoint),
        *container.get("args", [] if "command" in container else recipe.cmd),
    ]
    port = relay_port(argv, config)
    if port not in [p["containerPort"] for p in container.get("ports", [])]:
        problems.append(f"StatefulSet: Relay listens on {port}, which is not a containerPort")
    for probe, expected in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
        check = container.get(probe, {}).get("httpGet")
        if check is None:
            if probe != "startupProbe":
                problems.append(f"StatefulSet: no HTTP {probe}")
            continue
        number = _port_number(check["port"], container) or 0
        problems += probe_problems(f"StatefulSet {probe}", check["path"], number, port, expected)
    requests = container.get("resources", {}).get("requests", {})
    if not {"cpu", "memory"} <= set(requests):
        problems.append("StatefulSet: cpu and memory requests are not set")

    for service in _find(documents, "Service"):
        name = service["metadata"]["name"]
        if not _selects(service["spec"].get("selector", {}), labels):
            problems.append(f"Service {name}: does not select Relay's pods")
        for entry in service["spec"].get("ports", []):
            if _port_number(entry.get("targetPort", entry["port"]), container) != port:
                problems.append(f"Service {name}: port {entry['port']} does not lead to Relay's port {port}")
    for pdb in _find(documents, "PodDisruptionBudget"):
        if not _selects(pdb["spec"]["selector"].get("matchLabels", {}), labels):
            problems.append(f"PodDisruptionBudget {pdb['metadata']['name']}: does not select Relay's pods")
    return problems


def _mounted_file(
    path: str, container: dict[str, Any], pod: dict[str, Any], documents: list[dict[str, Any]]
) -> str | None:
    """The text that a ConfigMap or Secret volume puts at ``path`` in the container."""
    folder, name = posixpath.split(path)
    for mount in container.get("volumeMounts", []):
        if mount["mountPath"].rstrip("/") != folder or "subPath" in mount:
            continue
        volume = next((v for v in pod.get("volumes", []) if v["name"] == mount["name"]), {})
        if "configMap" in volume:
            found = _find(documents, "ConfigMap", volume["configMap"]["name"])
            data = found[0].get("data", {}) if found else {}
        elif "secret" in volume:
            found = _find(documents, "Secret", volume["secret"]["secretName"])
            data = found[0].get("stringData", {}) if found else {}
        else:
            continue
        if name in data:
            return str(data[name])
    return None
