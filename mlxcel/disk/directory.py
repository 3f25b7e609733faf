"""The disk tier's directory as every thread of it sees it: its settings, its shared counters, its files.

No MLX, no Trio. ``Directory`` is the one object the tier's threads share
(the cache store's Trio thread, the device thread, the writer thread, the
reader threads, the engine's worker threads): it keeps no state the
directory itself does not also hold, besides counters, and everything it
keeps sits behind one lock. The functions here open, list and lock the
directory and are safe on any thread. Every file operation tolerates a file
that another process evicted meanwhile: a vanished file is a miss, never an
error.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import blake3

from mlxcel.disk import index as disk_index
from mlxcel.disk.index import REFUSAL_REASONS, IndexedFile, PieceRefused, TensorEntry

logger = logging.getLogger(__name__)

# The files hold prompts in the clear (their tokens): only this user may read them.
DIRECTORY_MODE = 0o700
FILE_MODE = 0o600


class UnsafeDirectory(Exception):
    """A --prompt-cache-dir that another user owns or may write: refused at start-up."""


def prepare_directory(directory: Path) -> None:
    """Create the directory (0700), or check that an existing one is this user's and only theirs.

    Refuses (UnsafeDirectory) a directory owned by another user or writable by group or others:
    whoever can write it can plant pieces this server would load, or read what it writes. An own
    directory readable by others is tightened to 0700. Raises OSError when it cannot be created.
    """
    directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    info = directory.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"--prompt-cache-dir {directory}: not a directory")
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(f"--prompt-cache-dir {directory} is owned by uid {info.st_uid}, not by this user "
                              f"(uid {os.geteuid()}): use a directory of your own")
    if info.st_mode & 0o022:
        raise UnsafeDirectory(f"--prompt-cache-dir {directory} can be written by other users (mode "
                              f"{stat.S_IMODE(info.st_mode):04o}): chmod 700 it or use another directory")
    if stat.S_IMODE(info.st_mode) != DIRECTORY_MODE:
        try:
            os.chmod(directory, DIRECTORY_MODE)
            logger.info("prompt-cache disk tier: %s was readable by other users; it is now 0700", directory)
        except OSError as error:  # a read-only mount: it is still used, read-only
            logger.warning("prompt-cache disk tier: %s is readable by other users and cannot be made 0700 (%s)",
                           directory, error.strerror or error)


def create_private(path: Path) -> Any:
    """A new file only this user can read, opened for writing (fails if it exists)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    return os.fdopen(descriptor, "wb")


@attrs.frozen(kw_only=True)
class DiskSettings:
    directory: Path
    budget_bytes: int
    write_bytes_per_second: int
    # Tenant isolation: the session key is part of every file's fingerprint.
    session_scoped: bool = False
    min_prefix: int = 32
    # The largest file a read opens (None: the budget): a planted huge file must not cost memory.
    max_piece_bytes: int | None = None
    max_snapshot_bytes: int | None = None
    # --prompt-cache-kv-bits: pieces are written and read quantized (0: exact). Part of the model's fingerprint.
    kv_bits: int = 0
    kv_group_size: int = 64


@attrs.frozen(kw_only=True)
class DiskStats:
    directory: str
    writable: bool
    bytes: int
    entries: int
    budget_bytes: int
    hits: int
    misses: int
    tokens_loaded: int
    writes: int
    bytes_written: int
    write_errors: int
    writes_dropped: int
    duplicates: int
    evictions: int
    refusals: dict[str, int]
    bytes_read: int
    load_seconds: float
    vanished: int
    # Disk hits that stopped reading early because prefilling the rest was projected to be faster.
    loads_cut_short: int = 0
    # Of load_seconds, the time the device waited for the reader threads' checksums.
    verify_wait_seconds: float = 0.0

    @property
    def load_ms_per_mib(self) -> float:
        return 1000 * self.load_seconds / (self.bytes_read / (1 << 20)) if self.bytes_read else 0.0

    def to_json(self) -> dict[str, Any]:
        body = attrs.asdict(self)
        body["refusals_total"] = sum(self.refusals.values())
        body["load_ms_per_mib"] = round(self.load_ms_per_mib, 3)
        body["verify_wait_seconds"] = round(self.verify_wait_seconds, 6)
        return body


def stat_result_expired(info: os.stat_result, now: float) -> bool:
    """A retention record whose time has run out (its mtime is its end)."""
    return info.st_mtime < now


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Directory:
    """The directory, its settings and the counters every thread of the tier adds to (one lock)."""

    def __init__(self, settings: DiskSettings) -> None:
        self.settings = settings
        self.path = settings.directory
        self.lock = threading.Lock()
        # False until the tier opens a directory it may write, and again if writing fails for good.
        self.writable = False
        self.bytes = 0
        self.entries = 0
        # Snapshot files by fingerprint: the lengths present at the last listing (a lookup needs them).
        self.snapshot_lengths: dict[str, set[int]] = {}
        self.snapshots_listed = 0.0
        self._counts = dict.fromkeys(
            ("hits", "misses", "tokens_loaded", "writes", "bytes_written", "write_errors", "writes_dropped",
             "duplicates", "evictions", "bytes_read", "vanished", "loads_cut_short"), 0)
        self._load_seconds = self._verify_wait_seconds = 0.0
        self._refusals = dict.fromkeys(REFUSAL_REASONS, 0)
        self._warned: set[str] = set()

    def count(self, name: str, amount: int = 1) -> None:
        with self.lock:
            self._counts[name] += amount

    def count_refusal(self, reason: str) -> None:
        with self.lock:
            self._refusals[reason] += 1

    def record_load(self, *, nbytes: int, seconds: float, tokens: int, verify_wait_seconds: float = 0.0) -> None:
        with self.lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += nbytes
            self._counts["tokens_loaded"] += tokens
            self._load_seconds += seconds
            self._verify_wait_seconds += verify_wait_seconds

    def set_size(self, files: list[IndexedFile], *, evicted: int = 0) -> None:
        with self.lock:
            self.bytes = sum(item.nbytes for item in files)
            self.entries = len(files)
            self._counts["evictions"] += evicted

    def statistics(self) -> DiskStats:
        with self.lock:
            return DiskStats(
                directory=str(self.path), writable=self.writable, bytes=self.bytes, entries=self.entries,
                budget_bytes=self.settings.budget_bytes, refusals=dict(self._refusals),
                load_seconds=self._load_seconds, verify_wait_seconds=self._verify_wait_seconds, **self._counts,
            )

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        # One warning per kind of fault: a full disk would otherwise log every piece.
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        logger.log(level, message, *args)

    def exists(self, filename: str) -> bool:
        return os.path.exists(self.path / filename)

    def scan(self, *, clean: bool = False) -> tuple[list[IndexedFile], int, int]:
        """The pieces in the directory (name, size, mtime); temporary files of dead writers are removed."""
        files, temps_removed, foreign = [], 0, 0
        snapshots: dict[str, set[int]] = {}
        now = time.time()
        pid = os.getpid()
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return [], 0, 0
        for entry in entries:
            name = entry.name
            try:
                info = entry.stat()
            except OSError:
                continue  # evicted by another process meanwhile
            parsed = disk_index.parse_name(name)
            snapshot = disk_index.parse_snapshot_name(name) if parsed is None else None
            if parsed is not None or snapshot is not None:
                files.append(IndexedFile(filename=name, nbytes=info.st_size, last_used=info.st_mtime,
                                         depth=parsed.end_block if parsed is not None else 0))
                if snapshot is not None:
                    snapshots.setdefault(snapshot.fingerprint, set()).add(snapshot.num_tokens)
            elif disk_index.is_pin_name(name):
                if clean and stat_result_expired(info, now):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
            elif disk_index.temp_owner(name) is not None:
                if clean and disk_index.stale_temp(name, now - info.st_mtime, pid, _alive):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                        temps_removed += 1
            elif name != disk_index.LOCK_NAME:
                foreign += 1
        with self.lock:
            self.snapshot_lengths, self.snapshots_listed = snapshots, time.monotonic()
        return files, temps_removed, foreign

    def enforce_budget(self, incoming: IndexedFile | None = None, keep: frozenset[str] = frozenset()) -> bool:
        """Re-list the directory (other processes write too) and delete least recently used pieces.

        With ``incoming`` (a piece about to be renamed into place), it competes
        too: False when it is the one that does not fit (nothing is deleted then).
        The files in ``keep`` (the pieces ``incoming`` extends) are never deleted for it.
        """
        files, _removed, _foreign = self.scan(clean=True)
        candidates = files if incoming is None else [*files, incoming]
        doomed = disk_index.over_budget(candidates, self.settings.budget_bytes, keep)
        if incoming is not None and incoming in doomed:
            return False
        evicted = 0
        for item in doomed:
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(self.path / item.filename)
                evicted += 1
        gone = {item.filename for item in doomed}
        self.set_size([item for item in candidates if item.filename not in gone], evicted=evicted)
        return True

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """An exclusive advisory lock on DIR/.lock, shared by every process that writes to DIR."""
        descriptor = os.open(self.path / disk_index.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # closing releases the lock

    def open_verified(self, filename: str, max_bytes: int
                      ) -> tuple[memoryview, dict[str, str], list[TensorEntry], int]:
        """The file mapped read-only (no copy in this process), and its parsed header.

        Only a regular file no larger than max_bytes is mapped: a FIFO planted under a piece's
        name would block a plain open, and a huge file would cost its size in memory.
        """
        path = self.path / filename
        try:
            # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer.
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise PieceRefused("malformed", "a symbolic link, not a file") from None
            raise
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode):
                raise PieceRefused("malformed", "not a regular file")
            if info.st_size > max_bytes:
                raise PieceRefused("malformed", f"{info.st_size} bytes, more than any file of this model "
                                   f"({max_bytes})")
            if info.st_size < 8:
                raise PieceRefused("truncated", f"{info.st_size} bytes, shorter than a header")
            mapped = mmap.mmap(descriptor, info.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(descriptor)
        view = memoryview(mapped)
        metadata, tensors, data_start = disk_index.decode_header(view, info.st_size)
        return view, metadata, tensors, data_start


# Threads one checksum may use (blake3.AUTO: as many as the machine has); the reader threads run several.
HASH_THREADS: int = blake3.blake3.AUTO


def check_sum(metadata: dict[str, str], view: memoryview, data_start: int) -> None:
    # BLAKE3 hashes a large buffer on several cores, without the GIL, touching the mapped pages.
    checksum = blake3.blake3(view[data_start:], max_threads=HASH_THREADS).hexdigest()
    if checksum != metadata.get("checksum"):
        raise PieceRefused("checksum", f"data digest {checksum[:16]}... is not the recorded one")
