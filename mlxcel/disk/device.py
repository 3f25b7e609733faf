"""The device thread's half of the disk tier: KV rows to host buffers, and verified pieces back to KV.

Only the device thread calls into this module (it touches MLX). Both
directions ride the step plan (``core/plan.py``), as vLLM's KV-connector
metadata rides its scheduler output. Writing is write-behind: a plan's
``disk_writes`` only queue their payloads (after the step's forward work);
the device converts a slice of them (a few layers, at most ``SLICE_BYTES``)
whenever its inbox is empty, and hands each finished piece, as host buffers
that no longer reference MLX, to the tier's writer thread. A step that
arrives waits for at most one slice. Reading is a start's ``disk_read``:
``read_starts`` runs the plan's reads before its starts, measured, and gives
each start its KV, or takes the start out of the plan when the read gave
less than it was placed for (the core places it again).

``rows`` is the one function that reads a payload's rows: the layout of a
stored payload is known here and nowhere else in the disk tier.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import numpy as np

from mlxcel.core.plan import DiskRead, DiskReadDone, DiskWrite, StartAlone, StartDirect, StepPlan
from mlxcel.disk.index import (
    DiskPlan,
    PieceData,
    PieceRefused,
    PieceSpec,
    SnapshotName,
    TensorEntry,
    layer_names,
    quantization_metadata,
    quantized_names,
)
from mlxcel.model.kv import DetachedKV, KvPiece, StoreFormat
from mlxcel.model.snapshot import SessionSnapshot

if TYPE_CHECKING:
    from mlxcel.disk.tier import DiskTier

logger = logging.getLogger(__name__)

# The most host bytes converted between two looks at the device's inbox.
SLICE_BYTES = 4 << 20
# Jobs (stored prefixes) waiting for conversion; past this the oldest is dropped.
MAX_JOBS = 64

_TO_SAFETENSORS = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}


def rows(payload: Any, start: int, end: int, layers: range | None = None) -> list[tuple[mx.array, mx.array]]:
    """Per layer (all, or those in ``layers``), the (keys, values) of the payload's token rows [start, end)."""
    if not isinstance(payload, DetachedKV):
        raise TypeError(f"not a stored KV prefix: {type(payload).__name__}")
    return payload.rows(start, end, layers)


def num_layers(payload: DetachedKV) -> int:
    return len(payload.segments[0][0].layers)


def dtype_of(payload: DetachedKV) -> Any:
    """The KV's dtype (a quantized piece's scales have it)."""
    keys = payload.segments[0][0].layers[0][0]
    return keys[1].dtype if isinstance(keys, tuple) else keys.dtype


def _stored_tensors(payload: DetachedKV, start: int, end: int, layer: int) -> list[tuple[str, mx.array]]:
    """One layer's rows [start, end) as the file holds them, by tensor name (quantized: six tensors)."""
    ((keys, values),) = payload.stored_rows(start, end, range(layer, layer + 1))
    if not isinstance(keys, tuple):
        return list(zip(layer_names(layer), (keys, values), strict=True))
    names = quantized_names(layer)
    return [*zip(names[0], keys, strict=True), *zip(names[1], values, strict=True)]


def _host(array: mx.array) -> tuple[str, np.ndarray]:
    dtype = _TO_SAFETENSORS.get(array.dtype)
    if dtype is None:
        raise TypeError(f"cannot persist a {array.dtype} KV")
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)  # numpy has no bfloat16: the bits travel as uint16
    # Flat bytes: the writer thread checksums and writes them without knowing numpy.
    return dtype, np.ascontiguousarray(np.array(array, copy=True)).reshape(-1).view(np.uint8)


@attrs.define
class _Job:
    payload: Any
    pieces: list[PieceSpec]
    # Where the conversion stands: the piece, its next layer, its tensors so far.
    piece: int = 0
    layer: int = 0
    tensors: list[tuple[str, str, tuple[int, ...], Any]] = attrs.Factory(list)


@attrs.define
class _SnapshotJob:
    """A session snapshot on its way to disk, a layer at a time."""

    snapshot: SessionSnapshot
    name: SnapshotName
    layer: int = 0
    tensors: list[tuple[str, str, tuple[int, ...], Any]] = attrs.Factory(list)
    layouts: list[dict[str, Any]] = attrs.Factory(list)


def _layer_state(index: int, layer: Any) -> tuple[dict[str, Any], list[tuple[str, mx.array]]]:
    """A snapshot layer's scalars (its layout) and arrays, by tensor name."""
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    arrays: list[tuple[str, Any]]
    if isinstance(layer, ArraysCache):
        arrays = [(f"layer.{index}.state.{slot}", array) for slot, array in enumerate(layer.cache) if array is not None]
        layout: dict[str, Any] = {"kind": "arrays", "size": len(layer.cache)}
    else:
        arrays = [] if layer.keys is None else [(f"layer.{index}.keys", layer.keys),
                                                (f"layer.{index}.values", layer.values)]
        layout = {"kind": "kv", "offset": int(layer.offset)}
        if isinstance(layer, RotatingKVCache):
            layout.update(kind="rotating", idx=int(layer._idx), max_size=int(layer.max_size), keep=int(layer.keep))
    layout["tensors"] = [name for name, _array in arrays]
    return layout, arrays


def _layer_from(layout: dict[str, Any], arrays: dict[str, mx.array]) -> Any:
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    layer: Any
    if layout["kind"] == "arrays":
        layer = ArraysCache(int(layout["size"]))
        layer.cache = [None] * int(layout["size"])
        for name in layout["tensors"]:
            layer.cache[int(name.rsplit(".", 1)[1])] = arrays[name]
        return layer
    if layout["kind"] == "rotating":
        layer = RotatingKVCache(int(layout["max_size"]), int(layout["keep"]))
        layer._idx = int(layout["idx"])
    elif layout["kind"] == "kv":
        layer = KVCache()
    else:
        raise PieceRefused("shape", f"unknown layer kind {layout['kind']!r}")
    names = layout["tensors"]
    if names:
        layer.keys, layer.values = arrays[names[0]], arrays[names[1]]
    layer.offset = int(layout["offset"])
    return layer


class DeviceDisk:
    """Owned by the device thread: the write-behind queue and disk-hit loading."""

    def __init__(self, tier: DiskTier, num_layers: int, family: str = "") -> None:
        self.tier = tier
        self._num_layers = num_layers
        self._family = family
        self._jobs: collections.deque[_Job | _SnapshotJob] = collections.deque()

    # --- the step plan's part ----------------------------------------------------------------

    def queue(self, writes: tuple[DiskWrite, ...]) -> None:
        """A plan's disk writes, queued behind its step (converted later, a slice at a time)."""
        for write in writes:
            if write.snapshot is not None:
                self.persist_snapshot(write.payload, write.snapshot)
            else:
                self.persist(write.payload, write.pieces, urgent=write.urgent)

    def read(self, read: DiskRead, prefill_seconds_per_token: float | None) -> Any:
        """One start's disk read: the KV or snapshot it gave (None: nothing usable). Never raises."""
        try:
            if read.snapshot:
                return self.load_snapshot(read.source)
            return self.load(read.source, read.memory, prefill_seconds_per_token)
        except Exception:  # noqa: BLE001 - a disk fault must never stop the device
            logger.exception("prompt-cache disk tier: reading a disk hit failed")
            return None

    # --- writing ---------------------------------------------------------------------------

    def persist(self, payload: Any, pieces: tuple[PieceSpec, ...], *, urgent: bool) -> None:
        if not pieces or not isinstance(payload, DetachedKV):
            return
        job = _Job(payload=payload, pieces=list(pieces))
        if urgent:
            self._jobs.appendleft(job)
        else:
            self._jobs.append(job)
        while len(self._jobs) > MAX_JOBS:
            dropped = self._jobs.pop()
            self.tier.drop(len(dropped.pieces) - dropped.piece if isinstance(dropped, _Job) else 1)

    def persist_snapshot(self, snapshot: Any, name: SnapshotName) -> None:
        if not isinstance(snapshot, SessionSnapshot):
            return
        self._jobs.append(_SnapshotJob(snapshot=snapshot, name=name))
        while len(self._jobs) > MAX_JOBS:
            self._jobs.pop()
            self.tier.drop()

    def has_work(self) -> bool:
        return bool(self._jobs)

    def can_work(self) -> bool:
        return bool(self._jobs) and self.tier.writer.has_room()

    def work(self, max_bytes: int = SLICE_BYTES) -> None:
        """Convert up to max_bytes of the first job's rows; a finished piece goes to the writer."""
        done = 0
        while self._jobs and done < max_bytes:
            job = self._jobs[0]
            if isinstance(job, _SnapshotJob):
                done += self._work_snapshot(job)
                continue
            spec = job.pieces[job.piece]
            count = num_layers(job.payload)
            if spec.name.end_token > job.payload.length:
                job.piece = len(job.pieces)  # cannot happen for a planned piece; never write it wrong
            else:
                for name, array in _stored_tensors(job.payload, spec.name.first_token, spec.name.end_token,
                                                   job.layer):
                    dtype, host = _host(array)
                    job.tensors.append((name, dtype, tuple(array.shape), host))
                    done += host.nbytes
                job.layer += 1
                if job.layer == count:
                    stored = job.payload.store_format
                    self.tier.writer.submit(PieceData(spec=spec, tensors=tuple(job.tensors), num_layers=count,
                                                      extra=quantization_metadata(stored.bits, stored.group_size)))
                    job.piece, job.layer, job.tensors = job.piece + 1, 0, []
            if job.piece >= len(job.pieces):
                self._jobs.popleft()  # the payload is let go here, on the device thread

    def _work_snapshot(self, job: _SnapshotJob) -> int:
        """Convert one layer of a snapshot; the last one sends the file to the writer."""
        snapshot = job.snapshot
        done = 0
        if job.layer < len(snapshot.layers):
            layout, arrays = _layer_state(job.layer, snapshot.layers[job.layer])
            for name, array in arrays:
                dtype, host = _host(array)
                layout.setdefault("shapes", {})[name] = list(array.shape)
                job.tensors.append((name, dtype, tuple(array.shape), host))
                done += host.nbytes
            job.layouts.append(layout)
            job.layer += 1
        if job.layer >= len(snapshot.layers):
            extra = {"family": snapshot.family, "layers": json.dumps(job.layouts, separators=(",", ":"))}
            self.tier.writer.submit(PieceData(spec=job.name, tensors=tuple(job.tensors),
                                              num_layers=len(snapshot.layers), extra=extra))
            self._jobs.popleft()
        return max(done, 1)

    def load_snapshot(self, name: SnapshotName) -> SessionSnapshot | None:
        """A session snapshot read back from disk, checked (None: refused or gone)."""
        started = time.perf_counter()
        try:
            metadata, layout, tensors = self.tier.reader.read_snapshot(name, self._num_layers)
            if self._family and metadata.get("family") != self._family:
                raise PieceRefused("shape", f"a {metadata.get('family')!r} snapshot for a {self._family!r} model")
            arrays = _load_verified(self.tier.reader.path(name.filename), [entry for entry, _ in tensors.values()])
            try:
                layers = [_layer_from(layer, arrays) for layer in layout]
            except (KeyError, ValueError, TypeError, IndexError) as error:
                raise PieceRefused("malformed", f"layer layout ({error})") from None
        except PieceRefused as error:
            self.tier.reader.refuse(name, error)
            return None
        except FileNotFoundError:
            self.tier.reader.vanished(name)
            self.tier.reader.record_miss()
            return None
        except OSError as error:
            logger.warning("prompt-cache disk tier: cannot read %s (%s)", name.filename, error.strerror or error)
            return None
        snapshot = SessionSnapshot(metadata["family"], layers, name.num_tokens)
        mx.eval(list(arrays.values()))
        nbytes = sum(buffer.nbytes for _entry, buffer in tensors.values())
        self.tier.reader.record_load(nbytes=nbytes, seconds=time.perf_counter() - started, tokens=name.num_tokens)
        return snapshot

    def flush(self, deadline_seconds: float = 10.0) -> None:
        """Shutting down: convert what is queued (within the deadline), then let the writer finish."""
        end = time.monotonic() + deadline_seconds
        while self._jobs and time.monotonic() < end:
            if self.tier.writer.has_room():
                self.work()
            else:
                time.sleep(0.01)
        if self._jobs:
            self.tier.drop(sum(len(job.pieces) - job.piece if isinstance(job, _Job) else 1 for job in self._jobs))
            self._jobs.clear()
        self.tier.close(max(1.0, end - time.monotonic()))

    # --- reading ---------------------------------------------------------------------------

    def load(self, plan: DiskPlan, memory: Any, prefill_seconds_per_token: float | None = None) -> DetachedKV | None:
        """The memory match's first plan.kept rows, then the plan's pieces, as one KV set (None: nothing read).

        The memory part keeps the memory entry's pieces (shared, not copied); each file read is a
        piece of its own. A refused or vanished piece ends the run there: what came before it is used.

        With the device's prefill rate known, reading stops where the rest would take longer to read,
        at the rate measured so far, than to prefill: on an H200 an 8B model prefills 32k tokens in
        about 1.3 s, while reading their 4 GiB back from the page cache took 7 s.
        """
        started = time.perf_counter()
        segments: list[tuple[KvPiece, int]] = list(memory.cut(plan.kept).segments) if plan.kept else []
        reference = dtype_of(memory) if plan.kept else None
        length, nbytes, verify_wait = plan.kept, 0, 0.0
        reads = self.tier.reader.read_ahead(plan.pieces, self._num_layers)
        try:
            for spec, future in zip(plan.pieces, reads, strict=True):
                try:
                    waited = time.perf_counter()
                    metadata, tensors = future.result()
                    verify_wait += time.perf_counter() - waited
                    arrays = _load_verified(self.tier.reader.path(spec.filename), [entry for entry, _ in tensors])
                    del tensors  # views of the mapped file: it is unmapped once these go
                    dtypes = {array.dtype for array in arrays.values() if array.dtype != mx.uint32}
                    if len(dtypes) != 1 or (reference is not None and reference not in dtypes):
                        raise PieceRefused("shape", f"dtypes {sorted(map(str, dtypes))} do not match the model's KV")
                    reference = next(iter(dtypes))
                    piece_layers, piece_format = _piece_layers(arrays, metadata, self._num_layers)
                except PieceRefused as error:
                    self.tier.reader.refuse(spec, error)
                    break
                except FileNotFoundError:
                    self.tier.reader.vanished(spec)
                    break
                except OSError as error:
                    logger.warning("prompt-cache disk tier: cannot read %s (%s)", spec.filename,
                                   error.strerror or error)
                    break
                # Read now, while the readers verify the next pieces. (Queuing several reads at once was
                # measured: MLX reads them one after another, docs/benchmarks.md.)
                mx.eval(list(arrays.values()))
                piece = KvPiece(piece_layers, spec.name.end_token - length, piece_format)
                segments.append((piece, spec.name.end_token - length))
                nbytes += sum(array.nbytes for array in arrays.values())
                length = spec.name.end_token
                read_seconds_per_token = (time.perf_counter() - started) / (length - plan.kept)
                if (prefill_seconds_per_token is not None and spec is not plan.pieces[-1]
                        and read_seconds_per_token > prefill_seconds_per_token):
                    self.tier.reader.record_cut_short()
                    logger.info("prompt-cache disk hit cut short after %d tokens: reading took %.3f ms a token, "
                                "prefilling takes %.3f", length, 1000 * read_seconds_per_token,
                                1000 * prefill_seconds_per_token)
                    break
        finally:
            reads.close()
        if length <= plan.memory_len:
            self.tier.reader.record_miss()
            return None
        detached = DetachedKV(segments)
        mx.eval(detached.arrays())
        seconds = time.perf_counter() - started
        self.tier.reader.record_load(nbytes=nbytes, seconds=seconds, tokens=length - plan.kept,
                                     verify_wait_seconds=verify_wait)
        logger.debug("prompt-cache disk hit: %d tokens (%d from memory), %d bytes read in %.1f ms "
                     "(%.1f ms of it waiting for checksums)", length, plan.kept, nbytes, 1000 * seconds,
                     1000 * verify_wait)
        return detached


def _piece_layers(arrays: dict[str, mx.array], metadata: dict[str, str], count: int
                  ) -> tuple[list[tuple[Any, Any]], StoreFormat]:
    """A piece's per-layer keys and values from its tensors (checked by check_piece), and its format."""
    bits = int(metadata.get("kv_bits", "0"))
    if not bits:
        return [(arrays[key], arrays[value]) for key, value in map(layer_names, range(count))], StoreFormat()
    layers = []
    for index in range(count):
        keys, values = quantized_names(index)
        layers.append((tuple(arrays[name] for name in keys), tuple(arrays[name] for name in values)))
    return layers, StoreFormat(bits, int(metadata["kv_group_size"]))


def _load_verified(path: Any, entries: list[TensorEntry]) -> dict[str, mx.array]:
    """A verified piece's tensors, read by MLX's own safetensors reader (lazy: read when evaluated).

    MLX reads the file into device memory in C++ without the GIL: on the H200 4.7 GB/s and resident on the
    GPU, against 2.1 GB/s for a copy per tensor out of the mapped file plus 7 GB/s for the GPU's first read
    of that copy (``benchmarks/disk_copy_options.py``). It reads the file again by its name; a piece is never
    rewritten in place (it is written under a temporary name, then renamed), so what it reads is what the
    reader threads verified, and each tensor is checked against the verified header.
    """
    try:
        loaded = mx.load(str(path))
    except RuntimeError as error:
        if not os.path.exists(path):
            raise FileNotFoundError(str(path)) from None
        raise PieceRefused("malformed", f"MLX cannot read it ({error})") from None
    assert isinstance(loaded, dict)
    arrays = {}
    for entry in entries:
        array = loaded.get(entry.name)
        if array is None or tuple(array.shape) != tuple(entry.shape) or _TO_SAFETENSORS.get(array.dtype) != entry.dtype:
            raise PieceRefused("malformed", f"tensor {entry.name} is not as its verified header says")
        arrays[entry.name] = array
    return arrays


def read_starts(disk: DeviceDisk | None, plan: StepPlan, prefill_seconds_per_token: float | None
                ) -> tuple[StepPlan, tuple[DiskReadDone, ...]]:
    """Run the plan's disk reads before its starts; returns the plan the executor runs and each read's outcome.

    A read that gives all the start was placed for becomes its ``adopted`` (or ``restore``); one that
    gives less, or nothing, takes the start out of this step (with its chunk alone, if it had one).
    """
    if not any(start.disk_read is not None for start in plan.starts):
        return plan, ()
    starts: list[Any] = []
    done: list[DiskReadDone] = []
    dropped: set[int] = set()
    for start in plan.starts:
        read = start.disk_read
        if read is None:
            starts.append(start)
            continue
        payload = disk.read(read, prefill_seconds_per_token) if disk is not None else None
        length = int(payload.length) if payload is not None else 0
        # What the start keeps of the read (an InsertBatch adopts all its cached tokens).
        kept = start.kept if isinstance(start, (StartDirect, StartAlone)) else len(start.cached_tokens)
        whole = payload is not None and length >= read.num_tokens and (
            read.snapshot or not kept or payload.can_adopt(kept))
        done.append(DiskReadDone(sequence_id=start.sequence_id, payload=payload, num_tokens=length, started=whole))
        if not whole:
            dropped.add(start.sequence_id)
        elif isinstance(start, StartAlone):
            starts.append(attrs.evolve(start, adopted=payload if kept else None, disk_read=None))
        elif read.snapshot:
            starts.append(attrs.evolve(start, restore=payload, disk_read=None))
        else:
            starts.append(attrs.evolve(start, adopted=payload if kept else None, disk_read=None))
    chunk, rest = plan.alone_chunk, plan.alone_rest
    if chunk is not None and chunk.sequence_id in dropped:
        chunk = None
    if rest is not None and rest.sequence_id in dropped:
        rest = None
    return attrs.evolve(plan, starts=tuple(starts), alone_chunk=chunk, alone_rest=rest), tuple(done)
