"""Server-sent events: the one encoder every streaming route writes with."""

from __future__ import annotations

import json
from typing import Any

import orjson

# OpenAI's end of a chat or completions stream.
DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MIMETYPE = "text/event-stream"


def encode(data: Any, event: str | None = None) -> bytes:
    """One event: ``data`` as JSON, named ``event`` when the dialect names its events (Anthropic, Responses).

    orjson encodes a streamed chunk about 10x faster than ``json`` (12 -> 1.3 us on the 2-core box), and a
    streamed token is one event, on the thread that shares the GIL with the device. What orjson refuses (a
    type it does not know, a key that is not a string) goes through ``json`` as before.
    """
    try:
        payload = orjson.dumps(data)
    except TypeError:
        payload = json.dumps(data).encode()
    if event is None:
        return b"data: " + payload + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + payload + b"\n\n"
