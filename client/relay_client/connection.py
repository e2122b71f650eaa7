"""The socket to Relay: a daemon thread running an asyncio loop that connects,
answers, and reconnects until stopped.

- Relay speaks first (``executor_info``); the client only answers.
- Requests are served on worker threads of the connection's own, at most
  ``max_concurrent_requests`` at once, because DBOS's synchronous API refuses a
  thread with a running event loop. A thread cannot be cancelled: a handler still
  running when its socket is lost runs to its end and keeps its thread, so it
  counts against ``max_concurrent_requests`` on the next socket too. The
  handshake's ``executor_info`` (the first frame of each socket) is answered on a
  thread of its own, so handlers left running never keep the executor from
  joining again; and stopping does not wait for them. Frames are read as they come, so Relay's
  pings are answered however busy the handlers are; up to
  ``max_waiting_requests`` more requests wait for a turn, and a request beyond
  those is answered at once with its failure reply saying the client is busy
  (memory stays bounded, and Relay hears why instead of waiting out its
  timeout). Replies go through a bounded queue to one sender, and a turn ends
  once its reply is queued, so a reply that Relay is slow to take holds its
  handler back rather than memory growing without bound.
  Replies to the requests of a connection that has closed are dropped: they were
  asked on a socket that is gone.
- The socket answers Relay's pings (websockets does) and pings Relay every 20 s,
  giving up on it when no pong comes within 15 s, as the SDK's client does.
- After a loss it reconnects about a second later (0.5 to 1.5 s, jittered, so
  executors cut off together do not all come back in the same instant), forever
  until stopped: a Relay restarting or out of reach is tried again soon, since
  the executor's grace period runs meanwhile. A running Relay's refusal waits
  longer each time in a row (twice as long, jittered): one that will repeat (a
  bad or deleted key, an app it does not serve: HTTP 4xx, close codes 4400, 4401,
  4403, 4409; a redirect it cannot follow, a server that is not a WebSocket one,
  an untrusted certificate, a failed TLS handshake: a ``wss://`` URL at a port
  without TLS) up to :data:`REFUSED_MAX_SECS`; Relay too busy (429,
  503, another 5xx, close codes 4408, 4410; an unexpected error) up to
  :data:`BUSY_MAX_SECS`, each times the jitter. A socket that was
  open :data:`STEADY_SECS` or more before it ended starts the count over.
- A frame from Relay larger than ``max_frame_bytes`` (:data:`MAX_FRAME_BYTES`, 100 MiB, by
  default, as client-ts's) is not read: websockets refuses it by its header, the socket is closed
  (1009) and the client connects again as after any loss, logging why. Unbounded, a Relay (or, without
  TLS, anyone between) could make the executor buffer gigabytes.
- For ``wss://`` without a context, the system's CAs (``ssl.create_default_context()``).
- :meth:`Connection.drain` (DBOS shutting down) refuses requests from then on and
  waits, bounded, for the handlers running and the retention round, the socket
  still open; :meth:`Connection.stop` closes the socket with a close frame and ends the
  thread; it is safe from any thread, and more than once. An attempt to connect under way
  (resolving Relay's host, connecting, the handshakes) is given up at once; host names are
  resolved on daemon threads of the client's own, so a lookup that hangs (a DNS server not
  answering) holds up neither ``stop()`` nor the interpreter's exit.
- The key is part of the URL it connects to, and websockets puts that URL in some
  of its errors (a redirect to an ``https://`` URL: ``InvalidURI``) and, at DEBUG,
  the request line in its log, so every problem is logged with the key blanked
  out, as a warning without a traceback, once until the problem changes, and
  websockets gets a logger that blanks it out too. The key is blanked where it is
  in the URL's path (``/websocket/{app}/{key}``), whatever its length, and its
  text anywhere else only from :data:`REDACT_ANYWHERE_MIN` characters: blanking
  every "e" of every line for a key "e" would spell the key out. An empty key is
  refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import logging
import random
import re
import socket
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote, urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidStatus, InvalidURI

from relay_client.errors import LOGGER_NAME
from relay_client.handlers import Handlers

log = logging.getLogger(LOGGER_NAME)

PING_INTERVAL_SECS = 20.0
PING_TIMEOUT_SECS = 15.0
OPEN_TIMEOUT_SECS = 5.0
CLOSE_TIMEOUT_SECS = 5.0
#: The largest frame taken from Relay by default: client-ts's (``ws``'s own default). Relay's replies
#: are what is large; its requests are small, so this only bounds what a bad peer can make it hold.
MAX_FRAME_BYTES = 100 * 1024 * 1024
#: The close code websockets sends after refusing a frame over ``max_size`` (RFC 6455's "message too big").
MESSAGE_TOO_BIG = 1009
#: How often the loop checks that the DBOS it serves is still there.
WATCH_INTERVAL_SECS = 0.5


#: The wait before trying again after a loss, give or take its jitter (0.5 to 1.5 times it).
RECONNECT_SECS = 1.0
#: The longest wait, give or take its jitter, between tries that Relay refuses and will refuse again.
REFUSED_MAX_SECS = 30.0
#: The longest wait, give or take its jitter, between tries that Relay is too busy to take. Short:
#: an instance that is not ready (its database cut off) answers 503 too, and the executor's grace
#: period runs until it is back.
BUSY_MAX_SECS = 2.0
#: A socket open this long before it ended starts the count of refusals in a row over.
STEADY_SECS = 10.0
#: A key this long or longer is blanked wherever its text is in a line the client logs; a shorter
#: one only where it is in the URL's path (see ``Connection._redact``).
REDACT_ANYWHERE_MIN = 8
#: Close codes after which trying again is refused again: a bad handshake, a deleted key, a key
#: not for this app, another connection with this executor id (relay.net.connection).
REFUSED_CLOSE_CODES = frozenset({4400, 4401, 4403, 4409})
#: Close codes of a Relay or executor too slow: the handshake was not answered in time, pings were not.
BUSY_CLOSE_CODES = frozenset({4408, 4410})


#: The error of a request refused once DBOS is shutting down (Relay reads it as a refusal).
SHUTTING_DOWN = "relay_client: DBOS is shutting down; not served, ask another executor"


class _Exiting(Exception):
    """A thread pool took no new work: the interpreter has begun to exit."""


class Retry(enum.Enum):
    """How the last try ended, for the wait before the next one."""

    SOON = "soon"  # lost, or Relay out of reach: about a second
    BUSY = "busy"
    REFUSED = "refused"


def reconnect_delay(retry: Retry = Retry.SOON, in_a_row: int = 0) -> float:
    """The wait before the next try: :data:`RECONNECT_SECS` (a second) times a jitter of 0.5 to
    1.5; after ``in_a_row`` refusals of one kind in a row, 2 ** (in_a_row - 1) times that, up to
    the kind's most (:data:`REFUSED_MAX_SECS`, :data:`BUSY_MAX_SECS`) times the jitter."""
    jitter = random.uniform(0.5, 1.5)
    if retry is Retry.SOON or in_a_row <= 0:
        return jitter * RECONNECT_SECS
    most = REFUSED_MAX_SECS if retry is Retry.REFUSED else BUSY_MAX_SECS
    return jitter * min(most, RECONNECT_SECS * 2.0 ** min(in_a_row - 1, 30))


def retry_after_status(status: int) -> Retry:
    """A handshake refused with an HTTP ``status``: 429 and 5xx (busy, not ready, a balancer with
    no Relay behind it) pass; any other 4xx (a bad key, an app Relay does not serve) repeats."""
    return Retry.BUSY if status == 429 or status >= 500 else Retry.REFUSED


def retry_after_close(code: int | None) -> Retry:
    if code in REFUSED_CLOSE_CODES:
        return Retry.REFUSED
    return Retry.BUSY if code in BUSY_CLOSE_CODES else Retry.SOON


def check_url(base: str) -> None:
    """Raise ValueError unless ``base`` is a URL the client can connect to (``ws://`` or ``wss://``,
    a host, no query or fragment). Such a URL fails the same way at every retry, and websockets'
    error would carry the whole URL, key included; the message here names only the part at fault."""
    try:
        parts = urlsplit(base)
        port = parts.port  # ValueError for a port that is not a number from 0 to 65535
    except ValueError as exc:
        raise ValueError(f"not a URL Relay can be reached at: {exc}") from None
    if parts.scheme not in ("ws", "wss"):
        # An http:// URL is the likely slip: the console's, which `relay serve` prints next to the executors' one.
        raise ValueError(f"the URL must start with ws:// or wss:// (Relay's executor URL), not {parts.scheme}://")
    if not parts.hostname:
        raise ValueError("the URL has no host")
    if port == 0:
        raise ValueError("port 0 is not a port to connect to")
    if parts.query or parts.fragment:
        raise ValueError("the URL must not have a query or a fragment: the client adds websocket/{app}/{key} to it")


def check_frame_bytes(max_frame_bytes: object) -> None:
    """Raise ValueError unless ``max_frame_bytes`` is a whole number of bytes, at least 1 (None, which
    websockets reads as no limit at all, is refused: that is the unbounded buffer it is there to stop)."""
    if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int) or max_frame_bytes < 1:
        raise ValueError(f"max_frame_bytes must be a whole number of bytes, at least 1, not {max_frame_bytes!r}")


def check_key(key: object) -> None:
    """Raise ValueError for a key no Relay can take: not a string, or empty (an environment variable
    that is not set, read with a default of ""): Relay would refuse it at every retry."""
    if not isinstance(key, str):
        raise ValueError(f"the key must be a string, not {type(key).__name__}")
    if not key:
        raise ValueError("the key is empty: give the conductor key Relay issued for this app")


def websocket_url(base: str, app: str, key: str) -> str:
    """Relay's executor endpoint under ``base``: ``.../websocket/{app}/{key}``."""
    return f"{base.rstrip('/')}/websocket/{quote(app, safe='')}/{quote(key, safe='')}"


class _Redacting(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger for websockets that writes its lines, arguments filled in, through ``redact``."""

    def __init__(self, logger: logging.Logger, redact: Callable[[str], str]) -> None:
        super().__init__(logger, {})
        self._redact = redact

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if self.isEnabledFor(level):
            text = str(msg) % args if args else str(msg)
            exc_info = kwargs.pop("exc_info", None)
            if exc_info:  # the traceback's text too (an exception's message may hold the URL), redacted
                if exc_info is True:
                    exc_info = sys.exc_info()
                elif isinstance(exc_info, BaseException):
                    exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
                if isinstance(exc_info, tuple) and exc_info[0] is not None:
                    text += "\n" + "".join(traceback.format_exception(*exc_info)).rstrip()
            super().log(level, "%s", self._redact(text), **kwargs)


class _ResolvingLoop(asyncio.SelectorEventLoop):
    """The client's event loop, resolving host names on a daemon thread of its own for each lookup.

    asyncio resolves on its default executor, whose threads cannot be cancelled and are waited
    for: by ``asyncio.run`` as it ends (so ``stop()`` would wait out a lookup that hangs, a DNS
    server not answering: tens of seconds) and by the interpreter as it exits. A stop leaves a
    lookup here behind; its answer is dropped."""

    async def getaddrinfo(
        self, host: bytes | str | None, port: bytes | str | int | None, *,
        family: int = 0, type: int = 0, proto: int = 0, flags: int = 0,
    ) -> list[tuple[Any, ...]]:  # fmt: skip
        answer: asyncio.Future[list[tuple[Any, ...]]] = self.create_future()

        def settle(result: list[tuple[Any, ...]] | None, error: BaseException | None) -> None:
            if answer.done():  # cancelled: stopped meanwhile
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(result or [])

        def resolve() -> None:
            try:
                result, error = socket.getaddrinfo(host, port, family, type, proto, flags), None
            except Exception as exc:
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for it
                self.call_soon_threadsafe(settle, result, error)

        threading.Thread(target=resolve, name="relay-client-resolve", daemon=True).start()
        return await answer


class Connection:
    """One executor's connection to Relay, on a thread of its own. Made by :func:`relay_client.connect`."""

    def __init__(
        self,
        base_url: str,
        *,
        key: str,
        app: str,
        handlers: Handlers,
        ssl_context: ssl.SSLContext | None = None,
        max_concurrent_requests: int = 4,
        send_queue_size: int = 64,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        alive: Callable[[], bool] = lambda: True,
        max_waiting_requests: int = 64,
    ) -> None:
        if max_concurrent_requests < 1 or send_queue_size < 1:
            raise ValueError("max_concurrent_requests and send_queue_size must be at least 1")
        if max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be at least 0")
        check_frame_bytes(max_frame_bytes)
        check_url(base_url)
        self.app = app
        self.executor_id = handlers.identity.executor_id
        self.handlers = handlers
        self._url = websocket_url(base_url, app, key)
        self._shown_url = websocket_url(base_url, app, "") + "***"  # the key is never logged
        check_key(key)
        # The key as errors may spell it: as given, and as it is in the URL's path; blanked where it
        # is in the URL (its path), and anywhere only when long enough not to be found by chance.
        forms = sorted({key, quote(key, safe="")}, key=len, reverse=True)
        self._key_in_url = re.compile("(/websocket/[^/\\s]*/)(?:" + "|".join(map(re.escape, forms)) + ")")
        self._secrets = forms if len(key) >= REDACT_ANYWHERE_MIN else []
        # websockets refuses ssl=None for a wss:// URL: the system's CAs, unless given a context.
        if ssl_context is None and urlsplit(base_url).scheme == "wss":
            ssl_context = ssl.create_default_context()
        self._ssl = ssl_context
        self._max_concurrent = max_concurrent_requests
        self._max_held = max_concurrent_requests + max_waiting_requests
        self._send_queue_size = send_queue_size
        self._max_frame_bytes = max_frame_bytes
        self._alive = alive
        self._lock = threading.Lock()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._connected = threading.Event()
        # Draining (DBOS shutting down): requests are refused; _busy counts handlers running.
        self._draining = False
        self._idle = threading.Condition()
        self._busy = 0
        self._thread = threading.Thread(target=self._run, name=f"relay-client-{app}", daemon=True)
        # Made by each run of the thread's loop (see the module's docstring).
        self._workers: ThreadPoolExecutor | None = None
        self._greeter: ThreadPoolExecutor | None = None
        self._last_error = ""

    # --- Control, from any thread ---

    def start(self) -> None:
        self._thread.start()

    @property
    def connected(self) -> bool:
        """Whether the socket to Relay is open now."""
        return self._connected.is_set()

    @property
    def running(self) -> bool:
        """Whether the client's thread is alive (connected or reconnecting)."""
        return self._thread.is_alive()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called: requests are refused, the socket stays open."""
        return self._draining

    def drain(self, handlers_timeout: float = 2.0, retention_timeout: float = 10.0) -> None:
        """Serve no more requests (each is refused with its failure reply, which Relay reads as a
        refusal and asks another executor), end the retention round at its next batch, and wait for
        the handlers running (up to ``handlers_timeout`` seconds) and the round (up to
        ``retention_timeout``) to end. The socket stays open: the executor is still alive to Relay.
        Called before DBOS's own destroy, so nothing runs against a DBOS taken away from under it."""
        deadline = time.monotonic() + handlers_timeout
        with self._idle:
            self._draining = True
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            busy = self._busy
        if busy:
            log.info("relay_client: DBOS is shutting down with %d request(s) still being served", busy)
        self.handlers.retention.join(retention_timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Close the socket and end the thread (waiting up to ``timeout`` seconds for it)."""
        with self._lock:
            self._stopping = True
            loop, stop_event = self._loop, self._stop_event
        if loop is not None and stop_event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                loop.call_soon_threadsafe(stop_event.set)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.handlers.retention.join(min(timeout, 2.0))

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- The client's thread ---

    def _run(self) -> None:
        try:
            # Not asyncio.run's default loop: its resolver would hold stopping up (see _ResolvingLoop).
            with asyncio.Runner(loop_factory=_ResolvingLoop) as runner:
                runner.run(self._main())
        except Exception as exc:
            log.error("relay_client: the connection thread failed: %s", self._redact(repr(exc)))
        finally:
            self._connected.clear()

    async def _main(self) -> None:
        stop_event = asyncio.Event()
        with self._lock:
            self._loop, self._stop_event = asyncio.get_running_loop(), stop_event
            if self._stopping:
                stop_event.set()
        watcher = asyncio.create_task(self._watch(stop_event))
        requests = asyncio.Semaphore(self._max_concurrent)
        name = f"relay-client-{self.app}"
        self._workers = ThreadPoolExecutor(self._max_concurrent, thread_name_prefix=f"{name}-request")
        self._greeter = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-handshake")
        last, in_a_row = Retry.SOON, 0
        try:
            while not stop_event.is_set():
                retry, lasted = await self._connect_once(stop_event, requests)
                if stop_event.is_set():
                    break
                in_a_row = in_a_row + 1 if retry is last and lasted < STEADY_SECS else 1
                last = retry
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop_event.wait(), reconnect_delay(retry, in_a_row))
        finally:
            watcher.cancel()
            # Handlers still running finish on their own; stopping does not wait for them.
            for pool in (self._workers, self._greeter):
                pool.shutdown(wait=False, cancel_futures=True)
        log.info("relay_client: connection to Relay stopped")

    async def _watch(self, stop_event: asyncio.Event) -> None:
        """Stop when the DBOS this client serves is gone (destroyed some way the hook did not see)."""
        while not stop_event.is_set():
            await asyncio.sleep(WATCH_INTERVAL_SECS)
            if not self._alive():
                log.info("relay_client: DBOS was destroyed; disconnecting from Relay")
                with self._lock:
                    self._stopping = True
                stop_event.set()

    async def _connect_once(self, stop_event: asyncio.Event, requests: asyncio.Semaphore) -> tuple[Retry, float]:
        """One socket, from connecting to its end: how it ended, which says when to try again, and
        how long it was open (0 if it never opened)."""
        loop = asyncio.get_running_loop()
        opened: float | None = None
        try:
            ws = await self._open(stop_event)
            if ws is None:  # stopped while connecting
                return Retry.SOON, 0.0
            async with ws:
                opened = loop.time()
                self._note_problem("")
                log.info("relay_client: connected to %s as executor %s", self._shown_url, self.executor_id)
                await self._serve(ws, stop_event, requests)
            retry = retry_after_close(ws.close_code)
        except InvalidStatus as exc:
            body = exc.response.body.decode("utf-8", "replace")[:500] if exc.response.body else ""
            self._note_problem(f"Relay refused the connection ({exc.response.status_code}): {body}")
            retry = retry_after_status(exc.response.status_code)
        except ConnectionClosed as exc:
            if exc.sent is not None and exc.sent.code == MESSAGE_TOO_BIG and exc.rcvd_then_sent is not True:
                self._note_problem(
                    f"Relay sent a frame larger than max_frame_bytes ({self._max_frame_bytes} bytes); "
                    f"closed the socket (1009): {exc!r}"
                )
            else:
                self._note_problem(f"Connection to Relay lost: {exc!r}")
            retry = retry_after_close(exc.rcvd.code if exc.rcvd is not None else None)
        except ssl.SSLCertVerificationError as exc:  # an OSError, but no loss: the same certificate next time
            self._note_problem(f"Relay's certificate is not trusted: {exc!r}")
            retry = Retry.REFUSED
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError) as exc:
            self._note_problem(f"Connection to Relay lost during the TLS handshake: {exc!r}")  # cut: a loss
            retry = Retry.SOON
        except ssl.SSLError as exc:
            # The TLS handshake itself failed (a port that speaks no TLS: WRONG_VERSION_NUMBER; no
            # protocol or cipher in common): the same next time, as an untrusted certificate.
            self._note_problem(f"TLS handshake with Relay failed (is this port serving TLS, wss://?): {exc!r}")
            retry = Retry.REFUSED
        except (OSError, TimeoutError, InvalidMessage) as exc:  # InvalidMessage: cut during the handshake
            self._note_problem(f"Connection to Relay lost: {exc!r}")
            retry = Retry.SOON
        except (InvalidHandshake, InvalidURI) as exc:
            # What answered is not a Relay taking this executor, and will answer the same again: a
            # redirect the client cannot follow (to https://: InvalidURI; a loop: SecurityError),
            # a server that is not a WebSocket one (InvalidUpgrade, InvalidHeader).
            self._note_problem(f"Relay's address did not take the WebSocket handshake: {exc!r}")
            retry = Retry.REFUSED
        except Exception as exc:
            # No traceback: its text is the exception's, and it would come at every retry.
            self._note_problem(f"Unexpected error on the connection to Relay: {exc!r}")
            retry = Retry.BUSY
        return retry, 0.0 if opened is None else loop.time() - opened

    async def _open(self, stop_event: asyncio.Event) -> ClientConnection | None:
        """The socket to Relay, opened; None if stopped first. A stop cancels the attempt at once,
        wherever it is (resolving Relay's host, connecting, the TLS or WebSocket handshake): it
        would otherwise take up to ``OPEN_TIMEOUT_SECS``, and ``stop()`` waits for the thread."""
        opening = asyncio.ensure_future(
            connect(
                self._url,
                ssl=self._ssl,
                open_timeout=OPEN_TIMEOUT_SECS,
                close_timeout=CLOSE_TIMEOUT_SECS,
                ping_interval=PING_INTERVAL_SECS,
                ping_timeout=PING_TIMEOUT_SECS,
                max_size=self._max_frame_bytes,
                logger=_Redacting(logging.getLogger("websockets.client"), self._redact),
            )
        )
        stopped = asyncio.ensure_future(stop_event.wait())
        try:
            await asyncio.wait({opening, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not opening.done():
                opening.cancel()
                await asyncio.wait({opening})  # its cancellation runs to its end, quickly
        if opening.cancelled():
            return None
        return opening.result()  # or raises what ended the attempt

    def _redact(self, text: str) -> str:
        """``text`` with the key replaced by ``***``, as in the URL the client shows: in the URL's path
        (``/websocket/{app}/{key}``) whatever its length, and elsewhere when it has at least
        :data:`REDACT_ANYWHERE_MIN` characters. A shorter one would be found by chance in any text,
        and blanking each of those (every "e" of a line for a key "e") would spell it out."""
        text = self._key_in_url.sub(r"\1***", text)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _note_problem(self, problem: str) -> None:
        """Log a connection problem once, not at every retry, never with the key in it."""
        problem = self._redact(problem)
        if problem and problem != self._last_error:
            log.warning("relay_client: %s; reconnecting", problem)
        self._last_error = problem

    async def _serve(self, ws: ClientConnection, stop_event: asyncio.Event, requests: asyncio.Semaphore) -> None:
        outbox: asyncio.Queue[str] = asyncio.Queue(self._send_queue_size)
        handling: set[asyncio.Task[None]] = set()
        reader = asyncio.create_task(self._read(ws, outbox, requests, handling))
        sender = asyncio.create_task(self._send(ws, outbox))
        stopper = asyncio.create_task(stop_event.wait())
        self._connected.set()
        try:
            done, _ = await asyncio.wait({reader, sender, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:
                await ws.close(1000, "executor stopping")
            for task in done - {stopper}:
                task.result()  # raises what ended the connection
            if reader in done:
                self._note_problem(f"Relay closed the connection (code {ws.close_code})")
        finally:
            self._connected.clear()
            for task in (reader, sender, stopper, *handling):
                task.cancel()

    async def _read(
        self, ws: ClientConnection, outbox: asyncio.Queue[str], requests: asyncio.Semaphore,
        handling: set[asyncio.Task[None]],
    ) -> None:  # fmt: skip
        # Every frame is read as it comes (not only when a turn is free): a socket left unread would
        # hold Relay's pings back too, once websockets' buffer is full, and Relay would take a busy
        # executor for a dead one. What bounds memory is the number of requests held.
        refused = 0  # since the client was last able to take a request: logged once, then counted
        first = True
        async for message in ws:
            if isinstance(message, bytes):
                log.warning("relay_client: ignoring a binary frame from Relay")
                continue
            if first:  # the handshake: Relay speaks first, with executor_info
                first = False
                greeting = asyncio.create_task(self._greet(message, outbox))
                handling.add(greeting)
                greeting.add_done_callback(handling.discard)
                continue
            if len(handling) >= self._max_held:
                refused += 1
                await self._refuse(message, outbox, len(handling), log.warning if refused == 1 else log.debug)
                continue
            if refused:
                log.info("relay_client: taking requests again; %d refused while busy", refused)
                refused = 0
            task = asyncio.create_task(self._answer(message, outbox, requests))
            handling.add(task)
            task.add_done_callback(handling.discard)

    async def _refuse(self, text: str, outbox: asyncio.Queue[str], held: int, note: Callable[..., None]) -> None:
        why = (f"relay_client: busy, {held} requests in progress or waiting for one of "
               f"{self._max_concurrent} turns; not served, ask again later")  # fmt: skip
        note("%s", why)
        reply = self.handlers.refuse(text, why)
        if reply is not None:
            # Waits only while the replies before it are not taken (Relay reads none: its pings wait too).
            await outbox.put(reply)

    async def _answer(self, text: str, outbox: asyncio.Queue[str], requests: asyncio.Semaphore) -> None:
        """Serve one request in its turn; the turn lasts until the reply is queued for sending."""
        async with requests:
            try:
                reply = await self._on(self._workers, text, self._serve_request)
            except _Exiting:
                # The interpreter is exiting (it waits for DBOS's workflows before any atexit hook,
                # ours included): no new work, but Relay is told so at once and asks another.
                reply = self.handlers.refuse(text, SHUTTING_DOWN)
            if reply is not None:
                await outbox.put(reply)

    async def _on(self, pool: ThreadPoolExecutor | None, text: str, serve: Callable[[str], str | None]) -> str | None:
        """``serve(text)`` on a thread of ``pool``, in a fresh copy of the loop's context (as
        ``asyncio.to_thread`` runs a call): a pool thread serves one request after another, and none
        may see what an earlier one left in its context variables."""
        context = contextvars.copy_context()
        try:
            served = asyncio.get_running_loop().run_in_executor(pool, context.run, serve, text)
        except RuntimeError as exc:  # concurrent.futures once the interpreter's exit has begun
            raise _Exiting(str(exc)) from exc
        return await served

    def _serve_request(self, text: str) -> str | None:
        """The handlers' answer to ``text``; once draining, its refusal (DBOS is shutting down)."""
        with self._idle:
            if self._draining:
                return self.handlers.refuse(text, SHUTTING_DOWN)
            self._busy += 1
        try:
            return self.handlers.answer(text)
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    async def _greet(self, text: str, outbox: asyncio.Queue[str]) -> None:
        """Answer the socket's first frame (the handshake) on the handshake's own thread: it reads
        no DBOS state, and is answered while draining too (the executor is still alive)."""
        try:
            reply = await self._on(self._greeter, text, self.handlers.answer)
        except _Exiting:
            reply = self.handlers.answer(text)  # a reconnection while the interpreter exits: it reads no DBOS state
        if reply is not None:
            await outbox.put(reply)

    async def _send(self, ws: ClientConnection, outbox: asyncio.Queue[str]) -> None:
        while True:
            await ws.send(await outbox.get())
