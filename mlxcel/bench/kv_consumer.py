"""A KV event consumer written from vLLM's published schema, as a router would read the stream.

``KvEventLog`` decodes ``KVEventBatch`` payloads with msgpack (either event
encoding: tagged arrays or tagged maps) and checks what a router relies on:
sequence numbers without gaps, every ``BlockStored`` in prefix order (its
parent announced and still held), removals of held blocks only, and the
block contents. It keys blocks the way a router does, by recomputing its
own chain over ``token_ids`` (mlxcel's ids are opaque), so a later prompt can
be checked against what was announced before it hit. ``KvEventSubscriber``
feeds one from a real SUB socket on a thread, and asks the replay socket.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import msgpack

ROOT_KEY = b"consumer-root"


def block_keys(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_KEY) -> list[bytes]:
    """The consumer's own chain over whole blocks of token_ids."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        parent = hashlib.blake2b(parent + struct.pack(f"<{block_size}i", *block), digest_size=16).digest()
        keys.append(parent)
    return keys


def decode_event(raw: Any) -> dict[str, Any]:
    """One event, positional (``["BlockStored", hashes, ...]``) or map (``{"type": ...}``), as a dict."""
    if isinstance(raw, dict):
        return dict(raw)
    kind, *fields = raw
    names = {
        "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                        "kv_cache_spec_sliding_window"),
        "BlockRemoved": ("block_hashes", "medium", "group_idx"),
        "AllBlocksCleared": (),
    }[kind]
    if len(fields) > len(names):
        raise ValueError(f"{kind} has {len(fields)} fields, the schema {len(names)}")
    return {"type": kind, **dict(zip(names, fields, strict=False))}


@attrs.define
class KvEventLog:
    """What one replica's stream announced, and every way it broke the contract."""

    block_size: int
    # block id -> the consumer's key of that block (the blocks held now).
    held: dict[int, bytes] = attrs.Factory(dict)
    # consumer key -> when it was first announced (time.time()), kept after removal.
    announced_at: dict[bytes, float] = attrs.Factory(dict)
    seqs: list[int] = attrs.Factory(list)
    counts: dict[str, int] = attrs.Factory(lambda: {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0,
                                                     "blocks_stored": 0, "blocks_removed": 0})
    problems: list[str] = attrs.Factory(list)
    events: list[dict[str, Any]] = attrs.Factory(list)

    def feed(self, seq: int, payload: bytes, received_at: float | None = None) -> None:
        received_at = time.time() if received_at is None else received_at
        if self.seqs and seq != self.seqs[-1] + 1:
            self.problems.append(f"sequence gap: {self.seqs[-1]} then {seq}")
        self.seqs.append(seq)
        batch = msgpack.unpackb(payload)
        if isinstance(batch, dict):  # vLLM main encodes the envelope as a map too
            batch = [batch["ts"], batch["events"], batch.get("data_parallel_rank")]
        _ts, events, _rank = (list(batch) + [None])[:3]
        for raw in events:
            self._apply(decode_event(raw), received_at)

    def _apply(self, event: dict[str, Any], received_at: float) -> None:
        kind = event["type"]
        self.counts[kind] += 1
        self.events.append(event)
        if kind == "AllBlocksCleared":
            self.held.clear()
            return
        if kind == "BlockRemoved":
            for block_id in event["block_hashes"]:
                if self.held.pop(block_id, None) is None:
                    self.problems.append(f"removed block {block_id:#x} that was not held")
                self.counts["blocks_removed"] += 1
            return
        hashes, tokens = event["block_hashes"], event["token_ids"]
        if event["block_size"] != self.block_size or len(tokens) != len(hashes) * self.block_size:
            self.problems.append(f"BlockStored of {len(hashes)} blocks carries {len(tokens)} tokens")
            return
        parent_id = event["parent_block_hash"]
        if parent_id is None:
            parent_key = ROOT_KEY
        elif parent_id in self.held:
            parent_key = self.held[parent_id]
        else:
            # A router drops such blocks: it cannot place them in any prefix.
            self.problems.append(f"BlockStored whose parent {parent_id:#x} is not held")
            return
        keys = block_keys(tokens, self.block_size, parent_key)
        for block_id, key in zip(hashes, keys, strict=True):
            self.held[block_id] = key
            self.announced_at.setdefault(key, received_at)
        self.counts["blocks_stored"] += len(hashes)

    def announced_before(self, token_ids: Sequence[int], num_cached: int, at: float) -> bool:
        """Whether every whole block of the first num_cached prompt tokens was announced before ``at``."""
        keys = block_keys(token_ids[: (num_cached // self.block_size) * self.block_size], self.block_size)
        return all(self.announced_at.get(key, float("inf")) <= at for key in keys)


class KvEventSubscriber:
    """A SUB socket on a thread feeding a ``KvEventLog``; ``replay`` asks the ROUTER socket."""

    def __init__(self, endpoint: str, *, block_size: int, topic: str = "", replay_endpoint: str | None = None) -> None:
        import zmq

        self.log = KvEventLog(block_size=block_size)
        self._zmq = zmq
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._socket.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self._socket, self._zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            _topic, seq_bytes, payload = self._socket.recv_multipart()
            with self._lock:
                self.log.feed(int.from_bytes(seq_bytes, "big"), payload)

    def replay(self, start_seq: int, timeout_s: float = 5.0) -> list[tuple[int, bytes]]:
        """The batches the publisher still holds from start_seq on (vLLM's replay protocol).

        A DEALER sends the REQ-style envelope (an empty frame, then the 8-byte
        start), since the ROUTER streams several replies to one request.
        """
        assert self._replay_endpoint is not None
        zmq = self._zmq
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        dealer.connect(self._replay_endpoint)
        batches: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            while True:
                _empty, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    return batches
                batches.append((seq, payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> KvEventSubscriber:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
