"""The warmer actor alone."""

from __future__ import annotations

import trio

from mlxcel.actors.messages import ReplyFinished, WarmerMsg
from mlxcel.actors.warmer import WarmerActor


async def test_counts_finished_replies_and_exits_when_its_inbox_closes() -> None:
    send, inbox = trio.open_memory_channel[WarmerMsg](8)
    actor = WarmerActor(inbox=inbox)
    assert actor.statistics() == {"num_replies_seen": 0}
    with trio.fail_after(2):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            with send:
                for turn in range(3):
                    await send.send(ReplyFinished(session_key="alice", prompt_tokens=10 + turn, completion_tokens=5))
            # Leaving the nursery means run() returned on its own.
    assert actor.statistics() == {"num_replies_seen": 3}
