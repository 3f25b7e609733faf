"""The KV event publisher: the store's block changes as vLLM's ZeroMQ KV event stream.

Fed by the cache-store actor (one ``PublishBlockChanges`` a message that
changed blocks), it encodes each into one msgpack ``KVEventBatch`` and sends
it on a PUB socket as the three frames vLLM's ``ZmqEventPublisher`` sends:
``[topic, seq (8-byte big-endian), payload]``. Sequence numbers start at 0
and have no gaps; batch 0 is an ``AllBlocksCleared`` (a router that saw an
earlier life of this server forgets it). The last ``buffer_steps`` batches
are kept for the optional ROUTER replay socket: a request
``[identity, b"", start_seq]`` is answered with ``[identity, b"", seq,
payload]`` for each kept batch from start_seq on, then ``[identity, b"",
-1, b""]``.

The sockets live on the Trio thread and are only used without blocking;
nothing here touches the device thread. The module imports ``zmq``, so the
engine imports it only when events are on.
"""

from __future__ import annotations

import collections
import logging
import time

import trio
import zmq

from mlxcel.actors.messages import KvEventsMsg, KvEventsStats, PublishBlockChanges
from mlxcel.cache.kv_events import BlockChange, BlocksCleared, EventFormat, KvEventEncoder
from mlxcel.config import KvEventsConfig, zmq_binds

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How often the replay socket is polled: replay is rare and not latency-critical.
REPLAY_POLL_SECONDS = 0.02
# vLLM's default high-water mark: a PUB socket drops (for that subscriber) past it.
PUB_HWM = 100_000


def binds(endpoint: str) -> bool:
    """vLLM's rule (bind a wildcard or local-transport address, connect to any other), loopback bound too."""
    return zmq_binds(endpoint)


class KvEventPublisherActor:
    def __init__(self, *, config: KvEventsConfig, block_size: int,
                 inbox: trio.MemoryReceiveChannel[KvEventsMsg]) -> None:
        if config.endpoint is None:
            raise ValueError("the KV event publisher needs an endpoint")
        self._config = config
        form: EventFormat = "map" if config.format == "map" else "positional"
        self._encoder = KvEventEncoder(block_size=block_size, form=form)
        self.inbox = inbox
        self._topic = config.topic.encode("utf-8")
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._num_events = 0
        self._num_replays = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        context = zmq.Context()
        try:
            publisher = context.socket(zmq.PUB)
            publisher.setsockopt(zmq.SNDHWM, PUB_HWM)
            endpoint = self._config.endpoint
            assert endpoint is not None
            (publisher.bind if binds(endpoint) else publisher.connect)(endpoint)
            replay = None
            if self._config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self._config.replay_endpoint)
            logger.info("publishing KV events on %s (topic %r, %s events)%s", endpoint, self._config.topic,
                        self._config.format,
                        f", replay on {self._config.replay_endpoint}" if replay is not None else "")
            self._publish(publisher, [BlocksCleared()])
            with self.inbox:
                async with trio.open_nursery() as nursery:
                    if replay is not None:
                        nursery.start_soon(self._serve_replay, replay)
                    task_status.started()
                    async for message in self.inbox:
                        match message:
                            case PublishBlockChanges():
                                self._publish(publisher, message.changes)
                    nursery.cancel_scope.cancel()
        finally:
            context.destroy(linger=0)

    def statistics(self) -> KvEventsStats:
        return KvEventsStats(num_batches=self._next_seq, num_events=self._num_events, num_replays=self._num_replays)

    def _publish(self, publisher: zmq.Socket[bytes], changes: tuple[BlockChange, ...] | list[BlockChange]) -> None:
        # Wall-clock time, as vLLM stamps its batches: consumers compare it across hosts.
        payload = self._encoder.batch(time.time(), changes)
        seq = self._next_seq
        self._next_seq += 1
        self._num_events += len(changes)
        # A PUB socket never blocks: past the high-water mark it drops for that subscriber,
        # who sees the gap in seq and asks the replay socket.
        publisher.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))

    async def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                await trio.sleep(REPLAY_POLL_SECONDS)
                continue
            if len(frames) != 3:
                logger.warning("ignored a KV event replay request of %d frames (expected 3)", len(frames))
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self._num_replays += 1
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client_id, b"", END_SEQ, b""))
            await trio.lowlevel.checkpoint()
