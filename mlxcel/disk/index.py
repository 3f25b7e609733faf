"""The disk tier's pure logic: piece naming, fingerprints, the file format's header, the budget decision.

A *piece* is the KV of a run of whole blocks ``[first_block, end_block)`` of a
stored prefix. It is named by the fingerprint of everything that changes KV
(the model's weights and tokenizer, the cache key's bucket, the RoPE regime,
the multimodal digest) and by the block-hash chain hash of its last block,
which commits to every token before it. The name is therefore the same in
every process and after every restart, and two processes that store the
same prefix write the same file.

Pieces are aligned: piece k covers blocks ``[16k, 16k + 16)`` (256 tokens),
plus at most one shorter *tail* piece at the end of a stored prefix. Aligned
runs give stable names whatever length each donation had (a later, longer
donation reuses the earlier pieces instead of writing overlapping ones),
files of a useful size (32 MiB for an 8B model in bf16, not 2 MiB per
16-token block), and a lookup of one existence check per piece.

No I/O, no MLX, no Trio: the directory is read and written by
``mlxcel.disk.tier``; this module only decides.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import blake3

from mlxcel.cache.apc import BlockHasher, HashAlgorithm
from mlxcel.cache.key import CacheContext, length_prefixed, pack_tokens

FORMAT = "mlxcel-kv-v1"
FINGERPRINT_DOMAIN = b"mlxcel:disk-tier:context:v1"
MODEL_DOMAIN = b"mlxcel:disk-tier:model:v1"
SNAPSHOT_DOMAIN = b"mlxcel:disk-tier:snapshot:v1"
# The disk tier's own block chain: independent of --apc-* so a changed APC setting keeps the files valid.
BLOCK_TOKENS = 16
PIECE_BLOCKS = 16
PIECE_TOKENS = BLOCK_TOKENS * PIECE_BLOCKS
HASH_ALGORITHM: HashAlgorithm = "sha256"
SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
# The advisory lock every writing process takes around its budget check and rename.
LOCK_NAME = ".lock"
FINGERPRINT_CHARS = 32

# Why a file was refused (and deleted) instead of loaded.
REFUSAL_REASONS = ("truncated", "malformed", "fingerprint", "shape", "checksum")

_NAME = re.compile(r"^kv-([0-9a-f]{32})-(\d{7})-(\d{7})-([0-9a-f]{64})\.safetensors$")
_SNAPSHOT_NAME = re.compile(r"^snap-([0-9a-f]{32})-(\d{9})-([0-9a-f]{64})\.safetensors$")
_TEMP = re.compile(r"^\.tmp-(\d+)-[0-9a-f]+-")
_PIN_NAME = re.compile(r"^pin-([0-9a-f]{32})-(\d{7})-([0-9a-f]{64})$")
_HEADER_LENGTH = struct.Struct("<Q")
# A header larger than this is not one of ours (64 layers x 2 tensors take ~10 KiB).
MAX_HEADER_BYTES = 16 << 20

DTYPE_SIZES: Mapping[str, int] = {"F32": 4, "F16": 2, "BF16": 2}
# Quantized pieces (--prompt-cache-kv-bits): the packed values, and beside them scales and biases.
PACKED_DTYPE = "U32"
QUANTIZED_PARTS = ("packed", "scales", "biases")


class PieceRefused(Exception):
    """A file that must not be loaded; ``reason`` is one of REFUSAL_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REFUSAL_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def new_hasher() -> BlockHasher:
    return BlockHasher(algorithm=HASH_ALGORITHM, block_size=BLOCK_TOKENS)


# --- fingerprints ------------------------------------------------------------------------


def model_fingerprint(parts: Iterable[tuple[str, bytes]]) -> str:
    """Hex digest of named facts about a model (weights' identity, dtype, tokenizer files, adapters)."""
    hasher = blake3.blake3(MODEL_DOMAIN)
    for name, data in sorted(parts):
        hasher.update(length_prefixed(name.encode("utf-8")))
        hasher.update(length_prefixed(data))
    return hasher.hexdigest()


def context_fingerprint(model: str, context: CacheContext, *, session_scoped: bool) -> str:
    """The 32-hex fingerprint a piece's name starts with: the model and the context's bucket.

    ``session_scoped`` (tenant isolation: no cross-session reuse) puts the
    session key in too, so one session's files never serve another.
    """
    hasher = blake3.blake3(FINGERPRINT_DOMAIN)
    for part in (model, FORMAT, HASH_ALGORITHM, *context.bucket):
        hasher.update(length_prefixed(part.encode("utf-8")))
    rope = b"\x00\x00" if context.rope_regime is None else bytes((1, int(context.rope_regime)))
    hasher.update(rope)
    hasher.update(context.mm_digest)
    hasher.update(length_prefixed(context.session_key.encode("utf-8") if session_scoped else b""))
    hasher.update(bytes((session_scoped,)))
    return hasher.hexdigest()[:FINGERPRINT_CHARS]


# --- names -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PieceName:
    fingerprint: str
    first_block: int
    end_block: int
    # The chain hash of block end_block - 1: it commits to every token of [0, end_block).
    chain_hash: bytes

    @property
    def filename(self) -> str:
        return (f"kv-{self.fingerprint}-{self.first_block:07d}-{self.end_block:07d}-"
                f"{self.chain_hash.hex()}{SUFFIX}")

    @property
    def first_token(self) -> int:
        return self.first_block * BLOCK_TOKENS

    @property
    def end_token(self) -> int:
        return self.end_block * BLOCK_TOKENS

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.first_token


@attrs.frozen(kw_only=True)
class PieceSpec:
    """A piece to write or read: its name and its parent (the chain hash of the block before it)."""

    name: PieceName
    parent: bytes

    @property
    def filename(self) -> str:
        return self.name.filename


@attrs.frozen(kw_only=True)
class DiskPlan:
    """A disk hit: the first ``kept`` tokens from the memory match, then ``pieces`` from disk."""

    pieces: tuple[PieceSpec, ...]
    kept: int
    num_tokens: int
    memory_len: int
    # A retained prompt ends where the plan does: pin the loaded prefix for this many more seconds.
    retain_seconds: float = 0.0


@attrs.frozen(kw_only=True)
class SnapshotName:
    """A session snapshot on disk: the whole state after exactly num_tokens tokens."""

    fingerprint: str
    num_tokens: int
    # snapshot_digest of its tokens.
    digest: bytes

    @property
    def filename(self) -> str:
        return f"snap-{self.fingerprint}-{self.num_tokens:09d}-{self.digest.hex()}{SUFFIX}"


@attrs.frozen(kw_only=True)
class PieceData:
    """A piece's (or a snapshot's) tensors in host memory, in file order: (name, dtype, shape, buffer)."""

    spec: PieceSpec | SnapshotName
    tensors: tuple[tuple[str, str, tuple[int, ...], Any], ...] = attrs.field(repr=False)
    num_layers: int
    # A snapshot's layer layout and family (snapshot_metadata's fields), as metadata strings.
    extra: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(memoryview(buffer).nbytes for *_rest, buffer in self.tensors)



def snapshot_digest(chain: Sequence[bytes], root: bytes, tokens: Sequence[int]) -> bytes:
    """A snapshot's digest from the tokens' block chain (its whole blocks) and the tokens after the last one.

    Computed from the request's chain, so checking every stored snapshot
    length against one request costs a hash of at most 15 tokens each.
    """
    whole = len(tokens) // BLOCK_TOKENS
    hasher = blake3.blake3(SNAPSHOT_DOMAIN)
    hasher.update(chain[whole - 1] if whole else root)
    hasher.update(struct.pack("<Q", len(tokens)))
    hasher.update(pack_tokens(tokens[whole * BLOCK_TOKENS :]))
    return hasher.digest()


def parse_snapshot_name(filename: str) -> SnapshotName | None:
    match = _SNAPSHOT_NAME.match(filename)
    if match is None or int(match[2]) < 1:
        return None
    return SnapshotName(fingerprint=match[1], num_tokens=int(match[2]), digest=bytes.fromhex(match[3]))


def parse_name(filename: str) -> PieceName | None:
    """The piece a file name stands for; None for anything else (temporary files included)."""
    match = _NAME.match(filename)
    if match is None:
        return None
    first, end = int(match[2]), int(match[3])
    if not 0 <= first < end or end - first > PIECE_BLOCKS:
        return None
    return PieceName(fingerprint=match[1], first_block=first, end_block=end, chain_hash=bytes.fromhex(match[4]))


def pin_name(fingerprint: str, end_block: int, chain_hash: bytes) -> str:
    """The empty file whose mtime is when the retention of a prefix ending at end_block runs out.

    A retained prompt (cache_control, prompt_cache_retention) is pinned in memory; this record lets
    a server that reads the prefix back from disk after a restart pin it again for the time left.
    """
    return f"pin-{fingerprint}-{end_block:07d}-{chain_hash.hex()}"


def is_pin_name(filename: str) -> bool:
    return _PIN_NAME.match(filename) is not None


def parent_piece(spec: PieceSpec) -> str | None:
    """The file name of the piece that ends where this one begins (None: it begins at the root)."""
    first = spec.name.first_block
    if first == 0:
        return None
    return PieceName(fingerprint=spec.name.fingerprint, first_block=first - PIECE_BLOCKS, end_block=first,
                     chain_hash=spec.parent).filename


def temp_name(filename: str, pid: int, token: str) -> str:
    """Where a piece is written before it is renamed into place."""
    return f"{TEMP_PREFIX}{pid}-{token}-{filename}"


def temp_owner(filename: str) -> int | None:
    """The pid that wrote a temporary file; None if the name is not a temporary file's."""
    match = _TEMP.match(filename)
    return int(match[1]) if match else None


def piece_ranges(num_blocks: int, start_block: int = 0) -> list[tuple[int, int]]:
    """The aligned pieces of a prefix of num_blocks whole blocks from start_block, then its tail."""
    ranges = []
    first = start_block - start_block % PIECE_BLOCKS
    while first + PIECE_BLOCKS <= num_blocks:
        ranges.append((first, first + PIECE_BLOCKS))
        first += PIECE_BLOCKS
    if first < num_blocks:
        ranges.append((first, num_blocks))
    return ranges


def pieces_of(fingerprint: str, chain: Sequence[bytes], root: bytes, prompt_blocks: int | None = None
              ) -> list[PieceSpec]:
    """Every piece of a stored prefix whose chain (of whole blocks) is chain.

    With ``prompt_blocks`` (the donating request's prompt, in whole blocks),
    one more tail piece ends there: the next turn of a conversation resends
    that prompt but re-renders the reply, so its tokens part from the stored
    ones inside the reply, and the prompt's own tail is what it can reuse.
    """
    ranges = piece_ranges(len(chain))
    if prompt_blocks is not None and 0 < prompt_blocks < len(chain) and prompt_blocks % PIECE_BLOCKS:
        ranges.append((prompt_blocks - prompt_blocks % PIECE_BLOCKS, prompt_blocks))
    return [
        PieceSpec(
            name=PieceName(fingerprint=fingerprint, first_block=first, end_block=end, chain_hash=chain[end - 1]),
            parent=chain[first - 1] if first else root,
        )
        for first, end in ranges
    ]


def find_run(
    fingerprint: str,
    chain_up_to: Callable[[int], Sequence[bytes]],
    root: bytes,
    start_block: int,
    cap_blocks: int,
    exists: Callable[[str], bool],
) -> list[PieceSpec]:
    """The longest run of stored pieces from start_block (a piece boundary) within cap_blocks.

    ``chain_up_to(n)`` gives the request's first n chain hashes (computed
    only as far as the walk goes). Aligned pieces first, one existence
    check each; then the longest tail piece after the last of them.
    """
    assert start_block % PIECE_BLOCKS == 0
    run: list[PieceSpec] = []
    first = start_block

    def spec(first: int, end: int) -> PieceSpec:
        chain = chain_up_to(end)
        return PieceSpec(
            name=PieceName(fingerprint=fingerprint, first_block=first, end_block=end, chain_hash=chain[end - 1]),
            parent=chain[first - 1] if first else root,
        )

    while first + PIECE_BLOCKS <= cap_blocks:
        piece = spec(first, first + PIECE_BLOCKS)
        if not exists(piece.filename):
            break
        run.append(piece)
        first += PIECE_BLOCKS
    for end in range(min(first + PIECE_BLOCKS - 1, cap_blocks), first, -1):
        piece = spec(first, end)
        if exists(piece.filename):
            run.append(piece)
            break
    return run


# --- the budget ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class IndexedFile:
    filename: str
    nbytes: int
    # The file's mtime: touched on every hit, so it is its last use.
    last_used: float
    # The piece's end block: of pieces used in the same second, the deepest goes first.
    depth: int = 0


def over_budget(
    files: Iterable[IndexedFile], budget_bytes: int, keep: frozenset[str] = frozenset()
) -> list[IndexedFile]:
    """The least recently used files to delete so the rest fit budget_bytes (``keep`` stays).

    A prefix's pieces are written and touched together, and a piece is
    useless without those before it, so among pieces last used in the same
    second the deepest goes first: the budget keeps a prefix's beginning.
    """
    ordered = sorted(files, key=lambda item: (int(item.last_used), -item.depth, item.last_used, item.filename))
    total = sum(item.nbytes for item in ordered)
    doomed = []
    for item in ordered:
        if total <= budget_bytes:
            break
        if item.filename in keep:
            continue
        doomed.append(item)
        total -= item.nbytes
    return doomed


def stale_temp(filename: str, age_seconds: float, pid: int, alive: Callable[[int], bool],
               max_age_seconds: float = 3600.0) -> bool:
    """A temporary file left by a writer that is gone (or far too old to be a write in progress)."""
    owner = temp_owner(filename)
    if owner is None:
        return False
    if owner == pid:
        return age_seconds > max_age_seconds
    return age_seconds > max_age_seconds or not alive(owner)


# --- the file format: safetensors with our metadata -----------------------------------------


@attrs.frozen(kw_only=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def encode_header(tensors: Sequence[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str]) -> bytes:
    """A safetensors header (length prefix, JSON, space padding) for tensors laid out in order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)
    return _HEADER_LENGTH.pack(len(text)) + text


def header_length(prefix: bytes) -> int:
    if len(prefix) < 8:
        raise PieceRefused("truncated", "shorter than a header")
    (length,) = _HEADER_LENGTH.unpack_from(prefix)
    if length > MAX_HEADER_BYTES:
        raise PieceRefused("malformed", f"a {length}-byte header")
    return length


def decode_header(data: bytes | memoryview, file_size: int) -> tuple[dict[str, str], list[TensorEntry], int]:
    """Metadata, tensors (offsets from the data start) and where the data starts; refuses a bad header."""
    length = header_length(bytes(data[:8]))
    if len(data) < 8 + length:
        raise PieceRefused("truncated", "the header is cut short")
    try:
        header = json.loads(bytes(data[8 : 8 + length]))
        metadata = header.pop("__metadata__")
        tensors = [
            TensorEntry(name=name, dtype=str(entry["dtype"]), shape=tuple(int(size) for size in entry["shape"]),
                        start=int(entry["data_offsets"][0]), end=int(entry["data_offsets"][1]))
            for name, entry in header.items()
        ]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as error:
        raise PieceRefused("malformed", f"unreadable header ({error})") from None
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise PieceRefused("malformed", "metadata is not a string map")
    tensors.sort(key=lambda entry: entry.start)
    data_size = file_size - 8 - length
    expected = max((entry.end for entry in tensors), default=0)
    if data_size < expected:
        raise PieceRefused("truncated", f"{data_size} data bytes of {expected}")
    if data_size > expected:
        raise PieceRefused("malformed", f"{data_size - expected} bytes past the last tensor")
    return metadata, tensors, 8 + length


def piece_metadata(spec: PieceSpec, *, checksum: str, num_layers: int) -> dict[str, str]:
    name = spec.name
    return {
        "format": FORMAT,
        "fingerprint": name.fingerprint,
        "first_block": str(name.first_block),
        "end_block": str(name.end_block),
        "block_tokens": str(BLOCK_TOKENS),
        "chain_hash": name.chain_hash.hex(),
        "parent": spec.parent.hex(),
        "num_layers": str(num_layers),
        "checksum": checksum,
    }


def layer_names(index: int) -> tuple[str, str]:
    return f"keys.{index}", f"values.{index}"


def quantized_names(index: int) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """A quantized layer's tensors: keys' and values' (packed, scales, biases)."""
    return (tuple(f"keys.{index}.{part}" for part in QUANTIZED_PARTS),  # type: ignore[return-value]
            tuple(f"values.{index}.{part}" for part in QUANTIZED_PARTS))


def quantization_metadata(bits: int, group_size: int) -> dict[str, str]:
    return {"kv_bits": str(bits), "kv_group_size": str(group_size)} if bits else {}


def _check_size(tensor_name: str, entry: TensorEntry, allowed: Iterable[str]) -> None:
    if entry.dtype not in allowed:
        raise PieceRefused("shape", f"{tensor_name} has dtype {entry.dtype}")
    count = 1
    for dim in entry.shape:
        count *= dim
    if entry.end - entry.start != count * (4 if entry.dtype == PACKED_DTYPE else DTYPE_SIZES[entry.dtype]):
        raise PieceRefused("shape", f"{tensor_name} holds {entry.end - entry.start} bytes for shape {entry.shape}")


def check_piece(spec: PieceSpec, metadata: Mapping[str, str], tensors: Sequence[TensorEntry],
                num_layers: int | None, kv_bits: int = 0, kv_group_size: int = 64) -> None:
    """Refuse a file whose metadata or shapes do not match the piece it is named for (checksum aside)."""
    name = spec.name
    expected = piece_metadata(spec, checksum=metadata.get("checksum", ""),
                              num_layers=int(metadata.get("num_layers", "0") or 0))
    if metadata.get("format") != FORMAT:
        raise PieceRefused("fingerprint", f"format {metadata.get('format')!r}")
    for field in ("fingerprint", "chain_hash", "parent"):
        if metadata.get(field) != expected[field]:
            raise PieceRefused("fingerprint", f"{field} {metadata.get(field)!r} is not {expected[field]!r}")
    for field in ("first_block", "end_block", "block_tokens"):
        if metadata.get(field) != expected[field]:
            raise PieceRefused("shape", f"{field} {metadata.get(field)!r} is not {expected[field]!r}")
    layers = int(expected["num_layers"])
    if num_layers is not None and layers != num_layers:
        raise PieceRefused("shape", f"{layers} layers, the model has {num_layers}")
    stored = quantization_metadata(kv_bits, kv_group_size)
    found = {field: metadata[field] for field in ("kv_bits", "kv_group_size") if field in metadata}
    if found != stored:
        raise PieceRefused("fingerprint", f"stored KV {found or 'exact'}, this server keeps {stored or 'exact'}")
    by_name = {entry.name: entry for entry in tensors}
    per_layer = 6 if kv_bits else 2
    if len(by_name) != per_layer * layers:
        raise PieceRefused("shape", f"{len(by_name)} tensors for {layers} layers")

    def entry_of(tensor_name: str) -> TensorEntry:
        entry = by_name.get(tensor_name)
        if entry is None:
            raise PieceRefused("shape", f"no tensor {tensor_name}")
        shape = entry.shape
        if len(shape) != 4 or shape[0] != 1 or shape[2] != name.num_tokens:
            raise PieceRefused("shape", f"{tensor_name} has shape {shape} for {name.num_tokens} tokens")
        return entry

    for index in range(layers):
        if not kv_bits:
            for tensor_name in layer_names(index):
                _check_size(tensor_name, entry_of(tensor_name), DTYPE_SIZES)
            continue
        for packed_name, scales_name, biases_name in quantized_names(index):
            packed, scales, biases = entry_of(packed_name), entry_of(scales_name), entry_of(biases_name)
            _check_size(packed_name, packed, (PACKED_DTYPE,))
            _check_size(scales_name, scales, DTYPE_SIZES)
            _check_size(biases_name, biases, DTYPE_SIZES)
            head_dim = packed.shape[3] * 32 // kv_bits
            if (scales.shape != biases.shape or scales.shape[:3] != packed.shape[:3]
                    or scales.shape[3] * kv_group_size != head_dim):
                raise PieceRefused("shape", f"{packed_name} {packed.shape} and its scales {scales.shape} do not "
                                   f"make {kv_bits}-bit groups of {kv_group_size}")


# --- snapshot files ------------------------------------------------------------------------


def snapshot_metadata(name: SnapshotName, *, checksum: str, extra: Mapping[str, str]) -> dict[str, str]:
    return {
        **extra,
        "format": FORMAT,
        "kind": "snapshot",
        "fingerprint": name.fingerprint,
        "num_tokens": str(name.num_tokens),
        "digest": name.digest.hex(),
        "checksum": checksum,
    }


def check_snapshot(name: SnapshotName, metadata: Mapping[str, str], tensors: Sequence[TensorEntry],
                   num_layers: int | None) -> list[dict[str, Any]]:
    """Refuse a snapshot file that is not the one its name says; returns its layer layout."""
    if metadata.get("format") != FORMAT or metadata.get("kind") != "snapshot":
        raise PieceRefused("fingerprint", f"format {metadata.get('format')!r}, kind {metadata.get('kind')!r}")
    for field, expected in (("fingerprint", name.fingerprint), ("digest", name.digest.hex())):
        if metadata.get(field) != expected:
            raise PieceRefused("fingerprint", f"{field} {metadata.get(field)!r} is not {expected!r}")
    if metadata.get("num_tokens") != str(name.num_tokens):
        raise PieceRefused("shape", f"num_tokens {metadata.get('num_tokens')!r} is not {name.num_tokens}")
    try:
        layout = json.loads(metadata["layers"])
    except (KeyError, ValueError):
        layout = None
    if not isinstance(layout, list) or not all(isinstance(layer, dict) for layer in layout):
        raise PieceRefused("malformed", "no readable layer layout")
    if num_layers is not None and len(layout) != num_layers:
        raise PieceRefused("shape", f"{len(layout)} layers, the model has {num_layers}")
    names = {entry.name for entry in tensors}
    for entry in tensors:
        if entry.dtype not in DTYPE_SIZES:
            raise PieceRefused("shape", f"{entry.name} has dtype {entry.dtype}")
        count = 1
        for dim in entry.shape:
            count *= dim
        if entry.end - entry.start != count * DTYPE_SIZES[entry.dtype]:
            raise PieceRefused("shape", f"{entry.name} holds {entry.end - entry.start} bytes for shape {entry.shape}")
    wanted = {tensor for layer in layout for tensor in layer.get("tensors", [])}
    if wanted != names:
        raise PieceRefused("shape", f"tensors {sorted(names ^ wanted)[:4]} do not match the layout")
    return layout
