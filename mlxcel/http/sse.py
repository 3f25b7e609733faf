"""Server-sent events: the one encoder every streaming route writes with."""

from __future__ import annotations

import json
from typing import Any

# OpenAI's end of a chat or completions stream.
DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MIMETYPE = "text/event-stream"


def encode(data: Any, event: str | None = None) -> bytes:
    """One event: ``data`` as JSON, named ``event`` when the dialect names its events (Anthropic, Responses)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()
