"""Reading /metrics in tests: by metric name and labels, whatever order the exposition writes them in."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.keys import API_KEYS
from harness.web import TLS

# /metrics wants a key with metric.read.
AUTH = {"Authorization": f"Bearer {API_KEYS['acme']}"}


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` with exactly these labels, None if there is none."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


def scrape(base_url: str, name: str, **labels: str) -> float | None:
    return sample(httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=5, verify=TLS).text, name, **labels)
