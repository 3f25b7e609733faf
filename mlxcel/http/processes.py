"""The HTTP edge in processes of its own (``mlxcel serve --api-processes N``).

The engine's process binds the port, then starts N API processes, each with
the listening socket and one end of a socket pair (``engine_link``); the
kernel hands each new connection to one of them. An API process answers 503
until the engine has loaded, as a single process does.

Shutdown: on SIGINT or SIGTERM the engine's process passes SIGTERM on; each
API process stops accepting, gives its open streams the grace period, and
exits; then the engine stops. An API process that ends on its own (a crash)
takes the server down with it, as any fault of the one-process server would,
for the supervisor to restart; one whose engine process has gone exits at once.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable

import trio

from mlxcel.config import ServerConfig
from mlxcel.engine import EngineHandle
from mlxcel.http.engine_link import EngineLink, FrameReader, LinkClosed, RemoteEngine, RemoteResponses, frame
from mlxcel.http.responses import ResponseStore
from mlxcel.http.serve import PendingEngine, listen_urls, raise_open_file_limit, serve

logger = logging.getLogger(__name__)

# Past the grace period, how long an API process gets to exit before it is killed.
EXIT_SECONDS = 10.0


async def run_api_processes(
    pending: PendingEngine,
    config: ServerConfig,
    sock: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> bool:
    """Start ``config.api_processes`` API processes serving ``pending``'s engine on ``sock``; return once they
    have exited, after ``shutdown_trigger`` returns (False) or when one of them ended on its own (True).

    ``task_status.started`` receives the bound addresses, as ``serve``'s does."""
    # One store behind `previous_response_id` for all of them: a follow-up may reach any.
    kept = ResponseStore(max_entries=config.responses_store_entries, max_bytes=config.responses_store_bytes)
    processes: list[trio.Process] = []
    ended: list[trio.Process] = []
    async with trio.open_nursery() as links:
        try:
            for index in range(config.api_processes):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                with theirs:
                    processes.append(await trio.lowlevel.open_process(
                        [sys.executable, "-m", "mlxcel.http.processes", str(theirs.fileno()), str(sock.fileno())],
                        pass_fds=(theirs.fileno(), sock.fileno()), stdin=subprocess.DEVNULL,
                    ))
                stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
                await stream.send_all(frame([("config", config)]))
                links.start_soon(EngineLink(f"api{index}-", kept).run, stream, pending.wait)
            task_status.started(listen_urls(sock))
            async with trio.open_nursery() as watch:
                for process in processes:
                    watch.start_soon(_end_if_exits, process, ended, watch.cancel_scope)
                await shutdown_trigger()
                watch.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await _stop_all(processes, config.shutdown_grace_seconds + EXIT_SECONDS)
            links.cancel_scope.cancel()
    return bool(ended)


async def _end_if_exits(process: trio.Process, ended: list[trio.Process], scope: trio.CancelScope) -> None:
    status = await process.wait()
    logger.error("API process %d exited (status %s): stopping the server", process.pid, status)
    ended.append(process)
    scope.cancel()


async def _stop_all(processes: list[trio.Process], seconds: float) -> None:
    for process in processes:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
    with trio.move_on_after(seconds):
        for process in processes:
            await process.wait()
    for process in processes:
        if process.returncode is None:
            logger.warning("API process %d did not exit in %.0f s: killed", process.pid, seconds)
            process.kill()
            await process.wait()


# --- an API process ----------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    """``python -m mlxcel.http.processes LINK_FD LISTEN_FD``: run one API process."""
    link_fd, listen_fd = int(argv[0]), int(argv[1])
    status = 0
    with contextlib.suppress(KeyboardInterrupt):
        status = trio.run(_serve, link_fd, listen_fd)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # As the engine's process does: no interpreter teardown under threads left in native code.
    os._exit(status)


async def _serve(link_fd: int, listen_fd: int) -> int:
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=link_fd)))
    reader = FrameReader(stream)
    try:
        (kind, config), = await reader.receive()
    except LinkClosed:
        return 1
    assert kind == "config"
    assert isinstance(config, ServerConfig)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_open_file_limit()
    listener = socket.socket(fileno=listen_fd)
    pending = PendingEngine()
    stop = trio.Event()
    engine_gone = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, stop)

        async def serve_then_stop() -> None:
            await serve(pending, config, sock=listener, shutdown_trigger=stop.wait, responses_for=_remote_responses)
            nursery.cancel_scope.cancel()

        nursery.start_soon(serve_then_stop)

        def on_engine_gone() -> None:
            nonlocal engine_gone
            if not stop.is_set():
                logger.error("the engine's process has gone: API process %d exits", os.getpid())
                engine_gone = True
                nursery.cancel_scope.cancel()

        async def carry(engine: RemoteEngine, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await engine.run(stream, reader, task_status=task_status)
            except LinkClosed:
                on_engine_gone()

        try:
            engine = RemoteEngine(await RemoteEngine.handshake(reader))
        except LinkClosed:
            on_engine_gone()
        else:
            # The link carried first: a request the app takes once the engine is set can be sent at once.
            await nursery.start(carry, engine)
            gc.collect()
            gc.freeze()  # the tokenizer's tables, as the engine's process does at start
            pending.set(engine)
    return 1 if engine_gone else 0


def _remote_responses(engine: EngineHandle) -> RemoteResponses:
    assert isinstance(engine, RemoteEngine)
    return RemoteResponses(engine)


async def _stop_on_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _signum in signals:
            stop.set()
            return


if __name__ == "__main__":
    main(sys.argv[1:])
