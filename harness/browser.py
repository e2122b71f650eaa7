"""A real browser for the console's tests: Playwright driving Debian's ``chromium`` package.

Playwright's own browser builds are not downloaded (CI cannot reach them): the
tests launch the system's Chromium by its path. ``./test.sh`` installs it when it
is missing; where it cannot, the tests fail and say so, they never skip.

Also here: the console signed in through its own form, the axe-core accessibility
checker (vendored from npm under ``harness/vendor/axe-core``, injected into a page by
the test, never served by Relay), and what a page's requests were.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright, Request, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
AXE = ROOT / "harness" / "vendor" / "axe-core" / "axe.min.js"
AXE_VERSION = "4.14.1"
SCREENSHOTS = Path(os.environ.get("RELAY_SCREENSHOTS", ROOT / "docs" / "screenshots"))
NAMES = ("chromium", "chromium-browser")


def chromium_path() -> str:
    """The system Chromium (``RELAY_CHROMIUM`` to name another); an error saying how to get one."""
    explicit = os.environ.get("RELAY_CHROMIUM")
    found = explicit or next((p for p in map(shutil.which, NAMES) if p), None)
    if not found or not Path(found).exists():
        raise RuntimeError(
            "the console's browser tests need Debian's chromium package and it is not installed: "
            "run `apt-get install -y chromium` (./test.sh does, as root or with sudo), "
            "or set RELAY_CHROMIUM to a Chromium binary"
        )
    return found


@contextmanager
def chromium() -> Iterator[Browser]:
    path = chromium_path()
    with sync_playwright() as playwright:
        browser = launch(playwright, path)
        try:
            yield browser
        finally:
            browser.close()


def launch(playwright: Playwright, path: str) -> Browser:
    # No sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    return playwright.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-dev-shm-usage"])


@dataclass
class Watched:
    """What a page did: its API requests (method, path, query, JSON body) and console errors."""

    requests: list[tuple[str, str, dict[str, list[str]], Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def on_request(self, request: Request) -> None:
        url = urlsplit(request.url)
        if not url.path.startswith("/v2/"):
            return
        body: Any = None
        if request.post_data:
            try:
                body = json.loads(request.post_data)
            except ValueError:
                body = request.post_data
        self.requests.append((request.method, url.path, parse_qs(url.query), body))

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)


def watch(page: Page) -> Watched:
    watched = Watched()
    page.on("request", watched.on_request)
    page.on("console", watched.on_console)
    page.on("pageerror", lambda exc: watched.errors.append(f"uncaught: {exc}"))
    return watched


def sign_in(page: Page, base_url: str, org: str, key: str) -> None:
    """Through the console's own form, as a person would."""
    page.goto(f"{base_url}/")
    page.get_by_label("Organization").fill(org)
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Apps", exact=True).wait_for()


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def axe_violations(page: Page, impacts: tuple[str, ...] = ("serious", "critical")) -> list[dict[str, Any]]:
    """axe-core's violations of these impacts on the page as it is now.

    Evaluated through the DevTools protocol, which the page's Content-Security-Policy does not
    govern, so the console's CSP stays as strict in the test as in production."""
    if not page.evaluate("typeof window.axe !== 'undefined'"):
        page.evaluate(AXE.read_text(encoding="utf-8"))
    result: dict[str, Any] = page.evaluate("async () => await axe.run(document, {resultTypes: ['violations']})")
    return [
        {
            "id": v["id"],
            "impact": v["impact"],
            "help": v["help"],
            "nodes": [n["target"] for n in v["nodes"]][:5],
        }
        for v in result["violations"]
        if v["impact"] in impacts
    ]


@contextmanager
def console_page(browser: Browser, request: Any, workdir: Path, relay_log: Any = None) -> Iterator[Page]:
    """A fresh browser context (its own sessionStorage) for one test: a failed test leaves a
    screenshot, the page's errors and (``relay_log()``) Relay's log's end; a passed one may not have
    broken the Content Security Policy or left an uncaught error. ``request`` is pytest's."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(15_000)
    page = context.new_page()
    watched = watch(page)
    yield page
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        shot = workdir / f"failed-{request.node.name[:60]}.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"--- the page: {shot}; its errors: {watched.errors}")
        if relay_log is not None:
            print(f"--- relay log ---\n{relay_log()[-5000:]}")
    context.close()
    if report is not None and report.passed:
        assert not [e for e in watched.errors if "Content Security Policy" in e], watched.errors
        assert not [e for e in watched.errors if e.startswith("uncaught")], watched.errors
