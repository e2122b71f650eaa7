"""One TLS context for every HTTP client of a test process.

httpx builds a TLS context for each client it makes (the CA bundle read and parsed: about 23 ms
of CPU), for plain ``http://`` URLs too, and ``httpx.get`` makes a client per call. The suite makes
thousands, most in the polls of :func:`harness.waiting.assert_eventually` (a Relay's readiness, an
executor's state, a metric): pass ``verify=TLS`` to share one, made once per process.
"""

from __future__ import annotations

import httpx

TLS = httpx.create_ssl_context()
