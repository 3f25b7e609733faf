"""The disk tier's writer thread: pieces in, files out, the byte budget kept.

No MLX, no Trio. The device thread turns KV rows into host buffers
(``mlxcel.disk.device``) and ``submit``s them; the cache store's Trio thread
queues retention records (``record_pin``). Everything else here runs on the
one writer thread: it writes each piece to a temporary name, renames it into
place (atomic on POSIX) under the directory's lock, and keeps the directory
within its byte budget. Files are never modified after the rename.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import queue
import secrets
import threading
import time

import attrs
import blake3

from mlxcel.disk import index as disk_index
from mlxcel.disk.directory import Directory, create_private
from mlxcel.disk.index import IndexedFile, PieceData, PieceSpec

logger = logging.getLogger(__name__)

# Pieces the device may queue before the writer thread has written them: a second of the write budget.
_MIN_BACKLOG_BYTES = 8 << 20
# The writer's unit of work under the write budget.
_WRITE_CHUNK = 1 << 20
# File names of written pieces remembered with their parents (the budget keeps a new piece's ancestors).
_REMEMBERED_PIECES = 4096


@attrs.frozen
class _PinRecord:
    filename: str
    retain_until: float


class DiskWriter:
    def __init__(self, directory: Directory) -> None:
        self._directory = directory
        self._settings = directory.settings
        self._queue: queue.Queue[PieceData | _PinRecord | None] = queue.Queue()
        self._pending_bytes = 0
        self._next_write = 0.0
        self._thread: threading.Thread | None = None
        # Pieces this writer renamed into place, by file name: their parent's (the writer thread's alone).
        self._parents: collections.OrderedDict[str, str | None] = collections.OrderedDict()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._write_loop, name="mlxcel-disk-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Write what is queued (up to timeout seconds), then end the thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("prompt-cache disk tier: pieces still queued after %.0f s were not written", timeout)

    # --- from other threads ------------------------------------------------------------------

    def has_room(self) -> bool:
        with self._directory.lock:
            return self._pending_bytes < max(self._settings.write_bytes_per_second, _MIN_BACKLOG_BYTES)

    def submit(self, piece: PieceData) -> None:
        if self._thread is None:
            self._directory.count("writes_dropped")
            return
        with self._directory.lock:
            self._pending_bytes += piece.nbytes
        self._queue.put(piece)

    def drop(self, count: int = 1) -> None:
        self._directory.count("writes_dropped", count)

    def record_pin(self, filename: str, retain_until: float) -> None:
        self._queue.put(_PinRecord(filename=filename, retain_until=retain_until))

    # --- the writer thread -------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            piece = self._queue.get()
            if piece is None:
                return
            if isinstance(piece, _PinRecord):
                self._write_pin(piece)
                continue
            nbytes = piece.nbytes
            try:
                self._write(piece)
            except Exception:  # noqa: BLE001 - a disk fault must never stop the server
                logger.exception("prompt-cache disk tier: writing %s failed", piece.spec.filename)
                self._directory.count("write_errors")
            finally:
                with self._directory.lock:
                    self._pending_bytes -= nbytes

    def _ancestors(self, parent: str | None) -> frozenset[str]:
        """The pieces a new piece extends: its parent, and the parents before it that this writer wrote.

        The budget orders pieces by the second of their last use; a prefix whose pieces were written across
        a second's turn would otherwise make room for its new piece by deleting its own first one.
        """
        chain: set[str] = set()
        while parent is not None and parent not in chain:
            chain.add(parent)
            parent = self._parents.get(parent)
        return frozenset(chain)

    def _throttle(self, nbytes: int) -> None:
        """The write budget: at most write_bytes_per_second, a chunk at a time (so I/O comes in an even flow)."""
        now = time.monotonic()
        self._next_write = max(now, self._next_write) + nbytes / max(1, self._settings.write_bytes_per_second)
        if self._next_write > now:
            time.sleep(self._next_write - now)

    def _write(self, piece: PieceData) -> None:
        directory = self._directory
        filename = piece.spec.filename
        final = directory.path / filename
        if final.exists():
            directory.count("duplicates")
            return
        nbytes = piece.nbytes
        if not directory.writable:
            directory.count("writes_dropped")
            return
        spec = piece.spec
        parent = disk_index.parent_piece(spec) if isinstance(spec, PieceSpec) else None
        if parent is not None and not (directory.path / parent).exists():
            # Without its parent the piece could never be reached (evicted, or its write failed).
            directory.count("writes_dropped")
            return
        if nbytes > self._settings.budget_bytes:
            directory.warn_once("too_large", "prompt-cache disk tier: a %d-byte piece is larger than the whole "
                                "budget (%d bytes); raise --prompt-cache-disk-bytes", nbytes,
                                self._settings.budget_bytes)
            directory.count("writes_dropped")
            return
        checksum = blake3.blake3()
        for *_rest, buffer in piece.tensors:
            checksum.update(buffer)
        if isinstance(spec, PieceSpec):
            metadata = {**disk_index.piece_metadata(spec, checksum=checksum.hexdigest(), num_layers=piece.num_layers),
                        **piece.extra}
        else:
            metadata = disk_index.snapshot_metadata(spec, checksum=checksum.hexdigest(), extra=piece.extra)
        header = disk_index.encode_header(
            [(name, dtype, shape, memoryview(buffer).nbytes) for name, dtype, shape, buffer in piece.tensors],
            metadata)
        temp = directory.path / disk_index.temp_name(filename, os.getpid(), secrets.token_hex(4))
        try:
            with create_private(temp) as file:
                file.write(header)
                for *_rest, buffer in piece.tensors:
                    view = memoryview(buffer)
                    for offset in range(0, view.nbytes, _WRITE_CHUNK):
                        chunk = view[offset : offset + _WRITE_CHUNK]
                        file.write(chunk)
                        self._throttle(chunk.nbytes)
                file.flush()
                os.fsync(file.fileno())
            # Room first, then the rename, under the directory's lock: the pieces of every
            # process together never exceed the budget, not even for a moment.
            incoming = IndexedFile(filename=filename, nbytes=len(header) + nbytes, last_used=time.time(),
                                   depth=spec.name.end_block if isinstance(spec, PieceSpec) else 0)
            with directory.locked():
                fits = directory.enforce_budget(incoming, keep=self._ancestors(parent))
                if fits:
                    os.replace(temp, final)
            if fits and isinstance(spec, PieceSpec):
                self._parents[filename] = parent
                while len(self._parents) > _REMEMBERED_PIECES:
                    self._parents.popitem(last=False)
            if not fits:
                temp.unlink()
                directory.count("writes_dropped")
                logger.debug("prompt-cache disk tier: %s does not fit the budget before older pieces", filename)
                return
        except OSError as error:
            with contextlib.suppress(OSError):
                temp.unlink()
            directory.count("write_errors")
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                directory.writable = False
                logger.error("prompt-cache disk tier: %s is no longer writable (%s); writing stops",
                             directory.path, error.strerror)
            else:
                directory.warn_once(str(error.errno), "prompt-cache disk tier: cannot write %s (%s); "
                                    "the server goes on without it", filename, error.strerror or error)
            return
        directory.count("writes")
        directory.count("bytes_written", len(header) + nbytes)

    def _write_pin(self, pin: _PinRecord) -> None:
        """An empty file whose mtime is the retention's end; a later retention only extends it."""
        directory = self._directory
        final = directory.path / pin.filename
        with contextlib.suppress(OSError):
            if os.stat(final).st_mtime >= pin.retain_until:
                return
        temp = directory.path / disk_index.temp_name(pin.filename, os.getpid(), secrets.token_hex(4))
        try:
            with create_private(temp):
                pass
            os.utime(temp, (pin.retain_until, pin.retain_until))
            os.replace(temp, final)
        except OSError as error:
            with contextlib.suppress(OSError):
                temp.unlink()
            directory.warn_once(f"pin-{error.errno}", "prompt-cache disk tier: cannot record a retention in %s (%s)",
                                directory.path, error.strerror or error)
