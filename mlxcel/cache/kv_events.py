"""KV cache events in vLLM's wire schema, from the prompt-prefix store's block changes.

The store logs what happened to its APC blocks (``BlocksStored``,
``BlocksRemoved``, ``BlocksCleared``); ``KvEventEncoder`` turns a run of
those into one msgpack ``KVEventBatch`` as ``vllm/distributed/kv_events.py``
defines it: ``[ts, [events...], data_parallel_rank]``, each event a tagged
array (``positional``, vLLM until mid-2026) or a tagged map (``map``).
Pure: no sockets, no Trio; docs/scaling.md describes the fields.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import attrs
import msgpack

from mlxcel.cache.key import CacheContext

EventFormat = Literal["positional", "map"]
# vLLM's MEDIUM_GPU: the tier routers weigh first.
MEDIUM_GPU = "GPU"
_U64_MASK = (1 << 64) - 1


@attrs.frozen(kw_only=True)
class BlocksStored:
    """Blocks the store did not hold before one insert: the tail of that entry's chain."""

    context: CacheContext
    # The hash of the block before the first new one; None when the first new one is block 0.
    parent: bytes | None
    hashes: tuple[bytes, ...]
    # Index in the chain of the first new block (block 0 carries the salt's extra key).
    first_index: int
    # The new blocks' tokens, packed as ``key.pack_tokens`` does.
    token_bytes: bytes = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class BlocksRemoved:
    """Blocks no entry holds any more (evicted, expired, shed)."""

    hashes: tuple[bytes, ...]


@attrs.frozen(kw_only=True)
class BlocksCleared:
    """Every block went at once (a reset, or the start of the stream)."""


BlockChange = BlocksStored | BlocksRemoved | BlocksCleared


def external_block_hash(block_hash: bytes) -> int:
    """The 64-bit id routers read, as vLLM's ``maybe_convert_block_hash`` makes it (low 8 bytes, big-endian)."""
    return int.from_bytes(block_hash, "big") & _U64_MASK


class KvEventEncoder:
    """Block changes to msgpack ``KVEventBatch`` payloads, in one of vLLM's two event encodings."""

    def __init__(self, *, block_size: int, form: EventFormat = "positional", data_parallel_rank: int = 0) -> None:
        if form not in ("positional", "map"):
            raise ValueError(f"unknown KV event format {form!r}")
        self.block_size = block_size
        self.form = form
        self.data_parallel_rank = data_parallel_rank
        self._packer = msgpack.Packer()

    def events(self, changes: Iterable[BlockChange]) -> list[Any]:
        return [self._event(change) for change in changes]

    def batch(self, ts: float, changes: Sequence[BlockChange]) -> bytes:
        """One ``KVEventBatch``: the envelope is positional in both encodings, as in vLLM."""
        return self._packer.pack([ts, self.events(changes), self.data_parallel_rank])

    def _event(self, change: BlockChange) -> Any:
        match change:
            case BlocksStored():
                return self._stored(change)
            case BlocksRemoved():
                hashes = [external_block_hash(block_hash) for block_hash in change.hashes]
                if self.form == "positional":
                    return ["BlockRemoved", hashes, MEDIUM_GPU]
                return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM_GPU}
            case BlocksCleared():
                return ["AllBlocksCleared"] if self.form == "positional" else {"type": "AllBlocksCleared"}
        raise TypeError(f"not a block change: {change!r}")

    def _stored(self, change: BlocksStored) -> Any:
        token_ids = list(struct.unpack(f"<{len(change.token_bytes) // 4}i", change.token_bytes))
        hashes = [external_block_hash(block_hash) for block_hash in change.hashes]
        parent = None if change.parent is None else external_block_hash(change.parent)
        lora_name = change.context.lora_id or None
        extra_keys = block_extra_keys(change.context, change.first_index, len(hashes))
        if self.form == "positional":
            # vLLM's field order; lora_id (an int there) has no counterpart here, and a None
            # extra_keys is left off the end as msgspec's omit_defaults does.
            event: list[Any] = ["BlockStored", hashes, parent, token_ids, self.block_size, None, MEDIUM_GPU,
                                lora_name]
            if extra_keys is not None:
                event.append(extra_keys)
            return event
        mapped: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
            "block_size": self.block_size, "lora_id": None, "medium": MEDIUM_GPU, "lora_name": lora_name,
        }
        if extra_keys is not None:
            mapped["extra_keys"] = extra_keys
        return mapped


def block_extra_keys(context: CacheContext, first_index: int, num_blocks: int) -> list[list[str] | None] | None:
    """vLLM's per-block ``extra_keys``: the salt on block 0, the multimodal digest on every block.

    None (left off) when neither applies. The digest is on every block because
    mlxcel mixes it into every block's hash, not just those an image spans.
    """
    if not context.cache_salt and not context.is_multimodal:
        return None
    keys: list[list[str] | None] = []
    for index in range(first_index, first_index + num_blocks):
        key: list[str] = []
        if context.is_multimodal:
            key.append(context.mm_digest.hex())
        if index == 0 and context.cache_salt:
            key.append(context.cache_salt)
        keys.append(key or None)
    return keys
