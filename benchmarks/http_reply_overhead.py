"""The HTTP edge's own cost per streamed or whole reply, with the engine scripted (no model).

A ``FakeEngine`` replies with N one-token deltas; a real hypercorn serves it on
loopback and httpx reads each route's reply whole and streamed, best of five.
What it measures is the app (parsing, the reply builders, SSE encoding), not
generation. Compare two trees in one run (issue 32: the dialect modules):

    PYTHONPATH=. python3 -m benchmarks.http_reply_overhead --deltas 2000
    git archive <commit> mlxcel tests | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python3 benchmarks/http_reply_overhead.py --deltas 2000
"""

from __future__ import annotations

import argparse
import time

import httpx
import trio

from mlxcel.http import serve
from mlxcel.types import Delta
from tests.fakes import FAKE_MODEL_ID, FakeEngine, finish

ROUTES = {
    "/v1/chat/completions": {"model": FAKE_MODEL_ID, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages": {"model": FAKE_MODEL_ID, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": FAKE_MODEL_ID, "input": "hi"},
}


async def start_server(nursery: trio.Nursery, engine: FakeEngine) -> str:
    try:
        from mlxcel.config import ServerConfig

        (url,) = await nursery.start(serve, engine, ServerConfig(host="127.0.0.1", port=0))
    except TypeError:  # a tree from before serve() took the config object
        (url,) = await nursery.start(serve, engine, "127.0.0.1", 0)
    return str(url)


async def main(num_deltas: int, repeats: int) -> None:
    engine = FakeEngine([Delta(text="x", token_ids=(120,)) for _ in range(num_deltas)] + [finish("stop")])
    async with trio.open_nursery() as nursery:
        url = await start_server(nursery, engine)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for path, body in ROUTES.items():
                for stream in (False, True):
                    best = float("inf")
                    for _ in range(repeats):
                        started = time.perf_counter()
                        response = await client.post(path, json={**body, "stream": stream})
                        response.raise_for_status()
                        best = min(best, time.perf_counter() - started)
                    print(f"{path:24s} stream={stream!s:5s} {1e6 * best / num_deltas:7.1f} us/delta")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deltas", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    arguments = parser.parse_args()
    trio.run(main, arguments.deltas, arguments.repeats)
