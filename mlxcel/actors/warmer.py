"""The warmer actor: prepares a session's next turn in the background.

For dense-KV families the prefix store already serves the next turn (APC
matches the re-rendered history), so there is nothing to warm; the snapshot
families (issue 5) will extend their boundary snapshot here. Until then the
actor counts what it was told, so the message path is exercised.
"""

from __future__ import annotations

import trio

from mlxcel.actors.messages import ReplyFinished, WarmerMsg


class WarmerActor:
    def __init__(self, *, inbox: trio.MemoryReceiveChannel[WarmerMsg]) -> None:
        self.inbox = inbox
        self._num_replies_seen = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox:
            task_status.started()
            async for message in self.inbox:
                match message:
                    case ReplyFinished():
                        self._num_replies_seen += 1

    def statistics(self) -> dict[str, int]:
        return {"num_replies_seen": self._num_replies_seen}
