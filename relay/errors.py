"""Relay's exceptions.

Errors from libraries (psycopg, websockets, pydantic, yaml) are converted at the
boundary where they occur, with ``raise ... from exc``, so that callers handle
only these::

    RelayError
    ├── ConfigError            relay.yaml missing, unreadable or invalid
    ├── StartupError           a step of the start-up failed (other than reaching the database)
    ├── DatabaseError          PostgreSQL unreachable or a statement failed
    │   ├── Fenced             this instance's lease is not held: its ownership-bound writes are refused
    │   └── DatabaseUnreachable    not reached: no connection of the pool in time, or the database known down
    │       └── ConnectionLost     the connection broke under a statement (a failover, a restart, a cut)
    ├── ProtocolError          a frame from an executor broke the protocol
    ├── ExecutorRequestError   a request to a connected executor did not get a usable answer
    │   ├── ExecutorNotConnected   no live instance holds a socket to that executor
    │   ├── ExecutorTimeout        no reply within the timeout
    │   ├── ExecutorGone           the socket closed while the request was out
    │   ├── ExecutorBadReply       the reply broke the protocol (wrong shape or types)
    │   ├── ExecutorRefused        the reply carried only an error
    │   │   └── UnsupportedMessage     "Unknown message type": the executor's SDK lacks it
    │   ├── RequestNotServed       the instance holding the socket could not serve a request relayed to it (502)
    │   │   └── RequestLost            it died before answering: the executor may have had the request
    │   ├── NoHealthyExecutor      the app has no healthy executor to ask (the API's 503)
    │   │   └── NoSuchApp              ... since Relay knows no such app (404; a NotFound too)
    │   └── NoAnswer               none of the app's executors answered (the API's 502)
    ├── UnsendableRequest      a request made from an API call is beyond what the protocol carries (422)
    ├── TooManyRequests        an app already has its cap of requests in flight, or a key its
    │                          cap of event streams (429)
    ├── StreamsExhausted       this instance serves as many event streams as it allows (503)
    ├── Forbidden              the caller's key may not act on what it names: a key beyond its powers (403)
    └── ActionRefused          an operator's action does not apply (the API answers 404 or 409)
        ├── NotFound               no such app, executor or recovery
        └── Conflict               the state does not allow it (a HEALTHY executor), or changed meanwhile
"""

from __future__ import annotations


class RelayError(Exception):
    """Base class of every error Relay raises on purpose."""


class ConfigError(RelayError):
    """relay.yaml (or an option overriding it) is missing, unreadable or invalid."""


class StartupError(RelayError):
    """Relay could not start: a step of its start-up failed, for another reason than a database
    it cannot reach (which is a :class:`DatabaseError`)."""


class DatabaseError(RelayError):
    """PostgreSQL could not be reached, or a statement failed."""


class DatabaseUnreachable(DatabaseError):
    """The database was not reached, whatever the statement: no connection of the pool within the
    wait (the database away, or every connection busy), the database known unreachable (a request of
    the API refused at once), or the connection lost under the statement. Another statement now would
    most likely fail the same way, where a statement's own failure (a bad value, a deadlock) says
    nothing of the next one."""


class ConnectionLost(DatabaseUnreachable):
    """The pool's connection broke under a statement: the server closed it (a failover, a restart of
    PostgreSQL, an administrator) or it was cut. A statement that is safe to repeat may be tried
    again at once: the pool's other idle connections were checked, and the broken ones replaced."""


class Fenced(DatabaseError):
    """This instance's lease expired or was taken over: a write bound to what it owns was refused.

    A subclass of :class:`DatabaseError` so that a workflow step retries it: the
    lease comes back at the next renewal, or the instance exits if another one
    has adopted it.
    """


class ProtocolError(RelayError):
    """A frame from an executor was malformed or unexpected."""


class ExecutorRequestError(RelayError):
    """A request to an executor did not get an answer."""


class ExecutorNotConnected(ExecutorRequestError):
    """No live Relay instance holds an open socket to the executor (or, from the hub, not this one)."""


class ExecutorTimeout(ExecutorRequestError):
    """The executor did not answer within the timeout."""


class ExecutorGone(ExecutorRequestError):
    """The executor's socket closed while a request was waiting for its reply."""


class ExecutorBadReply(ExecutorRequestError):
    """The executor's reply did not have the shape or the types the protocol gives it."""


class ExecutorRefused(ExecutorRequestError):
    """The executor answered with an error and nothing else."""


class UnsupportedMessage(ExecutorRefused):
    """The executor's SDK does not know the message ("Unknown message type")."""


class RequestNotServed(ExecutorRequestError):
    """The instance holding the executor's socket could not serve a request relayed to it: one it
    cannot read (a message type of a newer release, during a rolling upgrade), or a failure of its
    own. The executor was not asked."""


class RequestLost(RequestNotServed):
    """The instance that took a request relayed to it died, or started again, before answering: the
    executor may have had the request (it is not sent again)."""


class NoHealthyExecutor(ExecutorRequestError):
    """The app has no healthy executor connected to any live instance."""


class NoAnswer(ExecutorRequestError):
    """None of the app's healthy executors answered in time."""


class UnsendableRequest(RelayError):
    """A request built from an API call breaks the protocol's limits (a NUL in a name, a name
    longer than the protocol carries, an integer past a bigint): the caller's mistake."""


class TooManyRequests(RelayError):
    """An app has as many requests in flight to its executors as Relay allows (or a key as many
    event streams open)."""


class StreamsExhausted(RelayError):
    """This instance serves as many event streams (the console's live updates) as it allows."""


class Forbidden(RelayError):
    """The caller's key may not act on what it names: another key with powers (permissions or apps)
    beyond its own. The API answers 403, as for a permission the key lacks."""


class ActionRefused(RelayError):
    """An operator's action does not apply to what it names."""


class NotFound(ActionRefused):
    """No such app, executor or recovery."""


class NoSuchApp(NotFound, NoHealthyExecutor):
    """A request for an app's executors names an app Relay does not know (not in relay.yaml, not
    registered, no executor ever connected): 404, as a typo is, not 503 "try again". Callers that
    take any unserved request alike catch it as a :class:`NoHealthyExecutor`."""


class Conflict(ActionRefused):
    """The thing is not in a state that allows the action, or its state changed meanwhile."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
