"""Automatic prefix caching: block hash chains over token sequences.

Block n's hash covers its parent's hash, so equal hashes at block n mean the
whole sequence up to the end of block n is equal (and under the same
multimodal digest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import blake3

from mlxcel.cache.key import pack_tokens

ROOT_SEED = b"mlxcel:apc:root:v1"
HashAlgorithm = Literal["sha256", "blake3"]
ALGORITHMS: tuple[HashAlgorithm, ...] = ("sha256", "blake3")


class BlockHasher:
    """Computes block hash chains with one algorithm and block size."""

    def __init__(self, algorithm: HashAlgorithm = "sha256", block_size: int = 16) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown APC hash {algorithm!r}; use one of {ALGORITHMS}")
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.algorithm = algorithm
        self.block_size = block_size
        self._new = hashlib.sha256 if algorithm == "sha256" else blake3.blake3
        self.root = self._new(ROOT_SEED).digest()

    def full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size

    def chain(
        self, tokens: Sequence[int], mm_digest: bytes, num_blocks: int | None = None
    ) -> list[bytes]:
        """Hashes of the first num_blocks full blocks (all full blocks when None)."""
        return self.extend(None, tokens, mm_digest, num_blocks)

    def extend(
        self,
        prefix: Sequence[bytes] | None,
        tokens: Sequence[int],
        mm_digest: bytes,
        num_blocks: int | None = None,
    ) -> list[bytes]:
        """A chain for tokens that starts with the already known hashes in prefix.

        prefix must be the chain of the same tokens and mm_digest (or a
        prefix of it); only the blocks after it are hashed.
        """
        start = len(prefix) if prefix else 0
        size = self.block_size
        available = len(tokens) // size
        end = available if num_blocks is None else max(0, min(num_blocks, available))
        packed = pack_tokens(tokens[start * size : max(start, end) * size])
        return self._extend(prefix, packed, start, mm_digest, end)

    def extend_packed(
        self,
        prefix: Sequence[bytes] | None,
        token_bytes: bytes,
        mm_digest: bytes,
        num_blocks: int | None = None,
    ) -> list[bytes]:
        """`extend` for tokens already packed with `key.pack_tokens`."""
        start = len(prefix) if prefix else 0
        width = 4 * self.block_size
        available = len(token_bytes) // width
        end = available if num_blocks is None else max(0, min(num_blocks, available))
        packed = token_bytes[start * width : max(start, end) * width]
        return self._extend(prefix, packed, start, mm_digest, end)

    def _extend(
        self,
        prefix: Sequence[bytes] | None,
        packed: bytes,
        start: int,
        mm_digest: bytes,
        end: int,
    ) -> list[bytes]:
        # packed holds the tokens of blocks start..end, nothing more.
        result = list(prefix or ())
        if start >= end:
            del result[end:]
            return result
        view = memoryview(packed)
        width = 4 * self.block_size
        parent = result[-1] if result else self.root
        new = self._new
        append = result.append
        for offset in range(0, len(view), width):
            hasher = new(parent)
            hasher.update(view[offset : offset + width])
            hasher.update(mm_digest)
            parent = hasher.digest()
            append(parent)
        return result


def agreeing_blocks(chain_a: Sequence[bytes], chain_b: Sequence[bytes]) -> int:
    """How many leading blocks two chains have in common."""
    shared = min(len(chain_a), len(chain_b))
    # Lockstep in C first: the common case is agreement up to the shorter end.
    if list(chain_a[:shared]) == list(chain_b[:shared]):
        return shared
    count = 0
    for hash_a, hash_b in zip(chain_a, chain_b, strict=False):
        if hash_a != hash_b:
            break
        count += 1
    return count
