"""Serve an Engine over HTTP with hypercorn's Trio worker, inside the caller's nursery.

hypercorn's own ``serve`` accepts without bound, and three of its behaviours
let one client hang a connection or end the process (hypercorn 0.18):

- the close that follows a reply sent before the request body arrived, or a
  ``Connection: close`` exchange, runs in the app's task, which quart-trio
  cancels at that moment: the socket stays open and the next request on it
  is never answered;
- a send racing that close raises ``trio.BusyResourceError``, which no one
  catches, and the whole server nursery dies with it;
- idle keep-alive sockets are only closed by their own timer.

So this module runs the accept loop itself, with hypercorn's per-connection
``TCPServer``, a cap on connections that closes the longest-idle one to make
room, and an ASGI guard in front of the app that waits briefly for an unread
body (or says ``Connection: close``), bounds the time a body may take, and
answers 503 while the engine is still loading.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import errno
import json
import logging
import math
import os
import resource
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio
from h11._writers import ChunkedWriter  # private, but what tells a chunked reply apart; h11 is pinned for it
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event as ConnectionEvent, RawData, Updated
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app

from mlxcel.config import ServerConfig
from mlxcel.engine import EngineHandle
from mlxcel.errors import InvalidRequest, ServerBusy
from mlxcel.http.app import create_app
from mlxcel.http.guards import trusted_hosts_for
from mlxcel.http.responses import ResponseKeeper

logger = logging.getLogger(__name__)

# File descriptors kept free of connections: model files, the listener, worker threads.
RESERVED_FDS = 64
# An unread body this small is waited for (up to DRAIN_SECONDS) so the connection can be reused.
DRAIN_BYTES = 64 << 10
DRAIN_SECONDS = 1.0
CLOSE_SECONDS = 5.0
_ACCEPT_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


class PendingEngine:
    """An engine still starting: ``serve`` answers 503 until ``set`` hands it the engine."""

    def __init__(self) -> None:
        self.engine: EngineHandle | None = None
        self._ready = trio.Event()

    def set(self, engine: EngineHandle) -> None:
        self.engine = engine
        self._ready.set()

    async def wait(self) -> EngineHandle:
        await self._ready.wait()
        assert self.engine is not None
        return self.engine


def bind_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket; raises OSError (port in use, bad address) before anything is loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def listen_urls(sock: socket.socket) -> list[str]:
    """The addresses a listening socket serves, as ``serve``'s ``task_status`` reports them."""
    return [f"http://{repr_socket_addr(sock.family, sock.getsockname())}"]


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to what the open-file limit leaves room for."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    room = max(soft - RESERVED_FDS, 1)
    if room < max_connections:
        logger.info("open-file limit %d allows only %d connections (asked for %d)", soft, room, max_connections)
    return min(max_connections, room)


class _Connections:
    """Open connections: which are idle (between requests) or still receiving a body, since when, and
    how many each client address holds.

    A connection that waits on its client (idle, or a body still arriving) is what makes room at the
    cap, the one that has waited longest first; a connection whose request arrived whole is never
    closed for room. So slow bodies, however many, cannot keep out a request that arrives complete.
    """

    def __init__(self, cap: int, per_client: int = 0) -> None:
        self.cap = cap
        # 0: no per-client bound.
        self.per_client = per_client
        self.idle_since: dict[_Connection, float | None] = {}
        self.receiving_since: dict[_Connection, float] = {}
        self.num_by_client: collections.Counter[str] = collections.Counter()
        self.changed = trio.Event()
        # The handlers' scope once the server runs: cancelled when shutdown's grace ends.
        self.handlers: trio.CancelScope | None = None
        # Set when shutdown starts its grace; until then no handler can be cut off, and asking the scope
        # (which reads the clock against its deadline) for every streamed token is not free.
        self.shutting_down = False

    def cut_off(self) -> bool:
        """Whether shutdown's grace has ended and the handlers (the apps with them) are being cancelled."""
        return self.shutting_down and self.handlers is not None and self.handlers.cancel_called

    def add(self, connection: _Connection) -> None:
        self.idle_since[connection] = trio.current_time()
        self.num_by_client[connection.client_host] += 1

    def remove(self, connection: _Connection) -> None:
        self.receiving_since.pop(connection, None)
        if self.idle_since.pop(connection, False) is not False:
            self.num_by_client[connection.client_host] -= 1
            if self.num_by_client[connection.client_host] <= 0:
                del self.num_by_client[connection.client_host]
            self.changed.set()
            self.changed = trio.Event()

    def mark(self, connection: _Connection, idle: bool) -> None:
        if connection in self.idle_since:
            self.idle_since[connection] = trio.current_time() if idle else None

    def receiving(self, connection: _Connection, receiving: bool) -> None:
        """A request's body has started (True) or finished (False) arriving on ``connection``."""
        if receiving and connection in self.idle_since:
            self.receiving_since[connection] = trio.current_time()
        else:
            self.receiving_since.pop(connection, None)

    def idle(self) -> list[_Connection]:
        pairs = [(since, id(c), c) for c, since in self.idle_since.items() if since is not None and not c.closing]
        return [c for _, _, c in sorted(pairs)]

    def waiting(self, client_host: str | None = None) -> list[_Connection]:
        """Connections waiting on their client (idle, or a body still arriving), longest-waiting first."""
        pairs = []
        for connection, idle_since in self.idle_since.items():
            if connection.closing or (client_host is not None and connection.client_host != client_host):
                continue
            since = idle_since if idle_since is not None else self.receiving_since.get(connection)
            if since is not None:
                pairs.append((since, id(connection), connection))
        return [c for _, _, c in sorted(pairs)]

    def over_client_bound(self, client_host: str) -> bool:
        return self.per_client > 0 and self.num_by_client[client_host] >= self.per_client


def _shielded() -> trio.CancelScope:
    """Safe from outside cancellation, but never stuck: a close takes at most a few seconds."""
    return trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_SECONDS)


# The connection a request arrived on, for the guard (the app's tasks run in its context).
_CONNECTION: contextvars.ContextVar[_Connection | None] = contextvars.ContextVar("mlxcel_connection", default=None)


def _client_host(stream: Any) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return ""


def write_now(stream: Any, data: bytes) -> int:
    """Write what the socket under ``stream`` takes without waiting; the bytes written (0 on any error, which
    the awaited path then meets and handles). Only with no send in progress, so the bytes keep their order."""
    sock = getattr(stream, "socket", None)
    fd = sock.fileno() if sock is not None else -1
    if fd < 0:  # closed, or not a plain socket
        return 0
    try:
        return os.write(fd, data)
    except OSError:  # full (the socket is non-blocking), or the peer went away
        return 0


class _Connection(TCPServer):
    """hypercorn's connection handler, with its close made uncancellable and race-safe."""

    def __init__(self, connections: _Connections, *args: Any) -> None:
        super().__init__(*args)
        self.connections = connections
        self.closing = False
        self.client_host = _client_host(self.stream)

    async def run(self) -> None:
        _CONNECTION.set(self)
        self.connections.add(self)
        try:
            await super().run()
        except Exception:
            # One connection's failure is never the server's.
            logger.exception("connection handler failed")
        finally:
            self.connections.remove(self)

    async def protocol_send(self, event: ConnectionEvent) -> None:
        # hypercorn's events are ABCs: an isinstance check that misses costs about 0.4 us here. The common event first.
        if type(event) is RawData:
            await self._send_raw(event.data)
            return
        if isinstance(event, Updated):
            self.connections.mark(self, event.idle)
        if isinstance(event, Closed):
            # Runs in the app's task, which quart-trio cancels as the reply ends.
            with _shielded():
                await super().protocol_send(event)
            return
        await self._send_by_hypercorn(event)

    async def _send_raw(self, data: bytes) -> None:
        if not self.send_lock.locked() and not self.connections.cut_off():
            # Most writes fit the socket's buffer at once. hypercorn's path (a lock, a shielded cancel scope and
            # a trip through Trio's scheduler per write) cost the loop 53-67 us of CPU per streamed token at 64
            # streams (docs/benchmarks.md), on the thread that shares the GIL with the device. What does not
            # fit goes that way, and so does every write once shutdown cuts the apps off: there hypercorn's
            # lock raises Cancelled before any byte, so the client sees the connection drop rather than the
            # bare 500 hypercorn sends for an app that ended without a reply. (Asking trio whether this task
            # is cancelled walks its cancel scopes: 5 % of the loop's time at 64 streams.)
            written = write_now(self.stream, data)
            if written == len(data):
                return
            data = data[written:]
        await self._send_by_hypercorn(RawData(data=data))

    async def _send_by_hypercorn(self, event: ConnectionEvent) -> None:
        try:
            await super().protocol_send(event)
        except trio.BusyResourceError:
            # A send raced the close of a connection the client already dropped.
            await self.protocol.handle(Closed())

    async def send_chunk(self, data: bytes) -> bool:
        """Frame and write one body chunk of a chunked HTTP/1.1 reply here; False where hypercorn must send it.

        A streamed token is one chunk. hypercorn's path for it (the ASGI stream's checks, the HTTP/1.1 protocol's
        event, h11's state machine and writer, a RawData event) cost the loop about a third of its CPU per
        token at 64 streams (docs/benchmarks.md), on the thread that shares the GIL with the device. h11's
        chunked writer keeps no state between chunks, so writing the same framing here leaves it consistent;
        the reply's end still goes through h11.
        """
        connection = getattr(getattr(self.protocol, "protocol", None), "connection", None)
        if (not data or not isinstance(connection, h11.Connection) or connection.our_state is not h11.SEND_BODY
                or not isinstance(getattr(connection, "_writer", None), ChunkedWriter)):
            return False
        await self._send_raw(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    async def _close(self) -> None:
        with _shielded():
            await super()._close()
        # The socket is gone; hypercorn's idle timer may keep the task alive a few seconds more.
        self.connections.remove(self)

    async def close_now(self) -> None:
        """Close from outside (eviction, shutdown): the read loop ends and the handler returns."""
        self.closing = True
        await self.stream.aclose()
        self.connections.remove(self)


def _loading_body(path: str) -> tuple[int, dict[str, Any], list[tuple[bytes, bytes]]]:
    if path == "/health":
        return 503, {"status": "loading"}, [(b"retry-after", b"1")]
    error = ServerBusy("the model is still loading; retry shortly")
    error.code = "model_loading"
    return 503, error.to_body(), [(b"retry-after", str(error.retry_after_seconds).encode())]


async def _send_json(send: Callable[[dict[str, Any]], Awaitable[None]], status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class _Guard:
    """ASGI wrapper per request: loading replies, a body deadline, and no reply that strands a connection."""

    def __init__(self, body_timeout: float) -> None:
        self.app: Any = None  # the wrapped quart app once the engine is ready
        self.body_timeout = body_timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any, sync_spawn: Any, call_soon: Any) -> None:
        if scope["type"] != "http":
            return
        body_done = trio.Event()
        started = False
        declared, chunked = _body_framing(scope)
        connection = _CONNECTION.get()
        if not chunked and not declared:
            body_done.set()
        elif connection is not None:
            # Until the body is whole, this connection may be closed to make room (see _Connections).
            connection.connections.receiving(connection, True)
        # The whole body must arrive within body_timeout, however steadily it trickles.
        deadline_scope = trio.CancelScope(deadline=trio.current_time() + self.body_timeout)

        async def guarded_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done.set()
                deadline_scope.deadline = math.inf
                if connection is not None:
                    connection.connections.receiving(connection, False)
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", []))
                closing = any(name.lower() == b"connection" and b"close" in value.lower() for name, value in headers)
                if not body_done.is_set() and not closing:
                    # Replied before the body arrived: wait for a small one, else end the connection.
                    if chunked or (declared or 0) <= DRAIN_BYTES:
                        with trio.move_on_after(DRAIN_SECONDS):
                            await body_done.wait()
                    if not body_done.is_set():
                        headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            elif (message["type"] == "http.response.body" and message.get("more_body", False) and started
                  and connection is not None and await connection.send_chunk(message.get("body", b""))):
                return
            await send(message)

        try:
            with deadline_scope:
                if self.app is None:
                    await _drain(guarded_receive)
                    status, body, headers = _loading_body(scope["path"])
                    await _send_json(guarded_send, status, body, headers)
                else:
                    await self.app(scope, guarded_receive, guarded_send, sync_spawn, call_soon)
        finally:
            if connection is not None:
                connection.connections.receiving(connection, False)
        if deadline_scope.cancelled_caught and not started:
            error = InvalidRequest(f"the request body did not arrive within {self.body_timeout:g} s",
                                   status=408, code="request_timeout")
            await _send_json(send, 408, error.to_body(), [(b"connection", b"close")])


def _body_framing(scope: dict[str, Any]) -> tuple[int | None, bool]:
    """The declared Content-Length (None when absent or bad) and whether the body is chunked."""
    declared, chunked = None, False
    for name, value in scope["headers"]:
        name = name.lower()
        if name == b"content-length" and value.strip().isdigit():
            declared = int(value)
        elif name == b"transfer-encoding":
            chunked = True
    return declared, chunked


async def _drain(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _accept_loop(
    listener: trio.SocketListener,
    connections: _Connections,
    handler_nursery: trio.Nursery,
    make_connection: Callable[[trio.SocketStream], _Connection],
) -> None:
    warned = False
    while True:
        if len(connections.idle_since) >= connections.cap:
            changed = connections.changed
            waiting = connections.waiting()
            if waiting:
                await waiting[0].close_now()  # the connection that has waited on its client longest makes room
            await changed.wait()
            continue
        try:
            stream = await listener.accept()
        except OSError as error:
            if error.errno not in _ACCEPT_ERRORS:
                raise
            if not warned:
                logger.warning(
                    "accept failed (%s); closing idle connections to make room", errno.errorcode[error.errno]
                )
                warned = True
            for connection in connections.idle()[:16]:
                await connection.close_now()
            await trio.sleep(0.05)
            continue
        client_host = _client_host(stream)
        if connections.over_client_bound(client_host):
            # One address holds its share: its own longest-waiting connection makes room, else it waits its turn.
            own = connections.waiting(client_host)
            if not own:
                handler_nursery.start_soon(_refuse, stream)
                continue
            await own[0].close_now()
        handler_nursery.start_soon(make_connection(stream).run)


async def _refuse(stream: trio.SocketStream) -> None:
    """A 503 on a connection over its client's bound whose requests are all in progress, then close."""
    error = ServerBusy("this client holds its share of connections, all busy; retry shortly")
    payload = json.dumps(error.to_body()).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: "
            f"{len(payload)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n").encode()
    with _shielded():
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(head + payload)
        await stream.aclose()


async def serve(
    engine: EngineHandle | PendingEngine,
    config: ServerConfig | None = None,
    *,
    sock: socket.socket | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    responses_for: Callable[[EngineHandle], ResponseKeeper] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` as ``config`` says (None: the defaults) until ``shutdown_trigger`` returns or the
    task is cancelled.

    After the trigger, the listener closes, idle connections close at once,
    and open requests get ``config.shutdown_grace_seconds`` to finish before
    they are cancelled. ``engine`` may be a ``PendingEngine``: the port
    answers at once, with 503 until the engine is set. ``sock`` is a
    listening socket (``bind_socket``) to use instead of binding
    ``config.host:config.port``.

    ``task_status.started`` receives the bound addresses, e.g. ``["http://127.0.0.1:8080"]``
    (port 0 picks a free port). ``responses_for``: given the engine, the store behind
    ``previous_response_id`` (``create_app``'s ``kept_responses``; None: the app's own).
    """
    config = ServerConfig() if config is None else config
    hypercorn_config = HypercornConfig()
    hypercorn_config.graceful_timeout = config.shutdown_grace_seconds
    hypercorn_config.keep_alive_timeout = config.keep_alive_timeout
    hypercorn_config.accesslog = None
    hypercorn_config.errorlog = logging.getLogger("hypercorn.error")
    hypercorn_config.set_statsd_logger_class(StatsdLogger)
    sock = sock if sock is not None else bind_socket(config.host, config.port)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    binds = listen_urls(sock)
    pending = engine if isinstance(engine, PendingEngine) else None
    guard = _Guard(config.body_timeout)
    context = WorkerContext(None)
    # Without an API key nothing but the address tells clients apart: each gets a bounded share.
    connections = _Connections(connection_cap(config.max_connections),
                               per_client=config.max_connections_per_client if config.api_key is None else 0)

    def make_connection(stream: trio.SocketStream) -> _Connection:
        return _Connection(connections, guard, hypercorn_config, context, ConnectionState({}), stream)

    async def open_app(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        ready = await pending.wait() if pending is not None else engine
        assert isinstance(ready, EngineHandle)
        app = wrap_app(create_app(ready, config, trusted_hosts=trusted_hosts_for(config.host),
                                  kept_responses=responses_for(ready) if responses_for else None),
                       hypercorn_config.wsgi_max_body_size, None)
        lifespan = Lifespan(app, hypercorn_config, {})
        async with trio.open_nursery() as lifespan_nursery:
            await lifespan_nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            guard.app = app
            task_status.started()
            await trio.sleep_forever()

    try:
        async with trio.open_nursery() as app_nursery:
            if pending is None:
                await app_nursery.start(open_app)
            else:
                app_nursery.start_soon(open_app)
            async with trio.open_nursery() as handler_nursery:
                connections.handlers = handler_nursery.cancel_scope
                async with trio.open_nursery() as accept_nursery:
                    accept_nursery.start_soon(_accept_loop, listener, connections, handler_nursery, make_connection)
                    task_status.started(binds)
                    if shutdown_trigger is not None:
                        await shutdown_trigger()
                    else:
                        await trio.sleep_forever()
                    accept_nursery.cancel_scope.cancel()
                await listener.aclose()
                # Idle keep-alive connections close now; hypercorn closes each busy one after its reply.
                await context.terminated.set()
                for connection in connections.idle():
                    await connection.close_now()
                handler_nursery.cancel_scope.deadline = trio.current_time() + config.shutdown_grace_seconds
                connections.shutting_down = True
            app_nursery.cancel_scope.cancel()
    finally:
        sock.close()
