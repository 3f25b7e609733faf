"""Serve an Engine over HTTP with hypercorn's Trio worker, inside the caller's nursery."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from mlxcel.engine import Engine
from mlxcel.http.app import create_app
from mlxcel.http.guards import trusted_hosts_for
from mlxcel.http.validation import Limits

logger = logging.getLogger(__name__)


async def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    metrics: bool = False,
    max_body_bytes: int = 16 << 20,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout: float = 5.0,
    access_log: bool = False,
    limits: Limits | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run until ``shutdown_trigger`` returns or the task is cancelled.

    After the trigger, hypercorn stops accepting and gives open requests
    ``graceful_timeout`` seconds to finish before it cancels them.

    ``task_status.started`` receives the bound addresses, e.g. ``["http://127.0.0.1:8080"]``
    (port 0 picks a free port).
    """
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = graceful_timeout
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    app = create_app(
        engine, max_body_bytes=max_body_bytes, metrics=metrics, api_key=api_key, admin_api_key=admin_api_key,
        trusted_hosts=trusted_hosts_for(host), access_log=access_log, limits=limits,
    )
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
