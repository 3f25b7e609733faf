"""The disk tier's reader threads: a disk hit's files opened, mapped and verified ahead of the device.

No MLX, no Trio. The device thread asks (``read_ahead``, ``read_snapshot``)
and uploads what comes back (``mlxcel.disk.device``); the reader threads (a
pool of ``READ_AHEAD``) open, memory-map and checksum the next pieces
meanwhile. A bad file is refused (logged, counted, deleted); a hit touches
its file's mtime, which is its last use for the LRU budget of every process.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

from mlxcel.disk import index as disk_index
from mlxcel.disk.directory import Directory, check_sum
from mlxcel.disk.index import PieceRefused, PieceSpec, SnapshotName, TensorEntry

logger = logging.getLogger(__name__)

# A verified piece: its metadata and each tensor with a view of its bytes in the mapped file.
PieceRead = tuple[dict[str, str], list[tuple[TensorEntry, memoryview]]]

# Pieces a disk hit's reader threads open and checksum ahead of the one the device uploads.
READ_AHEAD = 3


class DiskReader:
    def __init__(self, directory: Directory) -> None:
        self._directory = directory
        self._settings = directory.settings
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        with self._directory.lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def path(self, filename: str) -> Path:
        """Where a file of the directory is (the device reads a verified piece's tensors by it)."""
        return self._directory.path / filename

    def read(self, spec: PieceSpec, num_layers: int | None) -> PieceRead:
        """A piece's verified tensors, views of the mapped file. Raises PieceRefused (bad file) or
        FileNotFoundError (gone)."""
        view, metadata, tensors, data_start = self._directory.open_verified(spec.filename, self._max_bytes(spec))
        disk_index.check_piece(spec, metadata, tensors, num_layers, self._settings.kv_bits,
                               self._settings.kv_group_size)
        check_sum(metadata, view, data_start)
        with contextlib.suppress(OSError):
            os.utime(self._directory.path / spec.filename)  # its last use, for every process's LRU budget
        return metadata, [(entry, view[data_start + entry.start : data_start + entry.end]) for entry in tensors]

    def read_ahead(self, specs: Sequence[PieceSpec], num_layers: int | None
                   ) -> Generator[concurrent.futures.Future[PieceRead], None, None]:
        """``read`` of each piece, in order, done by the reader threads up to READ_AHEAD pieces ahead.

        The caller uploads one piece while the next ones are opened, mapped and checksummed; a
        future's result (or its exception) is ``read``'s. Closing the iterator early cancels the
        reads not begun.
        """
        pool = self._reader_pool()
        pending: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
        upcoming = iter(specs)
        try:
            for spec in itertools.islice(upcoming, READ_AHEAD):
                pending.append(pool.submit(self.read, spec, num_layers))
            while pending:
                future = pending.popleft()
                for spec in itertools.islice(upcoming, 1):
                    pending.append(pool.submit(self.read, spec, num_layers))
                yield future
        finally:
            for future in pending:
                future.cancel()

    def _reader_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._directory.lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=READ_AHEAD, thread_name_prefix="mlxcel-disk-reader")
            return self._pool

    def read_snapshot(self, name: SnapshotName, num_layers: int | None
                      ) -> tuple[dict[str, str], list[dict[str, Any]], dict[str, tuple[TensorEntry, memoryview]]]:
        """A snapshot file's metadata, layer layout and verified tensors (by name); raises as ``read``."""
        view, metadata, tensors, data_start = self._directory.open_verified(name.filename, self._max_bytes(name))
        layout = disk_index.check_snapshot(name, metadata, tensors, num_layers)
        check_sum(metadata, view, data_start)
        with contextlib.suppress(OSError):
            os.utime(self._directory.path / name.filename)
        return metadata, layout, {entry.name: (entry, view[data_start + entry.start : data_start + entry.end])
                                  for entry in tensors}

    def _max_bytes(self, spec: PieceSpec | SnapshotName) -> int:
        settings = self._settings
        bound = settings.max_piece_bytes if isinstance(spec, PieceSpec) else settings.max_snapshot_bytes
        return min(settings.budget_bytes, bound) if bound is not None else settings.budget_bytes

    # --- what came of a read (the device thread reports) ------------------------------------------

    def refuse(self, spec: PieceSpec | SnapshotName, error: PieceRefused) -> None:
        """Log, count and delete a file that must not be loaded."""
        self._directory.count_refusal(error.reason)
        deleted = True
        try:
            os.unlink(self._directory.path / spec.filename)
        except FileNotFoundError:
            pass
        except OSError:
            deleted = False
        logger.warning("prompt-cache disk tier: refused %s (%s: %s)%s", spec.filename, error.reason, error.detail,
                       "; deleted" if deleted else "; could not delete it")

    def vanished(self, spec: PieceSpec | SnapshotName) -> None:
        logger.debug("prompt-cache disk tier: %s vanished (evicted by another process)", spec.filename)
        self._directory.count("vanished")

    def record_load(self, *, nbytes: int, seconds: float, tokens: int, verify_wait_seconds: float = 0.0) -> None:
        self._directory.record_load(nbytes=nbytes, seconds=seconds, tokens=tokens,
                                    verify_wait_seconds=verify_wait_seconds)

    def record_miss(self) -> None:
        self._directory.count("misses")

    def record_cut_short(self) -> None:
        self._directory.count("loads_cut_short")
