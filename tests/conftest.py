"""Suite-wide set-up: offline hub, optimized BLAS, fixture model folders, engines, HTTP."""

from __future__ import annotations

import os

# Tests never reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mlxcel import blas  # noqa: E402

# Bind MLX to OpenBLAS before anything imports MLX: the fixtures' 151k-row
# embedding matmuls are ~40x faster than on the bundled reference BLAS.
blas.load_optimized_blas_in_process()

import re  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import trio  # noqa: E402

from mlxcel.engine import Engine, run_engine  # noqa: E402
from tests.support import make_engine_config  # noqa: E402

# A module marked slow as a whole; the fast lane does not even import it.
SLOW_MODULE = re.compile(r"^pytestmark = pytest\.mark\.slow$", re.MULTILINE)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast", action="store_true",
        help="only the tests not marked slow (-m 'not slow'): no model is loaded (./scripts/test --fast)",
    )
    parser.addoption(
        "--via-link", action="store_true",
        help="start_server serves a real engine through the engine link (in memory), as an API process does",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("fast"):
        given = config.option.markexpr
        config.option.markexpr = f"({given}) and not slow" if given else "not slow"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("fast") and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return bool(SLOW_MODULE.search(collection_path.read_text())) or None
    return None


@pytest.fixture
def start_engine(nursery: trio.Nursery) -> Callable[..., Any]:
    """``await start_engine(family, **config_changes)`` -> a running Engine in this test's nursery."""

    async def start(family: str = "llama", **changes: Any) -> Engine:
        return await nursery.start(run_engine, make_engine_config(family, **changes))

    return start


@pytest.fixture
def start_server(nursery: trio.Nursery, request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``await start_server(engine, **settings)`` -> base URL of a real hypercorn on loopback.

    ``settings`` are `ServerConfig` fields (host and port: loopback, a free port). With ``--via-link``, a
    real engine is served through the engine link (``tests.support.linked_engine``), as an API process
    serves it.
    """
    from mlxcel.config import ServerConfig
    from mlxcel.http import serve
    from tests.support import linked_engine

    async def start(engine: Engine, **settings: Any) -> str:
        config = ServerConfig(**{"host": "127.0.0.1", "port": 0, **settings})
        responses_for = None
        if request.config.getoption("via_link") and type(engine) is Engine:
            from mlxcel.http.engine_link import RemoteResponses
            from mlxcel.http.responses import ResponseStore

            kept = ResponseStore(max_entries=config.responses_store_entries, max_bytes=config.responses_store_bytes)
            remote, _, _ = await linked_engine(nursery, engine, kept)
            engine, responses_for = remote, lambda _engine: RemoteResponses(remote)
        binds = await nursery.start(partial(serve, engine, config, responses_for=responses_for))
        return binds[0]

    return start


@pytest.fixture(autouse=True)
def models_only_in_slow_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test without the ``slow`` mark that loads a model fails, naming the mark it needs.

    ``./scripts/test --fast`` runs the tests without the mark; this keeps that lane
    model-free as tests are added, in every run (CI's too), without a list to maintain.
    """
    if request.node.get_closest_marker("slow") is not None:
        return
    from mlxcel.model import loader

    def refuse(path: object) -> None:
        raise RuntimeError(
            f"{request.node.nodeid} loads a model ({path}): mark it (or its module) @pytest.mark.slow, "
            "which keeps it out of ./scripts/test --fast"
        )

    monkeypatch.setattr(loader, "load_model", refuse)


@pytest.fixture(autouse=True)
def close_sdk_clients(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every sync official-SDK client a test makes is closed when the test ends.

    Tests make `openai.OpenAI(...)` and `anthropic.Anthropic(...)` clients inline; left
    open, their pooled sockets are closed by the garbage collector in whatever test runs
    then, and the suite turns that ResourceWarning into a failure of an unrelated test.
    (The async clients are used with `async with`, which closes them.)
    """
    import anthropic
    import openai

    created: list[Any] = []
    for client_class in (openai.OpenAI, anthropic.Anthropic):
        original = client_class.__init__

        def init(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            __original(self, *args, **kwargs)
            created.append(self)

        monkeypatch.setattr(client_class, "__init__", init)
    yield
    for client in created:
        client.close()
