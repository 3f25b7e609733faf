"""The warmer actor alone, with a fake renderer and a hand-built scheduler channel."""

from __future__ import annotations

import trio

from mlxcel.actors.messages import ReplyFinished, WarmerMsg, WarmerStats, WarmSession
from mlxcel.actors.warmer import WarmerActor
from mlxcel.cache.key import CacheContext
from mlxcel.types import ChatRequest

CONTEXT = CacheContext(model_id="m", template_sig="sig", session_key="alice")


class FakeRenderer:
    def next_turn_history(self, chat: ChatRequest, reply_text: str) -> tuple[int, ...]:
        return tuple(len(message["content"]) for message in chat.messages) + (len(reply_text),)


def finished(chat: ChatRequest | None, reply: str = "reply") -> ReplyFinished:
    return ReplyFinished(context=CONTEXT, chat=chat, reply_text=reply, prompt_tokens=10, completion_tokens=5)


async def test_asks_the_scheduler_to_warm_the_next_turn_and_exits_when_its_inbox_closes() -> None:
    send, inbox = trio.open_memory_channel[WarmerMsg](8)
    to_scheduler, warmups = trio.open_memory_channel[WarmSession](8)
    actor = WarmerActor(inbox=inbox, renderer=FakeRenderer(), to_scheduler=to_scheduler)
    chat = ChatRequest(messages=({"role": "user", "content": "hello"},))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            with send:
                await send.send(finished(chat, "four"))
                await send.send(finished(None))  # a raw completion: nothing to render
    assert warmups.receive_nowait() == WarmSession(context=CONTEXT, tokens=(5, 4))
    assert actor.statistics() == WarmerStats(num_replies_seen=2, num_warmups_requested=1)


async def test_without_a_renderer_it_only_counts() -> None:
    send, inbox = trio.open_memory_channel[WarmerMsg](8)
    actor = WarmerActor(inbox=inbox)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            with send:
                await send.send(finished(ChatRequest(messages=({"role": "user", "content": "x"},))))
    assert actor.statistics() == WarmerStats(num_replies_seen=1, num_warmups_requested=0)
