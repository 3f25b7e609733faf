"""The warmer actor: prepares a session's next turn in the background.

For snapshot families, after a reply finishes it renders the conversation
as the next turn will begin (history plus this reply) and asks the scheduler
to extend the session's snapshot to cover it. The scheduler runs such
warm-ups only when no foreground request is waiting or running, and drops
one the moment a request arrives, so warming never delays anyone.
"""

from __future__ import annotations

import logging

import trio

from mlxcel.actors.messages import ReplyFinished, WarmerMsg, WarmerStats, WarmSession
from mlxcel.errors import InvalidRequest
from mlxcel.model.prompt import PromptRenderer

logger = logging.getLogger(__name__)


class WarmerActor:
    def __init__(
        self,
        *,
        inbox: trio.MemoryReceiveChannel[WarmerMsg],
        renderer: PromptRenderer | None = None,
        to_scheduler: trio.MemorySendChannel[WarmSession] | None = None,
    ) -> None:
        self.inbox = inbox
        # None: nothing to warm (dense families, or warm-up turned off).
        self._renderer = renderer
        self._to_scheduler = to_scheduler
        self._num_replies_seen = 0
        self._num_warmups_requested = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox:
            task_status.started()
            async for message in self.inbox:
                match message:
                    case ReplyFinished():
                        self._num_replies_seen += 1
                        await self._warm(message)

    async def _warm(self, message: ReplyFinished) -> None:
        if self._renderer is None or self._to_scheduler is None or message.chat is None:
            return
        try:
            tokens = await trio.to_thread.run_sync(
                self._renderer.next_turn_history, message.chat, message.reply_text
            )
        except InvalidRequest:
            return  # the template cannot render this history; nothing to warm
        try:
            self._to_scheduler.send_nowait(WarmSession(context=message.context, tokens=tokens))
            self._num_warmups_requested += 1
        except trio.WouldBlock:
            logger.debug("warm-up for session %s dropped: the scheduler is busy", message.context.session_key)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def statistics(self) -> WarmerStats:
        return WarmerStats(num_replies_seen=self._num_replies_seen, num_warmups_requested=self._num_warmups_requested)
