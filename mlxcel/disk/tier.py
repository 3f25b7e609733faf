"""The disk tier as the actors and the engine hold it: lookups, start-up, statistics, reset.

One ``DiskTier`` per process, over a directory that several processes may
share (``mlxcel.disk.directory``). No MLX, no Trio. Which thread runs what:

- the cache-store actor's Trio thread: ``probe``, ``plan_write``,
  ``record_retention``, ``probe_snapshot``, ``plan_snapshot`` (existence
  checks and hashing, here);
- the device thread: ``writer.submit`` (``mlxcel.disk.writer``, whose own
  thread writes) and ``reader.read_ahead`` (``mlxcel.disk.reader``, whose
  threads open and verify), from ``mlxcel.disk.device``;
- the engine's worker threads: ``open`` (with the model's fingerprint,
  ``open_disk_tier``), ``statistics`` and ``clear``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blake3

from mlxcel.cache.key import CacheContext
from mlxcel.disk import index as disk_index
from mlxcel.disk.directory import (
    FILE_MODE,
    Directory,
    DiskSettings,
    DiskStats,
    create_private,
    prepare_directory,
)
from mlxcel.disk.index import DiskPlan, IndexedFile, PieceSpec, SnapshotName
from mlxcel.disk.reader import DiskReader
from mlxcel.disk.writer import DiskWriter

logger = logging.getLogger(__name__)

# How stale the list of snapshot files may be when a lookup reads it.
_SNAPSHOT_LISTING_SECONDS = 1.0


class DiskTier:
    def __init__(self, settings: DiskSettings, model_fingerprint: str) -> None:
        self.settings = settings
        self.directory = settings.directory
        # What the tier's threads share: the counters, the listing, whether the directory is writable.
        self.shared = Directory(settings)
        self.writer = DiskWriter(self.shared)
        self.reader = DiskReader(self.shared)
        self._model = model_fingerprint
        self._hasher = disk_index.new_hasher()
        self._fingerprints: dict[tuple[Any, ...], str] = {}

    @property
    def writable(self) -> bool:
        return self.shared.writable

    # --- start and stop (the engine's worker thread; close: the device thread at its end) --------

    def open(self) -> None:
        """Index the directory (names and sizes only, no tensors), clean up after dead writers, log it."""
        try:
            prepare_directory(self.directory)
        except OSError as error:
            logger.error("prompt-cache disk tier: cannot create %s (%s); the disk tier is off",
                         self.directory, error.strerror or error)
            return
        self.shared.writable = self._probe_writable()
        files, temps_removed, foreign = self.shared.scan(clean=True)
        tightened = self._make_private(files) if self.writable else 0
        total = sum(item.nbytes for item in files)
        self.shared.set_size(files)
        logger.info(
            "prompt-cache disk tier at %s: %d pieces, %d bytes (budget %d bytes)%s%s%s%s",
            self.directory, len(files), total, self.settings.budget_bytes,
            f"; removed {temps_removed} temporary files of stopped writers" if temps_removed else "",
            f"; {tightened} files readable by other users made 0600" if tightened else "",
            f"; {foreign} other files left alone" if foreign else "",
            "" if self.writable else "; READ-ONLY (the directory is not writable): nothing will be written",
        )
        logger.warning("prompt-cache disk tier: %s holds prompts in the clear (their tokens, readable back "
                       "into text with the model's tokenizer): whoever can read it can read them", self.directory)
        if self.writable:
            with self.shared.locked():
                self.shared.enforce_budget()
            self.writer.start()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to timeout seconds), then stop the writer and reader threads."""
        self.reader.close()
        self.writer.stop(timeout)

    def _make_private(self, files: Sequence[IndexedFile]) -> int:
        """Files of an older version (written 0644) made readable by this user only; returns how many."""
        tightened = 0
        for item in files:
            path = self.directory / item.filename
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and info.st_mode & 0o077 and info.st_uid == os.geteuid():
                    os.chmod(path, FILE_MODE)
                    tightened += 1
        return tightened

    def _probe_writable(self) -> bool:
        probe = self.directory / disk_index.temp_name("probe", os.getpid(), secrets.token_hex(4))
        try:
            with create_private(probe) as file:
                file.write(b"\0")
            probe.unlink()
            return True
        except OSError:
            return False

    # --- lookups (the cache store's Trio thread) ---------------------------------------------

    def fingerprint(self, context: CacheContext) -> str:
        key = (context.bucket, context.rope_regime, context.mm_digest,
               context.session_key if self.settings.session_scoped else None)
        found = self._fingerprints.get(key)
        if found is None:
            if len(self._fingerprints) > 4096:
                self._fingerprints.clear()
            found = self._fingerprints[key] = disk_index.context_fingerprint(
                self._model, context, session_scoped=self.settings.session_scoped)
        return found

    def probe(self, context: CacheContext, tokens: Sequence[int], cap: int, memory_len: int) -> DiskPlan | None:
        """Whether disk holds more of tokens[:cap] than memory's memory_len; counts a miss when not."""
        block = disk_index.BLOCK_TOKENS
        cap_blocks = cap // block
        # Memory supplies the rows up to the last piece boundary it covers; disk the pieces after.
        start_block = (memory_len // disk_index.PIECE_TOKENS) * disk_index.PIECE_BLOCKS
        if cap_blocks * block < max(memory_len + block, self.settings.min_prefix, 1) or start_block >= cap_blocks:
            return None
        hashes: list[bytes] = []
        hasher = self._hasher

        def chain_up_to(num_blocks: int) -> list[bytes]:
            nonlocal hashes
            if len(hashes) < num_blocks:
                hashes = hasher.extend(hashes, tokens, context.mm_digest, num_blocks)
            return hashes

        try:
            run = disk_index.find_run(self.fingerprint(context), chain_up_to, hasher.root, start_block,
                                      cap_blocks, self.shared.exists)
        except OSError:
            run = []
        end = run[-1].name.end_token if run else 0
        if end < max(memory_len + block, self.settings.min_prefix):
            self.shared.count("misses")
            return None
        return DiskPlan(pieces=tuple(run), kept=start_block * block, num_tokens=end, memory_len=memory_len,
                        retain_seconds=self._retention_left(run[-1].name))

    def _retention_left(self, name: disk_index.PieceName) -> float:
        """Seconds left of a retention recorded for a prefix ending where this piece does (0: none)."""
        try:
            until = os.stat(self.shared.path / disk_index.pin_name(name.fingerprint, name.end_block,
                                                                 name.chain_hash)).st_mtime
        except OSError:
            return 0.0
        return max(0.0, until - time.time())

    def record_retention(self, context: CacheContext, tokens: Sequence[int], retain_seconds: float) -> None:
        """A retained prefix: the writer records until when, for a server that reads it back after a restart."""
        num_blocks = len(tokens) // disk_index.BLOCK_TOKENS
        if not self.writable or not self.writer.running or retain_seconds <= 0 or num_blocks == 0:
            return
        chain = self._hasher.chain(tokens[: num_blocks * disk_index.BLOCK_TOKENS], context.mm_digest)
        self.writer.record_pin(disk_index.pin_name(self.fingerprint(context), num_blocks, chain[-1]),
                               time.time() + retain_seconds)

    def plan_write(self, context: CacheContext, tokens: Sequence[int], prompt_len: int | None = None
                   ) -> tuple[PieceSpec, ...]:
        """The pieces of a stored prefix that are not on disk yet (and one ending at its prompt, when told)."""
        if not self.writable or len(tokens) < max(self.settings.min_prefix, disk_index.BLOCK_TOKENS):
            return ()
        chain = self._hasher.chain(tokens, context.mm_digest)
        prompt_blocks = prompt_len // disk_index.BLOCK_TOKENS if prompt_len else None
        pieces = disk_index.pieces_of(self.fingerprint(context), chain, self._hasher.root, prompt_blocks)
        try:
            return tuple(piece for piece in pieces if not self.shared.exists(piece.filename))
        except OSError:
            return ()

    # --- session snapshots (snapshot families) ------------------------------------------------

    def probe_snapshot(self, context: CacheContext, tokens: Sequence[int], memory_len: int
                       ) -> SnapshotName | None:
        """The longest snapshot on disk whose tokens begin tokens[:-1], if longer than memory's memory_len."""
        if time.monotonic() - self.shared.snapshots_listed > _SNAPSHOT_LISTING_SECONDS:
            self.shared.scan()  # other processes write snapshots too: a cheap listing at most once a second
        fingerprint = self.fingerprint(context)
        with self.shared.lock:
            lengths = sorted(self.shared.snapshot_lengths.get(fingerprint, ()), reverse=True)
        lengths = [length for length in lengths if memory_len < length <= len(tokens) - 1]
        if not lengths:
            return None
        chain = self._hasher.chain(tokens[: lengths[0]], context.mm_digest)
        for length in lengths:
            name = SnapshotName(fingerprint=fingerprint, num_tokens=length,
                                digest=disk_index.snapshot_digest(chain, self._hasher.root, tokens[:length]))
            if self.shared.exists(name.filename):
                return name
        self.shared.count("misses")
        return None

    def plan_snapshot(self, context: CacheContext, tokens: Sequence[int]) -> SnapshotName | None:
        """The name a stored snapshot of tokens takes on disk; None when it is there already (or not writable)."""
        if not self.writable or len(tokens) < max(self.settings.min_prefix, 1):
            return None
        chain = self._hasher.chain(tokens, context.mm_digest)
        name = SnapshotName(fingerprint=self.fingerprint(context), num_tokens=len(tokens),
                            digest=disk_index.snapshot_digest(chain, self._hasher.root, tokens))
        try:
            return None if self.shared.exists(name.filename) else name
        except OSError:
            return None

    def drop(self, count: int = 1) -> None:
        """Pieces planned but never handed on (the scheduler's inbox was full)."""
        self.writer.drop(count)

    # --- stats and reset (the engine, off the Trio thread) ----------------------------------------

    def clear(self) -> tuple[int, int]:
        """Delete every piece in the directory (any process's); returns files and bytes freed."""
        files, _removed, _foreign = self.shared.scan(clean=True)
        freed = freed_bytes = 0
        for item in files:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / item.filename)
                freed += 1
                freed_bytes += item.nbytes
        self.shared.set_size([])
        logger.info("prompt-cache disk tier: reset deleted %d pieces (%d bytes)", freed, freed_bytes)
        return freed, freed_bytes

    def statistics(self, *, rescan: bool = True) -> DiskStats:
        if rescan:
            files, _removed, _foreign = self.shared.scan()
            self.shared.set_size(files)
        return self.shared.statistics()


# The files whose bytes decide the tokens (read whole) and those that hold the weights (sampled).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
_SAMPLE_BYTES = 1 << 20


def _weights_identity(path: Path) -> bytes:
    """A weight file's size, its first and last MiB: a retrained or re-quantized file differs there.

    Reading gigabytes of weights at every start-up to hash them would cost more than the prefill saved.
    """
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(_SAMPLE_BYTES)
        file.seek(max(0, size - _SAMPLE_BYTES))
        tail = file.read(_SAMPLE_BYTES)
    return str(size).encode() + blake3.blake3(head).digest() + blake3.blake3(tail).digest()


def fingerprint_model(model_path: Path, adapter_paths: Sequence[Path] = (), extra: Sequence[str] = ()) -> str:
    """The model part of every piece's fingerprint: config (dtype included), tokenizer, weights, adapters."""
    parts: list[tuple[str, bytes]] = [(f"extra/{index}", text.encode()) for index, text in enumerate(extra)]
    for prefix, folder in (("model", model_path), *((f"adapter{index}", path) for index, path in
                                                    enumerate(adapter_paths))):
        folder = Path(folder)
        if folder.is_file():
            parts.append((f"{prefix}/{folder.name}", _weights_identity(folder)))
            continue
        for name in ("config.json", "adapter_config.json", *_TOKENIZER_FILES):
            candidate = folder / name
            if candidate.is_file():
                parts.append((f"{prefix}/{name}", candidate.read_bytes()))
        for candidate in sorted(folder.iterdir()):
            if candidate.is_file() and candidate.name.endswith(_WEIGHT_SUFFIXES):
                parts.append((f"{prefix}/weights/{candidate.name}", _weights_identity(candidate)))
    return disk_index.model_fingerprint(parts)


def open_disk_tier(settings: DiskSettings, model_path: Path, adapter_paths: Sequence[Path] = (),
                   extra: Sequence[str] = ()) -> DiskTier:
    """Fingerprint the model, index the directory (blocking: run it in a worker thread)."""
    started = time.perf_counter()
    tier = DiskTier(settings, fingerprint_model(model_path, adapter_paths, extra))
    tier.open()
    logger.debug("prompt-cache disk tier opened in %.1f ms", 1000 * (time.perf_counter() - started))
    return tier
