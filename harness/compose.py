"""A docker-compose.yml run as local processes, the way compose would run its containers.

These machines have no Docker daemon, so the deployment example (deploy/compose) is tested by
doing what compose and the image builds would do, read from the files themselves:

- **Build.** Each ``build:`` service's Dockerfile is replayed into a folder standing for the
  image's file system: its ``COPY`` instructions copy from the build context (less what
  ``.dockerignore`` leaves out), and its ``pip install`` of local folders is run offline into
  the image's own site folder, seen by the image's own ``python`` (see :class:`Image`).
  Packages named in a requirements file must already be installed in this environment in a
  matching version (there is no index to install them from). Other
  ``RUN`` lines (``useradd``) set up the operating system and are left out.
- **Run.** Each service's command (``command``, else the image's ``CMD``, after its
  ``ENTRYPOINT``) runs with the image's ``ENV`` and the service's ``environment``, in the
  image's ``WORKDIR``, in dependency order; a dependency with ``condition: service_healthy``
  is waited for by running its health check, as compose does.
- **Localized.** Each container has its own network and file system, and these processes
  share one machine, so: every ``<service>:<port>`` and the service's own ``localhost:<port>``
  become ``127.0.0.1:<free port>``, ``0.0.0.0`` becomes ``127.0.0.1``, a value that is exactly
  the service's own container port becomes its free port, a volume's path in the container
  becomes its folder here, and services whose image is ``postgres`` are not started: URLs to
  them point at a database made by the caller. ``python`` is the image's.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from harness.ports import free_port
from harness.waiting import assert_eventually

LOOPBACK = "127.0.0.1"
LOCAL_NAMES = ("localhost", "127.0.0.1", "0.0.0.0")
# A PostgreSQL URL (whole), or a host:port pair.
ADDRESS = re.compile(
    r"(?P<url>postgres(?:ql)?://[^\s'\"]+)|(?<![\w.-])(?P<host>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<port>\d+)\b"
)


class ComposeError(Exception):
    """The compose file or a Dockerfile asks for something this runner does not do."""


@dataclass
class Recipe:
    """What a Dockerfile says, as far as running its image goes."""

    path: Path
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    expose: list[int] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    copies: list[tuple[list[str], str]] = field(default_factory=list)  # (sources, destination)
    runs: list[tuple[str, str]] = field(default_factory=list)  # (workdir, command)
    healthcheck: list[str] | None = None


def _exec_form(value: str) -> list[str]:
    """CMD/ENTRYPOINT/VOLUME: the JSON (exec) form, else the shell form."""
    if value.lstrip().startswith("["):
        parsed = json.loads(value)
        return [str(part) for part in parsed]
    return ["/bin/sh", "-c", value]


def read_dockerfile(path: Path) -> Recipe:
    """The single-stage Dockerfile at ``path``, through dockerfile-parse."""
    parser = DockerfileParser(str(path), cache_content=True)
    if parser.is_multistage:
        raise ComposeError(f"{path}: multi-stage builds are not replayed")
    recipe = Recipe(path=path, env=dict(parser.envs))
    for instruction in parser.structure:
        name, value = instruction["instruction"], instruction["value"]
        if name == "WORKDIR":
            recipe.workdir = str(PurePosixPath(recipe.workdir) / value)
        elif name == "COPY":
            parts = [p for p in shlex.split(value) if not p.startswith("--")]
            destination = str(PurePosixPath(recipe.workdir) / parts[-1])
            # A destination ending in / (or ".") is a folder to copy into, as Docker has it.
            folder = parts[-1].endswith("/") or parts[-1] == "."
            recipe.copies.append((parts[:-1], destination + "/" if folder else destination))
        elif name == "ADD":
            raise ComposeError(f"{path}: ADD is not replayed (use COPY)")
        elif name == "RUN":
            recipe.runs.append((recipe.workdir, value))
        elif name == "CMD":
            recipe.cmd = _exec_form(value)
        elif name == "ENTRYPOINT":
            recipe.entrypoint = _exec_form(value)
        elif name == "EXPOSE":
            recipe.expose += [int(p.split("/")[0]) for p in value.split()]
        elif name == "VOLUME":
            recipe.volumes += json.loads(value) if value.lstrip().startswith("[") else value.split()
        elif name == "HEALTHCHECK":
            check = value.split(" CMD ", 1)
            recipe.healthcheck = None if value.strip() == "NONE" else _exec_form(check[-1])
    return recipe


def _ignored(context: Path) -> Callable[[str, list[str]], set[str]]:
    """copytree's ``ignore`` from the context's .dockerignore (plain and ``**/`` patterns)."""
    file = context / ".dockerignore"
    patterns = [
        line.strip().rstrip("/")
        for line in (file.read_text().splitlines() if file.exists() else [])
        if line.strip() and not line.startswith("#")
    ]
    if any(p.startswith("!") for p in patterns):
        raise ComposeError(f"{file}: exceptions (!) are not replayed")

    def ignore(folder: str, names: list[str]) -> set[str]:
        relative = Path(folder).resolve().relative_to(context.resolve())
        skipped = set()
        for name in names:
            path = (relative / name).as_posix()
            for pattern in patterns:
                anywhere = pattern.removeprefix("**/")
                if fnmatch.fnmatch(path, pattern) or (pattern.startswith("**/") and fnmatch.fnmatch(name, anywhere)):
                    skipped.add(name)
        return skipped

    return ignore


@dataclass
class Image:
    """A built image: its file system under ``root``, the packages it installed in ``site``, and
    its own ``python``: a virtual environment that sees ``site`` first, then this environment's
    installed packages, but not this checkout's editable installs (whose hooks only the
    environment's own .pth files set up), so a package the Dockerfile left out is missing."""

    recipe: Recipe
    root: Path

    @property
    def site(self) -> Path:
        return self.root / "_site"

    @property
    def python(self) -> Path:
        return self.root / "_python" / "bin" / "python"

    def path(self, container_path: str) -> Path:
        return self.root / container_path.lstrip("/")

    def make_python(self) -> None:
        venv.EnvBuilder(with_pip=False, symlinks=True).create(self.root / "_python")
        found = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
        lines = [str(self.site), *ours]
        (Path(found.stdout.strip()) / "_image.pth").write_text("\n".join(lines) + "\n")


def build(recipe: Recipe, context: Path, root: Path) -> Image:
    image = Image(recipe, root)
    image.make_python()
    ignore = _ignored(context)
    for sources, destination in recipe.copies:
        target = image.path(destination)
        into_folder = destination.endswith("/") or len(sources) > 1
        for source in sources:
            origin = context / source
            if not origin.exists():
                raise ComposeError(f"{recipe.path}: COPY {source}: no such file in the context {context}")
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=ignore, dirs_exist_ok=True)
            else:
                dest = target / origin.name if into_folder else target
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, dest)
    for workdir, command in recipe.runs:
        argv = shlex.split(command)
        if argv[:2] == ["pip", "install"]:
            _pip_install(image, image.path(workdir), argv[2:])
    return image


def _pip_install(image: Image, cwd: Path, args: list[str]) -> None:
    """``pip install`` of local folders, offline into the image's site; requirement files are
    checked against this environment."""
    folders: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg in ("-r", "--requirement"):
            _check_requirements(cwd / next(rest))
        elif arg.startswith("-"):
            continue  # --no-cache-dir and the like
        elif (cwd / arg).is_dir():
            folders.append(arg)
        else:
            _check_requirements_lines([arg], f"pip install {arg}")
    if folders:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--no-index", "--no-build-isolation", "--target", str(image.site), *folders],
            cwd=cwd, check=True, capture_output=True,
        )  # fmt: skip


def _check_requirements(file: Path) -> None:
    if not file.exists():
        raise ComposeError(f"pip install -r {file.name}: no such file in the image")
    _check_requirements_lines(file.read_text().splitlines(), str(file))


def _check_requirements_lines(lines: list[str], source: str) -> None:
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            raise ComposeError(f"{source}: {requirement} is not installed here") from None
        if not requirement.specifier.contains(installed, prereleases=True):
            raise ComposeError(f"{source}: {requirement} wanted, {installed} installed here")


@dataclass
class Service:
    name: str
    spec: dict[str, Any]
    image: Image | None = None
    ports: dict[int, int] = field(default_factory=dict)  # container port -> local port
    volumes: list[tuple[str, Path]] = field(default_factory=list)  # (container path, local path)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def depends_on(self) -> dict[str, str]:
        """Dependencies and their condition."""
        deps = self.spec.get("depends_on", {})
        if isinstance(deps, list):
            return {name: "service_started" for name in deps}
        return {name: str(d.get("condition", "service_started")) for name, d in deps.items()}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


def container_ports(spec: dict[str, Any], recipe: Recipe | None) -> list[int]:
    """The ports a service's container listens on: compose ``ports``/``expose``, the image's EXPOSE."""
    found = list(recipe.expose if recipe else [])
    for entry in spec.get("ports", []) + spec.get("expose", []):
        port = entry.get("target") if isinstance(entry, dict) else str(entry).split("/")[0].split(":")[-1]
        found.append(int(str(port)))
    return sorted(set(found))


def build_context(compose_dir: Path, spec: dict[str, Any]) -> tuple[Path, Path]:
    """(context folder, Dockerfile) of a service's ``build``."""
    build_spec = spec["build"]
    if isinstance(build_spec, str):
        build_spec = {"context": build_spec}
    context = (compose_dir / build_spec.get("context", ".")).resolve()
    return context, context / build_spec.get("dockerfile", "Dockerfile")


def is_postgres(spec: dict[str, Any]) -> bool:
    return "build" not in spec and str(spec.get("image", "")).split(":")[0].split("/")[-1] == "postgres"


class ComposeRun:
    """The services of one compose file as local processes (see the module's docstring)."""

    def __init__(self, compose_file: Path, workdir: Path, database_url: Callable[[str], str]) -> None:
        """``database_url(name)``: the URL of a database standing for ``name`` on a postgres service."""
        self.compose_file = compose_file
        self.compose_dir = compose_file.parent
        self.workdir = workdir
        self.database_url = database_url
        self.document: dict[str, Any] = yaml.safe_load(compose_file.read_text())
        self.services = {name: Service(name, spec) for name, spec in self.document["services"].items()}
        self._databases: dict[str, str] = {}

    # --- what a service's values become here ---

    def localize(self, service: Service, value: str) -> str:
        if "${" in value:
            raise ComposeError(f"{service.name}: interpolation is not replayed: {value}")
        for container_path, local in service.volumes:
            if value == container_path or value.startswith(container_path + "/"):
                value = str(local) + value[len(container_path) :]
        value = ADDRESS.sub(lambda m: self._address(service, m), value)
        if value == "0.0.0.0":
            return LOOPBACK
        if value.isdigit() and int(value) in service.ports:
            return str(service.ports[int(value)])
        return value

    def _address(self, service: Service, match: re.Match[str]) -> str:
        if match.group("url"):
            return self._database(match.group("url"))
        host, port = match.group("host"), int(match.group("port"))
        target = service if host in LOCAL_NAMES else self.services.get(host)
        if target is None or port not in target.ports:
            return match.group(0)
        return f"{LOOPBACK}:{target.ports[port]}"

    def _database(self, url: str) -> str:
        parts = urlsplit(url)
        target = self.services.get(parts.hostname or "")
        if target is None or not is_postgres(target.spec):
            return url
        name = parts.path.lstrip("/")
        if name not in self._databases:
            self._databases[name] = self.database_url(name)
        return self._databases[name]

    def argv(self, service: Service, argv: list[str]) -> list[str]:
        local = [self.localize(service, arg) for arg in argv]
        site_bin = service.image.site / "bin" if service.image else None
        python = str(service.image.python) if service.image else sys.executable
        if site_bin is not None and (site_bin / local[0]).exists():
            return [python, str(site_bin / local[0]), *local[1:]]
        if local[0] in ("python", "python3"):
            return [python, *local[1:]]
        found = shutil.which(local[0], path=str(Path(sys.executable).parent)) or shutil.which(local[0])
        if found is None:
            raise ComposeError(f"{service.name}: command {local[0]!r} not found here")
        return [found, *local[1:]]

    def command(self, service: Service) -> list[str]:
        recipe = service.image.recipe if service.image else None
        entrypoint = service.spec.get("entrypoint", recipe.entrypoint if recipe else [])
        command = service.spec.get("command", recipe.cmd if recipe else [])
        entrypoint = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
        command = shlex.split(command) if isinstance(command, str) else list(command)
        if not entrypoint + command:
            raise ComposeError(f"{service.name}: no command")
        return self.argv(service, entrypoint + command)

    def environment(self, service: Service) -> dict[str, str]:
        path = [str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]
        if service.image is not None:
            path[:0] = [str(service.image.site / "bin"), str(service.image.python.parent)]
        env = {"PATH": ":".join(path), "LANG": "C.UTF-8"}
        home = self.workdir / service.name / "home"
        home.mkdir(parents=True, exist_ok=True)
        env["HOME"] = str(home)
        if service.image is not None:
            env.update(service.image.recipe.env)
        declared = service.spec.get("environment", {})
        if isinstance(declared, list):
            declared = dict(item.split("=", 1) for item in declared)
        env.update({k: "" if v is None else str(v) for k, v in declared.items()})
        return {k: self.localize(service, v) for k, v in env.items()}

    def healthcheck(self, service: Service) -> list[str] | None:
        check = service.spec.get("healthcheck", {}).get("test")
        if check is None:
            check = service.image.recipe.healthcheck if service.image else None
            return None if check is None else self.argv(service, check)
        if isinstance(check, str):
            check = ["CMD-SHELL", check]
        if check[0] == "NONE" or service.spec["healthcheck"].get("disable"):
            return None
        argv = check[1:] if check[0] == "CMD" else ["/bin/sh", "-c", check[1]]
        return self.argv(service, argv)

    # --- lifecycle ---

    def _prepare(self, service: Service) -> None:
        if "build" in service.spec:
            context, dockerfile = build_context(self.compose_dir, service.spec)
            service.image = build(read_dockerfile(dockerfile), context, self.workdir / service.name / "image")
        recipe = service.image.recipe if service.image else None
        service.ports = {port: free_port() for port in container_ports(service.spec, recipe)}
        anonymous = recipe.volumes if recipe else []
        for entry in service.spec.get("volumes", []) + anonymous:
            source, _, target = str(entry).partition(":") if ":" in str(entry) else ("", "", str(entry))
            target = target.split(":")[0]
            if source.startswith((".", "/")):
                local = (self.compose_dir / source).resolve()
            else:
                local = self.workdir / service.name / "volumes" / (source or target.strip("/").replace("/", "_"))
                local.mkdir(parents=True, exist_ok=True)
            if not any(existing == target for existing, _ in service.volumes):
                service.volumes.append((target, local))

    def order(self) -> list[Service]:
        """Services in an order that starts each after its dependencies."""
        done: list[Service] = []

        def visit(service: Service, path: tuple[str, ...]) -> None:
            if service in done:
                return
            if service.name in path:
                raise ComposeError(f"depends_on cycle: {' -> '.join((*path, service.name))}")
            for dependency in service.depends_on:
                visit(self.services[dependency], (*path, service.name))
            done.append(service)

        for service in self.services.values():
            visit(service, ())
        return done

    def start(self, healthy_within: float = 60) -> None:
        for service in self.order():
            if is_postgres(service.spec):
                continue
            self._prepare(service)
            for dependency, condition in service.depends_on.items():
                if condition == "service_healthy" and not is_postgres(self.services[dependency].spec):
                    self.wait_healthy(self.services[dependency], healthy_within)
            self._spawn(service)

    def _spawn(self, service: Service) -> None:
        cwd = service.image.path(service.image.recipe.workdir) if service.image else self.workdir
        service.log_path = self.workdir / f"{service.name}.log"
        with open(service.log_path, "ab") as log:
            service.proc = subprocess.Popen(
                self.command(service), env=self.environment(service), cwd=cwd, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_healthy(self, service: Service, timeout: float) -> None:
        check = self.healthcheck(service)
        if check is None:
            raise ComposeError(f"{service.name}: service_healthy asked, but it has no health check")
        env = self.environment(service)

        def healthy() -> bool:
            if service.proc is not None and service.proc.poll() is not None:
                # Not an AssertionError, which assert_eventually would wait out.
                raise RuntimeError(f"{service.name} exited with {service.proc.returncode}:\n{service.log()}")
            try:
                return subprocess.run(check, env=env, capture_output=True, timeout=10).returncode == 0
            except subprocess.TimeoutExpired:
                return False

        try:
            assert_eventually(healthy, timeout, interval=0.2, what=f"{service.name} healthy")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- {service.name} log ---\n{service.log()[-4000:]}") from None

    def url(self, service: str, container_port: int, scheme: str = "http") -> str:
        """How the host reaches a service's container port here."""
        return f"{scheme}://{LOOPBACK}:{self.services[service].ports[container_port]}"

    def stop(self) -> None:
        for service in reversed(self.order()):
            proc = service.proc
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def compose_up(compose_file: Path, workdir: Path, database_url: Callable[[str], str]) -> Iterator[ComposeRun]:
    run = ComposeRun(compose_file, workdir, database_url)
    try:
        run.start()
        yield run
    finally:
        run.stop()
