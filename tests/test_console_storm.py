"""The console during a mass failure: thousands of changes a second on the event stream. Each round
of the storm changes 1,000 executors of one app and audits 1,000 entries in one transaction, as a
fleet dying at once does (seeded directly in Relay's database: executors of an instance that never
ran here, so that nobody adopts them or asks them anything). The browser is real; every request
it makes is recorded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from playwright.sync_api import Browser, Page, expect

from harness.browser import chromium, console_page, sign_in, watch
from harness.keys import API_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml

FLEET = 1000
ROUNDS = 8
REFRESH_MS = 250  # console.js: the changes that come within this long are read in one refresh

SEED = """
INSERT INTO executors (org, app, executor_id, state, application_version, connected_at, relay_instance)
SELECT 'acme', 'burst', 'burst-' || lpad(g::text, 4, '0'), 'HEALTHY', 'v1', now(), 'relay-seeded'
FROM generate_series(1, %s) AS g
"""
FLIP = """
UPDATE executors SET state = CASE state WHEN 'HEALTHY' THEN 'DISCONNECTED' ELSE 'HEALTHY' END,
                     disconnected_at = CASE state WHEN 'HEALTHY' THEN now() END
WHERE org = 'acme' AND app = 'burst'
"""
AUDIT = """
INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
SELECT 'acme', 'burst', 'executor.disconnected', 'burst-' || lpad(g::text, 4, '0'), 'relay', '{}'::jsonb
FROM generate_series(1, %s) AS g
"""


@dataclass
class World:
    workdir: Path
    relay: RelayProcess
    browser: Browser


@pytest.fixture(scope="module")
def world(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("storm")
    config = relay_yaml(free_port())
    config["orgs"][0]["apps"].append({"name": "burst", "executorTimeoutSecs": 60})
    relay = RelayProcess(workdir, postgres.create_database("relay"), config)
    try:
        with chromium() as browser:
            relay.start()
            with psycopg.connect(relay.database_url) as conn:
                conn.execute(SEED, (FLEET,))
            yield World(workdir, relay, browser)
    finally:
        relay.stop()


@pytest.fixture
def page(world: World, request: pytest.FixtureRequest) -> Iterator[Page]:
    with console_page(world.browser, request, world.workdir, world.relay.log) as page:
        yield page


def test_a_mass_failure_keeps_the_console_live_and_its_reads_paced(world: World, page: Page) -> None:
    """A poll that found more than 1,000 changes ended every event stream as too slow ("overflow"),
    however fast its reader: during a mass failure each console said "Reconnecting…", opened a new
    stream and read its page again, at each poll of the storm. The console stays "Live" through it,
    reads its page at most once per 250 ms of storm (never once per event), and shows where things
    ended."""
    watched = watch(page)
    sign_in(page, world.relay.http, "acme", API_KEYS["acme"])
    page.evaluate("() => { location.hash = '#/apps/burst/executors'; }")
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)
    live = page.locator("#live")
    expect(live).to_have_text("Live")
    # Every text the live indicator shows from here on.
    page.evaluate(
        """() => {
            window.liveTexts = [];
            const el = document.getElementById('live');
            new MutationObserver(() => window.liveTexts.push(el.textContent))
                .observe(el, {childList: true, characterData: true, subtree: true});
        }"""
    )

    def reads() -> int:
        return sum(1 for m, path, _, _ in watched.requests if m == "GET" and path.endswith("/apps/burst/executors"))

    before = reads()
    start = time.monotonic()
    with psycopg.connect(world.relay.database_url, autocommit=True) as conn:
        for _ in range(ROUNDS):
            with conn.transaction():
                conn.execute(FLIP)
                conn.execute(AUDIT, (FLEET,))
            time.sleep(0.4)
    # ROUNDS is even: every executor is HEALTHY again; the page says so once it has read the last change.
    expect(page.locator("main table tbody tr").first).to_contain_text("HEALTHY", timeout=20_000)
    expect(page.locator("main table tbody tr", has_text="DISCONNECTED")).to_have_count(0, timeout=20_000)
    elapsed = time.monotonic() - start
    changes = ROUNDS * FLEET * 2
    storm_reads = reads() - before
    assert page.evaluate("() => window.liveTexts") == [], "the live indicator left Live during the storm"
    assert 1 <= storm_reads <= elapsed * 1000 / REFRESH_MS + 2, (storm_reads, elapsed, changes)
