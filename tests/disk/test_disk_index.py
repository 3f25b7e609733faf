"""The disk tier's pure decisions: names, fingerprints, runs, the budget, the header, refusals."""

from __future__ import annotations

import pytest

from mlxcel.cache.key import CacheContext, RopeRegime
from mlxcel.disk import index as disk_index
from mlxcel.disk.index import (
    PIECE_BLOCKS,
    IndexedFile,
    PieceName,
    PieceRefused,
    PieceSpec,
    context_fingerprint,
    decode_header,
    encode_header,
    find_run,
    over_budget,
    parse_name,
    piece_ranges,
    pieces_of,
    stale_temp,
)

CONTEXT = CacheContext(model_id="m", template_sig="t")


def test_a_name_round_trips_and_other_files_are_not_pieces() -> None:
    name = PieceName(fingerprint="ab" * 16, first_block=16, end_block=32, chain_hash=bytes(range(32)))
    assert parse_name(name.filename) == name
    assert (name.first_token, name.end_token, name.num_tokens) == (256, 512, 256)
    temp = disk_index.temp_name(name.filename, 4242, "beef")
    assert parse_name(temp) is None
    assert disk_index.temp_owner(temp) == 4242
    assert parse_name("notes.txt") is None
    assert parse_name(name.filename.replace("0000032", "0000099")) is None  # longer than a piece


def test_the_fingerprint_changes_with_everything_that_changes_kv() -> None:
    base = context_fingerprint("model-a", CONTEXT, session_scoped=False)
    assert len(base) == 32
    assert context_fingerprint("model-a", CONTEXT, session_scoped=False) == base
    variants = [
        context_fingerprint("model-b", CONTEXT, session_scoped=False),
        context_fingerprint("model-a", CacheContext(model_id="m2", template_sig="t"), session_scoped=False),
        context_fingerprint("model-a", CacheContext(model_id="m", template_sig="t", lora_id="1"),
                            session_scoped=False),
        context_fingerprint("model-a", CacheContext(model_id="m", template_sig="u"), session_scoped=False),
        context_fingerprint("model-a", CacheContext(model_id="m", template_sig="t", cache_salt="s"),
                            session_scoped=False),
        context_fingerprint("model-a", CacheContext(model_id="m", template_sig="t", rope_regime=RopeRegime.LONG),
                            session_scoped=False),
        context_fingerprint("model-a", CacheContext(model_id="m", template_sig="t", mm_digest=b"\1" * 32),
                            session_scoped=False),
        context_fingerprint("model-a", CONTEXT, session_scoped=True),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # Sessions share files unless tenants are isolated.
    other_session = CacheContext(model_id="m", template_sig="t", session_key="bob")
    assert context_fingerprint("model-a", other_session, session_scoped=False) == base
    assert (context_fingerprint("model-a", other_session, session_scoped=True)
            != context_fingerprint("model-a", CONTEXT, session_scoped=True))


def test_pieces_are_aligned_runs_then_one_tail() -> None:
    assert piece_ranges(0) == []
    assert piece_ranges(5) == [(0, 5)]
    assert piece_ranges(16) == [(0, 16)]
    assert piece_ranges(37) == [(0, 16), (16, 32), (32, 37)]


def test_a_longer_prefix_reuses_the_shorter_ones_pieces() -> None:
    hasher = disk_index.new_hasher()
    tokens = list(range(1000))
    short = pieces_of("f" * 32, hasher.chain(tokens[:600], CONTEXT.mm_digest), hasher.root)
    long = pieces_of("f" * 32, hasher.chain(tokens, CONTEXT.mm_digest), hasher.root)
    assert [piece.filename for piece in short[:2]] == [piece.filename for piece in long[:2]]
    assert short[2].name.end_block == 600 // 16
    assert short[2].filename not in {piece.filename for piece in long}
    assert long[1].parent == long[0].name.chain_hash
    assert long[0].parent == hasher.root


def _run(stored: list[PieceSpec], tokens: list[int], start_block: int, cap_blocks: int) -> list[PieceSpec]:
    hasher = disk_index.new_hasher()
    names = {piece.filename for piece in stored}
    return find_run("f" * 32, lambda count: hasher.chain(tokens, CONTEXT.mm_digest, count), hasher.root,
                    start_block, cap_blocks, names.__contains__)


def test_a_lookup_finds_the_longest_run_that_chains_to_the_root() -> None:
    hasher = disk_index.new_hasher()
    tokens = list(range(1000))
    stored = pieces_of("f" * 32, hasher.chain(tokens[:600], CONTEXT.mm_digest), hasher.root)
    run = _run(stored, tokens, 0, 1000 // 16)
    assert [piece.name.end_block for piece in run] == [16, 32, 37]
    # Capped (the last prompt token is never cached): the tail does not fit, the aligned pieces do.
    assert [piece.name.end_block for piece in _run(stored, tokens, 0, 36)] == [16, 32]
    # From a piece boundary that memory covers.
    assert [piece.name.end_block for piece in _run(stored, tokens, 16, 1000 // 16)] == [32, 37]
    # A request that diverges in the second piece gets the first only.
    changed = tokens[:300] + [7] + tokens[301:]
    assert [piece.name.end_block for piece in _run(stored, changed, 0, 60)] == [16]
    # A hole: the walk stops there, whatever follows.
    assert _run(stored[1:], tokens, 0, 60) == []


def test_the_budget_deletes_the_least_recently_used_first() -> None:
    files = [IndexedFile(filename=f"f{index}", nbytes=100, last_used=float(index)) for index in range(5)]
    assert over_budget(files, 500) == []
    assert [item.filename for item in over_budget(files, 250)] == ["f0", "f1", "f2"]
    assert [item.filename for item in over_budget(reversed(files), 399)] == ["f0", "f1"]
    assert [item.filename for item in over_budget(files, 300, keep=frozenset({"f0"}))] == ["f1", "f2"]
    assert len(over_budget(files, 0)) == 5
    # Used in the same second: the deepest piece of a prefix goes first, its beginning stays.
    prefix = [IndexedFile(filename=f"p{depth}", nbytes=100, last_used=10.2 + depth / 100, depth=depth)
              for depth in (16, 32, 48)]
    assert [item.filename for item in over_budget(prefix, 150)] == ["p48", "p32"]
    assert disk_index.parent_piece(pieces_of("f" * 32, disk_index.new_hasher().chain(list(range(600)), b"\0" * 32),
                                             disk_index.new_hasher().root)[0]) is None


def test_a_temporary_file_is_stale_when_its_writer_is_gone() -> None:
    name = disk_index.temp_name("kv-x.safetensors", 77, "ab")
    assert stale_temp(name, 1.0, 1, alive=lambda pid: False)
    assert not stale_temp(name, 1.0, 1, alive=lambda pid: True)
    assert stale_temp(name, 7200.0, 1, alive=lambda pid: True)
    assert not stale_temp(name, 1.0, 77, alive=lambda pid: False)  # our own write in progress
    assert not stale_temp("kv-x.safetensors", 1e9, 1, alive=lambda pid: False)


def _spec() -> PieceSpec:
    name = PieceName(fingerprint="c" * 32, first_block=0, end_block=2, chain_hash=b"\2" * 32)
    return PieceSpec(name=name, parent=b"\1" * 32)


def _file(spec: PieceSpec, *, num_layers: int = 2, tokens: int = 32, dtype: str = "F32") -> tuple[bytes, dict]:
    tensors = []
    for index in range(num_layers):
        for name in disk_index.layer_names(index):
            tensors.append((name, dtype, (1, 2, tokens, 4), 2 * tokens * 4 * disk_index.DTYPE_SIZES[dtype]))
    metadata = disk_index.piece_metadata(spec, checksum="00", num_layers=num_layers)
    header = encode_header(tensors, metadata)
    return header + bytes(sum(size for *_rest, size in tensors)), metadata


def test_a_header_round_trips_and_passes_the_checks() -> None:
    spec = _spec()
    data, metadata = _file(spec)
    decoded, tensors, start = decode_header(data, len(data))
    assert decoded == metadata
    assert start % 8 == 0
    assert [entry.name for entry in tensors] == ["keys.0", "values.0", "keys.1", "values.1"]
    disk_index.check_piece(spec, decoded, tensors, num_layers=2)


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda data: data[:-10], "truncated"),
    (lambda data: data[:5], "truncated"),
    (lambda data: data + b"x", "malformed"),
    (lambda data: data[:8] + b"[" + data[9:], "malformed"),
])
def test_a_damaged_file_is_refused_by_name(damage, reason) -> None:
    data, _metadata = _file(_spec())
    broken = damage(data)
    with pytest.raises(PieceRefused) as refused:
        decode_header(broken, len(broken))
    assert refused.value.reason == reason


def test_a_file_for_another_piece_or_model_is_refused() -> None:
    spec = _spec()
    data, metadata = _file(spec)
    decoded, tensors, _start = decode_header(data, len(data))
    other = PieceSpec(name=PieceName(fingerprint="d" * 32, first_block=0, end_block=2, chain_hash=b"\2" * 32),
                      parent=spec.parent)
    with pytest.raises(PieceRefused, match="fingerprint"):
        disk_index.check_piece(other, decoded, tensors, num_layers=2)
    with pytest.raises(PieceRefused) as refused:
        disk_index.check_piece(spec, decoded, tensors, num_layers=3)
    assert refused.value.reason == "shape"
    wrong_tokens, _ = _file(spec, tokens=31)
    decoded, tensors, _start = decode_header(wrong_tokens, len(wrong_tokens))
    with pytest.raises(PieceRefused) as refused:
        disk_index.check_piece(spec, decoded, tensors, num_layers=2)
    assert refused.value.reason == "shape"
    assert PIECE_BLOCKS * disk_index.BLOCK_TOKENS == disk_index.PIECE_TOKENS


def test_a_donation_also_writes_a_piece_ending_at_its_prompt() -> None:
    hasher = disk_index.new_hasher()
    tokens = list(range(700))
    chain = hasher.chain(tokens, CONTEXT.mm_digest)
    ends = [piece.name.end_block for piece in pieces_of("f" * 32, chain, hasher.root, prompt_blocks=20)]
    assert ends == [16, 32, 43, 20]
    # The next turn resends the prompt and re-renders the reply: the prompt's piece is what it finds.
    next_turn = tokens[:320] + [9] * 200
    stored = pieces_of("f" * 32, chain, hasher.root, prompt_blocks=20)
    assert [piece.name.end_block for piece in _run(stored, next_turn, 0, 32)] == [16, 20]
    # Aligned prompts and prompts past the end need no extra piece.
    assert len(pieces_of("f" * 32, chain, hasher.root, prompt_blocks=16)) == 3
    assert len(pieces_of("f" * 32, chain, hasher.root, prompt_blocks=43)) == 3
