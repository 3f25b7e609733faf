"""The one driver of a generated reply: whole (one JSON body) or streamed (server-sent events).

Each dialect has one ``ReplyBuilder`` that turns deltas into its events and
keeps what the whole reply is made of, so the whole reply and the stream are
built by the same code and cannot disagree (the Responses ``OutputBuilder``
was the first). A reply that ends without a finish is a fault of the server:
logged, then an error in the dialect's shape (a 500 body, or its stream's
error event).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from mlxcel.engine import DeltaStream
from mlxcel.errors import InternalError, MlxcelError
from mlxcel.http import sse
from mlxcel.types import Delta

logger = logging.getLogger(__name__)

Event = dict[str, Any]


class ReplyBuilder(Protocol):
    """One reply in one dialect: every method returns the stream events of what it was given."""

    # Events named by their `type` (Anthropic, Responses); OpenAI's chunks are unnamed.
    named_events: bool
    # What ends the stream after its last event (OpenAI's `data: [DONE]`).
    done: bytes

    def start(self, first: Delta) -> list[Event]: ...

    def feed(self, delta: Delta) -> list[Event]: ...

    def finish(self, last: Delta) -> list[Event]:
        """The last delta (the one with the finish reason and the usage)."""
        ...

    def fail(self, error: MlxcelError) -> list[Event]:
        """The reply broke off while generating."""
        ...

    def body(self) -> dict[str, Any]:
        """The whole reply, once ``finish`` has run."""
        ...


async def next_delta(deltas: DeltaStream) -> Delta:
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        logger.error("the reply of %s ended without a finish", getattr(deltas, "request_id", "a request"))
        raise InternalError("the reply ended without a finish") from None


async def collect(deltas: DeltaStream, first: Delta, builder: ReplyBuilder) -> dict[str, Any]:
    """The whole reply's body; an error while generating is raised (the route answers it)."""
    async with deltas:
        delta = first
        while delta.finish_reason is None:
            builder.feed(delta)
            delta = await next_delta(deltas)
        builder.finish(delta)
    return builder.body()


def encode(builder: ReplyBuilder, events: list[Event]) -> bytes:
    # The events of one delta go out as one chunk: one write, not one per event.
    return b"".join(sse.encode(event, event["type"] if builder.named_events else None) for event in events)


async def stream(
    deltas: DeltaStream, first: Delta, builder: ReplyBuilder,
    on_finish: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[bytes]:
    """The reply as server-sent events. ``on_finish`` runs before the last event is sent (so a follow-up
    sent on seeing it finds what the finish stored); the deltas close when the stream ends or the client
    goes away (which cancels the request)."""
    async with deltas:
        opening = encode(builder, builder.start(first))
        if opening:
            yield opening
        delta = first
        try:
            while delta.finish_reason is None:
                chunk = encode(builder, builder.feed(delta))
                if chunk:
                    yield chunk
                delta = await next_delta(deltas)
            events = builder.finish(delta)
        except MlxcelError as error:
            events = builder.fail(error)
        else:
            if on_finish is not None:
                await on_finish()
        yield encode(builder, events)
    if builder.done:
        yield builder.done
