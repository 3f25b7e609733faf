"""The disk tier's directory: lookups, the writer thread, verified reads, the budget, stats.

One ``DiskTier`` per process, over a directory that several processes may
share. It holds no MLX arrays and imports no MLX: the device thread turns KV
rows into host buffers (``mlxcel.disk.device``) and hands them to this
tier's writer thread, which writes each piece to a temporary name, renames
it into place (atomic on POSIX) and keeps the directory within its byte
budget. Files are never modified after the rename; a hit touches a file's
mtime, which is its last use for the LRU budget of every process.

Who calls what: the cache-store actor probes (existence checks, on the Trio
thread), plans writes and records retentions; the device thread submits host
buffers and asks for pieces, which the reader threads open, map and verify
ahead of it (``read_ahead``); the engine asks for statistics and clears the
directory. Counters
sit behind one lock. Every file operation tolerates a file that another
process evicted meanwhile: a vanished file is a miss, never an error.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import queue
import secrets
import stat
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import blake3

from mlxcel.cache.key import CacheContext
from mlxcel.disk import index as disk_index
from mlxcel.disk.index import (
    REFUSAL_REASONS,
    DiskPlan,
    IndexedFile,
    PieceData,
    PieceRefused,
    PieceSpec,
    SnapshotName,
    TensorEntry,
)

logger = logging.getLogger(__name__)

# A verified piece: its metadata and each tensor with a view of its bytes in the mapped file.
PieceRead = tuple[dict[str, str], list[tuple[TensorEntry, memoryview]]]

# Pieces the device may queue before the writer thread has written them: a second of the write budget.
_MIN_BACKLOG_BYTES = 8 << 20
# How stale the list of snapshot files may be when a lookup reads it.
_SNAPSHOT_LISTING_SECONDS = 1.0
# The writer's unit of work under the write budget.
_WRITE_CHUNK = 1 << 20
# Pieces a disk hit's reader threads open and checksum ahead of the one the device uploads.
READ_AHEAD = 3
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


def _create_private(path: Path) -> Any:
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

    @property
    def load_ms_per_mib(self) -> float:
        return 1000 * self.load_seconds / (self.bytes_read / (1 << 20)) if self.bytes_read else 0.0

    def to_json(self) -> dict[str, Any]:
        body = attrs.asdict(self)
        body["refusals_total"] = sum(self.refusals.values())
        body["load_ms_per_mib"] = round(self.load_ms_per_mib, 3)
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


@attrs.frozen
class _PinRecord:
    filename: str
    retain_until: float


class DiskTier:
    def __init__(self, settings: DiskSettings, model_fingerprint: str) -> None:
        self.settings = settings
        self.directory = settings.directory
        self._model = model_fingerprint
        self._hasher = disk_index.new_hasher()
        self._fingerprints: dict[tuple[Any, ...], str] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[PieceData | _PinRecord | None] = queue.Queue()
        self._pending_bytes = 0
        self._next_write = 0.0
        # Snapshot files by fingerprint: the lengths present at the last listing (a lookup needs them).
        self._snapshot_lengths: dict[str, set[int]] = {}
        self._snapshots_listed = 0.0
        self._writer: threading.Thread | None = None
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        self.writable = False
        self._bytes = 0
        self._entries = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "tokens_loaded", "writes", "bytes_written", "write_errors", "writes_dropped",
             "duplicates", "evictions", "bytes_read", "vanished", "loads_cut_short"), 0)
        self._load_seconds = 0.0
        self._refusals = dict.fromkeys(REFUSAL_REASONS, 0)
        self._warned: set[str] = set()

    # --- start and stop ------------------------------------------------------------------

    def open(self) -> None:
        """Index the directory (names and sizes only, no tensors), clean up after dead writers, log it."""
        try:
            prepare_directory(self.directory)
        except OSError as error:
            logger.error("prompt-cache disk tier: cannot create %s (%s); the disk tier is off",
                         self.directory, error.strerror or error)
            return
        self.writable = self._probe_writable()
        files, temps_removed, foreign = self._scan(clean=True)
        tightened = self._make_private(files) if self.writable else 0
        total = sum(item.nbytes for item in files)
        with self._lock:
            self._bytes, self._entries = total, len(files)
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
            with self._directory_lock():
                self._enforce_budget()
            self._writer = threading.Thread(target=self._write_loop, name="mlxcel-disk-writer", daemon=True)
            self._writer.start()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to timeout seconds), then stop the writer thread."""
        with self._lock:
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=False, cancel_futures=True)
        writer, self._writer = self._writer, None
        if writer is None:
            return
        self._queue.put(None)
        writer.join(timeout)
        if writer.is_alive():
            logger.warning("prompt-cache disk tier: pieces still queued after %.0f s were not written", timeout)

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
            with _create_private(probe) as file:
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

    def _exists(self, filename: str) -> bool:
        return os.path.exists(self.directory / filename)

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
                                      cap_blocks, self._exists)
        except OSError:
            run = []
        end = run[-1].name.end_token if run else 0
        if end < max(memory_len + block, self.settings.min_prefix):
            self._count("misses")
            return None
        return DiskPlan(pieces=tuple(run), kept=start_block * block, num_tokens=end, memory_len=memory_len,
                        retain_seconds=self._retention_left(run[-1].name))

    def _retention_left(self, name: disk_index.PieceName) -> float:
        """Seconds left of a retention recorded for a prefix ending where this piece does (0: none)."""
        try:
            until = os.stat(self.directory / disk_index.pin_name(name.fingerprint, name.end_block,
                                                                 name.chain_hash)).st_mtime
        except OSError:
            return 0.0
        return max(0.0, until - time.time())

    def record_retention(self, context: CacheContext, tokens: Sequence[int], retain_seconds: float) -> None:
        """A retained prefix: the writer records until when, for a server that reads it back after a restart."""
        num_blocks = len(tokens) // disk_index.BLOCK_TOKENS
        if not self.writable or self._writer is None or retain_seconds <= 0 or num_blocks == 0:
            return
        chain = self._hasher.chain(tokens[: num_blocks * disk_index.BLOCK_TOKENS], context.mm_digest)
        self._queue.put(_PinRecord(filename=disk_index.pin_name(self.fingerprint(context), num_blocks, chain[-1]),
                                   retain_until=time.time() + retain_seconds))

    def plan_write(self, context: CacheContext, tokens: Sequence[int], prompt_len: int | None = None
                   ) -> tuple[PieceSpec, ...]:
        """The pieces of a stored prefix that are not on disk yet (and one ending at its prompt, when told)."""
        if not self.writable or len(tokens) < max(self.settings.min_prefix, disk_index.BLOCK_TOKENS):
            return ()
        chain = self._hasher.chain(tokens, context.mm_digest)
        prompt_blocks = prompt_len // disk_index.BLOCK_TOKENS if prompt_len else None
        pieces = disk_index.pieces_of(self.fingerprint(context), chain, self._hasher.root, prompt_blocks)
        try:
            return tuple(piece for piece in pieces if not self._exists(piece.filename))
        except OSError:
            return ()

    # --- session snapshots (snapshot families) ------------------------------------------------

    def probe_snapshot(self, context: CacheContext, tokens: Sequence[int], memory_len: int
                       ) -> SnapshotName | None:
        """The longest snapshot on disk whose tokens begin tokens[:-1], if longer than memory's memory_len."""
        if time.monotonic() - self._snapshots_listed > _SNAPSHOT_LISTING_SECONDS:
            self._scan()  # other processes write snapshots too: a cheap listing at most once a second
        fingerprint = self.fingerprint(context)
        with self._lock:
            lengths = sorted(self._snapshot_lengths.get(fingerprint, ()), reverse=True)
        lengths = [length for length in lengths if memory_len < length <= len(tokens) - 1]
        if not lengths:
            return None
        chain = self._hasher.chain(tokens[: lengths[0]], context.mm_digest)
        for length in lengths:
            name = SnapshotName(fingerprint=fingerprint, num_tokens=length,
                                digest=disk_index.snapshot_digest(chain, self._hasher.root, tokens[:length]))
            if self._exists(name.filename):
                return name
        self._count("misses")
        return None

    def plan_snapshot(self, context: CacheContext, tokens: Sequence[int]) -> SnapshotName | None:
        """The name a stored snapshot of tokens takes on disk; None when it is there already (or not writable)."""
        if not self.writable or len(tokens) < max(self.settings.min_prefix, 1):
            return None
        chain = self._hasher.chain(tokens, context.mm_digest)
        name = SnapshotName(fingerprint=self.fingerprint(context), num_tokens=len(tokens),
                            digest=disk_index.snapshot_digest(chain, self._hasher.root, tokens))
        try:
            return None if self._exists(name.filename) else name
        except OSError:
            return None

    # --- writing (the device thread submits; the writer thread writes) -------------------------

    def has_room(self) -> bool:
        with self._lock:
            return self._pending_bytes < max(self.settings.write_bytes_per_second, _MIN_BACKLOG_BYTES)

    def submit(self, piece: PieceData) -> None:
        if self._writer is None:
            self._count("writes_dropped")
            return
        with self._lock:
            self._pending_bytes += piece.nbytes
        self._queue.put(piece)

    def drop(self, count: int = 1) -> None:
        self._count("writes_dropped", count)

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
                self._count("write_errors")
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes

    def _throttle(self, nbytes: int) -> None:
        """The write budget: at most write_bytes_per_second, a chunk at a time (so I/O comes in an even flow)."""
        now = time.monotonic()
        self._next_write = max(now, self._next_write) + nbytes / max(1, self.settings.write_bytes_per_second)
        if self._next_write > now:
            time.sleep(self._next_write - now)

    def _write(self, piece: PieceData) -> None:
        filename = piece.spec.filename
        final = self.directory / filename
        if final.exists():
            self._count("duplicates")
            return
        nbytes = piece.nbytes
        if not self.writable:
            self._count("writes_dropped")
            return
        spec = piece.spec
        parent = disk_index.parent_piece(spec) if isinstance(spec, PieceSpec) else None
        if parent is not None and not (self.directory / parent).exists():
            # Without its parent the piece could never be reached (evicted, or its write failed).
            self._count("writes_dropped")
            return
        if nbytes > self.settings.budget_bytes:
            self._warn_once("too_large", "prompt-cache disk tier: a %d-byte piece is larger than the whole budget "
                            "(%d bytes); raise --prompt-cache-disk-bytes", nbytes, self.settings.budget_bytes)
            self._count("writes_dropped")
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
        temp = self.directory / disk_index.temp_name(filename, os.getpid(), secrets.token_hex(4))
        try:
            with _create_private(temp) as file:
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
            with self._directory_lock():
                fits = self._enforce_budget(incoming)
                if fits:
                    os.replace(temp, final)
            if not fits:
                temp.unlink()
                self._count("writes_dropped")
                logger.debug("prompt-cache disk tier: %s does not fit the budget before older pieces", filename)
                return
        except OSError as error:
            with contextlib.suppress(OSError):
                temp.unlink()
            self._count("write_errors")
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                self.writable = False
                logger.error("prompt-cache disk tier: %s is no longer writable (%s); writing stops",
                             self.directory, error.strerror)
            else:
                self._warn_once(str(error.errno), "prompt-cache disk tier: cannot write %s (%s); "
                                "the server goes on without it", filename, error.strerror or error)
            return
        self._count("writes")
        self._count("bytes_written", len(header) + nbytes)

    def _write_pin(self, pin: _PinRecord) -> None:
        """An empty file whose mtime is the retention's end; a later retention only extends it."""
        final = self.directory / pin.filename
        with contextlib.suppress(OSError):
            if os.stat(final).st_mtime >= pin.retain_until:
                return
        temp = self.directory / disk_index.temp_name(pin.filename, os.getpid(), secrets.token_hex(4))
        try:
            with _create_private(temp):
                pass
            os.utime(temp, (pin.retain_until, pin.retain_until))
            os.replace(temp, final)
        except OSError as error:
            with contextlib.suppress(OSError):
                temp.unlink()
            self._warn_once(f"pin-{error.errno}", "prompt-cache disk tier: cannot record a retention in %s (%s)",
                            self.directory, error.strerror or error)

    @contextlib.contextmanager
    def _directory_lock(self) -> Iterator[None]:
        """An exclusive advisory lock on DIR/.lock, shared by every process that writes to DIR."""
        descriptor = os.open(self.directory / disk_index.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # closing releases the lock

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        # One warning per kind of fault: a full disk would otherwise log every piece.
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        logger.log(level, message, *args)

    # --- the budget and the index ------------------------------------------------------------

    def _scan(self, *, clean: bool = False) -> tuple[list[IndexedFile], int, int]:
        """The pieces in the directory (name, size, mtime); temporary files of dead writers are removed."""
        files, temps_removed, foreign = [], 0, 0
        snapshots: dict[str, set[int]] = {}
        now = time.time()
        pid = os.getpid()
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return [], 0, 0
        for entry in entries:
            name = entry.name
            try:
                stat = entry.stat()
            except OSError:
                continue  # evicted by another process meanwhile
            parsed = disk_index.parse_name(name)
            snapshot = disk_index.parse_snapshot_name(name) if parsed is None else None
            if parsed is not None or snapshot is not None:
                files.append(IndexedFile(filename=name, nbytes=stat.st_size, last_used=stat.st_mtime,
                                         depth=parsed.end_block if parsed is not None else 0))
                if snapshot is not None:
                    snapshots.setdefault(snapshot.fingerprint, set()).add(snapshot.num_tokens)
            elif disk_index.is_pin_name(name):
                if clean and stat_result_expired(stat, now):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
            elif disk_index.temp_owner(name) is not None:
                if clean and disk_index.stale_temp(name, now - stat.st_mtime, pid, _alive):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                        temps_removed += 1
            elif name != disk_index.LOCK_NAME:
                foreign += 1
        with self._lock:
            self._snapshot_lengths, self._snapshots_listed = snapshots, time.monotonic()
        return files, temps_removed, foreign

    def _enforce_budget(self, incoming: IndexedFile | None = None) -> bool:
        """Re-list the directory (other processes write too) and delete least recently used pieces.

        With ``incoming`` (a piece about to be renamed into place), it competes
        too: False when it is the one that does not fit (nothing is deleted then).
        """
        files, _removed, _foreign = self._scan(clean=True)
        candidates = files if incoming is None else [*files, incoming]
        doomed = disk_index.over_budget(candidates, self.settings.budget_bytes)
        if incoming is not None and incoming in doomed:
            return False
        evicted = 0
        for item in doomed:
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(self.directory / item.filename)
                evicted += 1
        gone = {item.filename for item in doomed}
        kept = [item for item in candidates if item.filename not in gone]
        with self._lock:
            self._bytes = sum(item.nbytes for item in kept)
            self._entries = len(kept)
            self._counts["evictions"] += evicted
        return True

    # --- reading (the device thread asks; the reader threads open and verify) -------------------

    def read(self, spec: PieceSpec, num_layers: int | None) -> PieceRead:
        """A piece's verified tensors, views of the mapped file. Raises PieceRefused (bad file) or
        FileNotFoundError (gone)."""
        view, metadata, tensors, data_start = self._open_verified(spec.filename, self._max_bytes(spec))
        disk_index.check_piece(spec, metadata, tensors, num_layers, self.settings.kv_bits,
                               self.settings.kv_group_size)
        self._check_sum(metadata, view, data_start)
        with contextlib.suppress(OSError):
            os.utime(self.directory / spec.filename)  # its last use, for every process's LRU budget
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
        with self._lock:
            if self._readers is None:
                self._readers = concurrent.futures.ThreadPoolExecutor(
                    max_workers=READ_AHEAD, thread_name_prefix="mlxcel-disk-reader")
            return self._readers

    def read_snapshot(self, name: SnapshotName, num_layers: int | None
                      ) -> tuple[dict[str, str], list[dict[str, Any]], dict[str, tuple[TensorEntry, memoryview]]]:
        """A snapshot file's metadata, layer layout and verified tensors (by name); raises as ``read``."""
        view, metadata, tensors, data_start = self._open_verified(name.filename, self._max_bytes(name))
        layout = disk_index.check_snapshot(name, metadata, tensors, num_layers)
        self._check_sum(metadata, view, data_start)
        with contextlib.suppress(OSError):
            os.utime(self.directory / name.filename)
        return metadata, layout, {entry.name: (entry, view[data_start + entry.start : data_start + entry.end])
                                  for entry in tensors}

    def _max_bytes(self, spec: PieceSpec | SnapshotName) -> int:
        bound = self.settings.max_piece_bytes if isinstance(spec, PieceSpec) else self.settings.max_snapshot_bytes
        return min(self.settings.budget_bytes, bound) if bound is not None else self.settings.budget_bytes

    def _open_verified(self, filename: str, max_bytes: int
                       ) -> tuple[memoryview, dict[str, str], list[TensorEntry], int]:
        """The file mapped read-only (no copy in this process), and its parsed header.

        Only a regular file no larger than max_bytes is mapped: a FIFO planted under a piece's
        name would block a plain open, and a huge file would cost its size in memory.
        """
        path = self.directory / filename
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

    @staticmethod
    def _check_sum(metadata: dict[str, str], view: memoryview, data_start: int) -> None:
        # BLAKE3 hashes a large buffer on several cores, without the GIL, touching the mapped pages.
        checksum = blake3.blake3(view[data_start:], max_threads=blake3.blake3.AUTO).hexdigest()
        if checksum != metadata.get("checksum"):
            raise PieceRefused("checksum", f"data digest {checksum[:16]}... is not the recorded one")

    def refuse(self, spec: PieceSpec | SnapshotName, error: PieceRefused) -> None:
        """Log, count and delete a file that must not be loaded."""
        with self._lock:
            self._refusals[error.reason] += 1
        deleted = True
        try:
            os.unlink(self.directory / spec.filename)
        except FileNotFoundError:
            pass
        except OSError:
            deleted = False
        logger.warning("prompt-cache disk tier: refused %s (%s: %s)%s", spec.filename, error.reason, error.detail,
                       "; deleted" if deleted else "; could not delete it")

    def vanished(self, spec: PieceSpec | SnapshotName) -> None:
        logger.debug("prompt-cache disk tier: %s vanished (evicted by another process)", spec.filename)
        self._count("vanished")

    def record_load(self, *, nbytes: int, seconds: float, tokens: int) -> None:
        with self._lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += nbytes
            self._counts["tokens_loaded"] += tokens
            self._load_seconds += seconds

    def record_miss(self) -> None:
        self._count("misses")

    def record_cut_short(self) -> None:
        self._count("loads_cut_short")

    # --- stats and reset (the engine, off the Trio thread) ----------------------------------------

    def clear(self) -> tuple[int, int]:
        """Delete every piece in the directory (any process's); returns files and bytes freed."""
        files, _removed, _foreign = self._scan(clean=True)
        freed = freed_bytes = 0
        for item in files:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / item.filename)
                freed += 1
                freed_bytes += item.nbytes
        with self._lock:
            self._bytes, self._entries = 0, 0
        logger.info("prompt-cache disk tier: reset deleted %d pieces (%d bytes)", freed, freed_bytes)
        return freed, freed_bytes

    def statistics(self, *, rescan: bool = True) -> DiskStats:
        if rescan:
            files, _removed, _foreign = self._scan()
            with self._lock:
                self._bytes = sum(item.nbytes for item in files)
                self._entries = len(files)
        with self._lock:
            return DiskStats(
                directory=str(self.directory), writable=self.writable, bytes=self._bytes, entries=self._entries,
                budget_bytes=self.settings.budget_bytes, refusals=dict(self._refusals),
                load_seconds=self._load_seconds, **self._counts,
            )

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount


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
