"""The disk tier's device half with a real directory: write, index, probe, load, and each fault."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.cache.key import CacheContext
from mlxcel.disk import index as disk_index, writer as disk_writer_module
from mlxcel.disk.device import DeviceDisk, rows
from mlxcel.disk.directory import DiskSettings
from mlxcel.disk.tier import DiskTier
from mlxcel.model.kv import DetachedKV

pytestmark = pytest.mark.slow

CONTEXT = CacheContext(model_id="m", template_sig="t")
TOKENS = tuple(range(100, 700))  # 600 tokens: pieces of blocks [0, 16), [16, 32), [32, 37)
LAYERS = 2


def payload(length: int = len(TOKENS), dtype=mx.float32, seed: int = 0) -> DetachedKV:
    generator = np.random.default_rng(seed)
    layers = []
    for _index in range(LAYERS):
        keys, values = (mx.array(generator.standard_normal((1, 2, length, 4), dtype=np.float32)).astype(dtype)
                        for _ in range(2))
        layers.append((keys, values))
    detached = DetachedKV.whole(layers, length)
    mx.eval(detached.arrays())
    return detached


def open_tier(directory: Path, model: str = "model-a", **changes) -> DiskTier:
    settings = DiskSettings(directory=directory, budget_bytes=changes.pop("budget_bytes", 1 << 30),
                            write_bytes_per_second=1 << 30, **changes)
    tier = DiskTier(settings, model)
    tier.open()
    return tier


def write(tier: DiskTier, stored: DetachedKV, tokens=TOKENS) -> None:
    """Plan, convert and write every piece, then stop the writer (it has written everything)."""
    device = DeviceDisk(tier, LAYERS)
    device.persist(stored, tier.plan_write(CONTEXT, tokens), urgent=False)
    while device.has_work():
        device.work()
    tier.close()


def pieces(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if disk_index.parse_name(path.name))


def entries(directory: Path) -> list[str]:
    """What is in the directory besides the writers' lock file."""
    return [path.name for path in directory.iterdir() if path.name != disk_index.LOCK_NAME]


def assert_rows_equal(loaded: DetachedKV, stored: DetachedKV, length: int) -> None:
    assert loaded.length == length
    for (keys, values), (want_keys, want_values) in zip(rows(loaded, 0, length), rows(stored, 0, length), strict=True):
        assert np.array_equal(np.array(keys.astype(mx.float32)), np.array(want_keys.astype(mx.float32)))
        assert np.array_equal(np.array(values.astype(mx.float32)), np.array(want_values.astype(mx.float32)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_pieces_round_trip_and_a_new_process_finds_them(tmp_path: Path, dtype) -> None:
    stored = payload(dtype=dtype)
    write(open_tier(tmp_path), stored)
    assert [disk_index.parse_name(path.name).end_block for path in pieces(tmp_path)] == [16, 32, 37]
    # A new tier on the same directory (a restart, or another process) indexes and loads them.
    tier = open_tier(tmp_path)
    assert tier.statistics().entries == 3
    request = (*TOKENS, 1, 2, 3)
    plan = tier.probe(CONTEXT, request, len(request) - 1, 0)
    assert plan is not None
    assert plan.num_tokens == 592
    assert plan.kept == 0
    loaded = DeviceDisk(tier, LAYERS).load(plan, None)
    assert loaded is not None
    assert_rows_equal(loaded, stored, 592)
    stats = tier.statistics()
    assert (stats.hits, stats.tokens_loaded) == (1, 592)
    assert stats.bytes_read > 0
    assert stats.load_seconds > 0
    assert 0 <= stats.verify_wait_seconds <= stats.load_seconds
    # Nothing left to write: every piece is there.
    assert tier.plan_write(CONTEXT, TOKENS) == ()


def test_reading_stops_where_prefilling_the_rest_is_faster(tmp_path: Path) -> None:
    stored = payload()
    write(open_tier(tmp_path), stored)
    tier = open_tier(tmp_path)
    request = (*TOKENS, 1, 2, 3)
    plan = tier.probe(CONTEXT, request, len(request) - 1, 0)
    assert plan is not None
    assert len(plan.pieces) == 3
    # Prefilling costs next to nothing: the first piece is read (it measures the disk), then no more.
    cut = DeviceDisk(tier, LAYERS).load(plan, None, prefill_seconds_per_token=1e-12)
    assert cut is not None
    assert_rows_equal(cut, stored, 256)
    assert tier.statistics().loads_cut_short == 1
    # Prefilling is slow (a Mac prefilling a long agent prompt): every piece is read.
    whole = DeviceDisk(tier, LAYERS).load(plan, None, prefill_seconds_per_token=10.0)
    assert whole is not None
    assert whole.length == 592
    assert tier.statistics().loads_cut_short == 1


def test_memory_supplies_the_rows_up_to_its_last_piece_boundary(tmp_path: Path) -> None:
    stored = payload()
    write(open_tier(tmp_path), stored)
    tier = open_tier(tmp_path)
    memory = DetachedKV.whole(rows(stored, 0, 300), 300)
    plan = tier.probe(CONTEXT, TOKENS, len(TOKENS) - 1, memory_len=300)
    assert plan is not None
    assert plan.kept == 256
    assert [piece.name.end_block for piece in plan.pieces] == [32, 37]
    assert_rows_equal(DeviceDisk(tier, LAYERS).load(plan, memory), stored, 592)
    # Memory already has everything disk has: no plan, a disk miss.
    assert tier.probe(CONTEXT, TOKENS, len(TOKENS) - 1, memory_len=592) is None
    assert tier.probe(CacheContext(model_id="other", template_sig="t"), TOKENS, 599, 0) is None
    assert tier.statistics().misses == 1


def _damage_second_piece(directory: Path, how: str) -> Path:
    target = pieces(directory)[1]
    data = target.read_bytes()
    if how == "truncated":
        target.write_bytes(data[: len(data) - 100])
    elif how == "checksum":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    return target


@pytest.mark.parametrize("how", ["truncated", "checksum"])
def test_a_damaged_piece_is_refused_deleted_and_the_run_stops_before_it(tmp_path: Path, how, caplog) -> None:
    stored = payload()
    write(open_tier(tmp_path), stored)
    target = _damage_second_piece(tmp_path, how)
    tier = open_tier(tmp_path)
    plan = tier.probe(CONTEXT, TOKENS, 599, 0)
    with caplog.at_level(logging.WARNING):
        loaded = DeviceDisk(tier, LAYERS).load(plan, None)
    assert_rows_equal(loaded, stored, 256)  # the first piece only: nothing corrupt is loaded
    assert not target.exists()
    assert tier.statistics().refusals[how] == 1
    assert any(f"refused {target.name} ({how}" in record.getMessage() for record in caplog.records)


def test_a_file_of_another_model_under_this_name_is_refused(tmp_path: Path) -> None:
    other_dir = tmp_path / "other"
    write(open_tier(other_dir, model="model-b"), payload(seed=1))
    write(open_tier(tmp_path, model="model-a"), payload())
    # Another model's first piece, copied over this model's first piece.
    ours, theirs = pieces(tmp_path)[0], pieces(other_dir)[0]
    ours.write_bytes(theirs.read_bytes())
    tier = open_tier(tmp_path)
    assert DeviceDisk(tier, LAYERS).load(tier.probe(CONTEXT, TOKENS, 599, 0), None) is None
    assert tier.statistics().refusals["fingerprint"] == 1
    assert not ours.exists()


def test_a_new_piece_never_makes_room_by_deleting_a_piece_it_extends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The budget orders pieces by the second of their last use. A prefix whose pieces are written across a
    second's turn (forced here: the writer's clock runs 5 s ahead of the files' times) must not delete its own
    earlier pieces for its next one: the tail, which needs them, is the piece that does not fit."""
    real_time = disk_writer_module.time.time
    monkeypatch.setattr(disk_writer_module.time, "time", lambda: real_time() + 5.0)
    piece_bytes = LAYERS * 2 * (2 * 256 * 4 * 4)
    write(open_tier(tmp_path, budget_bytes=int(2.2 * piece_bytes)), payload())
    assert [disk_index.parse_name(path.name).end_block for path in pieces(tmp_path)] == [16, 32]


def test_a_piece_that_vanishes_is_a_miss_not_an_error(tmp_path: Path) -> None:
    write(open_tier(tmp_path), payload())
    tier = open_tier(tmp_path)
    plan = tier.probe(CONTEXT, TOKENS, 599, 0)
    pieces(tmp_path)[0].unlink()  # another process evicted it meanwhile
    assert DeviceDisk(tier, LAYERS).load(plan, None) is None
    stats = tier.statistics()
    assert (stats.vanished, stats.misses, stats.hits) == (1, 1, 0)


def test_the_budget_keeps_the_most_recently_used_pieces(tmp_path: Path) -> None:
    stored = payload()
    piece_bytes = LAYERS * 2 * (2 * 256 * 4 * 4)
    write(open_tier(tmp_path, budget_bytes=int(1.5 * piece_bytes)), stored)
    left = pieces(tmp_path)
    # The second piece does not fit beside the first, which it would need: it is not written, nor the
    # tail after it (it could never be reached). The prefix's beginning stays.
    assert sum(path.stat().st_size for path in left) <= 1.5 * piece_bytes
    assert [disk_index.parse_name(path.name).end_block for path in left] == [16]
    # Used again later, its first piece stays and an older prefix's pieces go instead.
    other = payload(seed=3)
    write(open_tier(tmp_path, budget_bytes=int(1.5 * piece_bytes)), other, tokens=tuple(range(1000, 1600)))
    assert len(pieces(tmp_path)) == 1
    # A budget smaller than one piece: nothing is written, and it says so.
    tiny = tmp_path / "tiny"
    tier = open_tier(tiny, budget_bytes=1000)
    write(tier, stored)
    assert pieces(tiny) == []
    assert tier.statistics().writes_dropped == 3


def test_a_full_disk_leaves_no_file_behind(tmp_path: Path, monkeypatch, caplog) -> None:
    def no_space(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_writer_module.os, "fsync", no_space)
    tier = open_tier(tmp_path)
    with caplog.at_level(logging.WARNING):
        write(tier, payload())
    assert entries(tmp_path) == []  # neither pieces nor temporary files
    # The first piece fails; the others are not even tried, as they need it.
    assert tier.statistics().write_errors == 1
    assert tier.statistics().writes_dropped == 2
    assert sum("No space left" in record.getMessage() for record in caplog.records) == 1  # one line, not three


def test_an_unwritable_directory_is_read_only(tmp_path: Path, monkeypatch, caplog) -> None:
    write(open_tier(tmp_path), payload())
    monkeypatch.setattr(DiskTier, "_probe_writable", lambda self: False)
    with caplog.at_level(logging.INFO):
        tier = open_tier(tmp_path)
    assert "READ-ONLY" in caplog.text
    assert tier.plan_write(CONTEXT, (*TOKENS, *range(400))) == ()
    assert DeviceDisk(tier, LAYERS).load(tier.probe(CONTEXT, TOKENS, 599, 0), None) is not None

    def denied(_source: object, _target: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.undo()
    monkeypatch.setattr(disk_writer_module.os, "replace", denied)
    fresh = tmp_path / "fresh"
    tier = open_tier(fresh)
    write(tier, payload())
    assert not tier.writable
    assert entries(fresh) == []
    assert "no longer writable" in caplog.text


def test_a_temporary_file_of_a_killed_writer_is_ignored_and_cleaned(tmp_path: Path) -> None:
    write(open_tier(tmp_path), payload())
    name = pieces(tmp_path)[0].name
    # A writer killed mid-write leaves its temporary file: pid 2**22 + 1 is beyond any live pid here.
    leftover = tmp_path / disk_index.temp_name(name, 2**22 + 1, "dead")
    leftover.write_bytes(b"half a piece")
    live = tmp_path / disk_index.temp_name(name, os.getpid(), "live")
    live.write_bytes(b"our own write in progress")
    tier = open_tier(tmp_path)
    assert not leftover.exists()
    assert live.exists()
    assert tier.statistics().entries == 3


def test_the_writer_keeps_to_its_write_budget(tmp_path: Path) -> None:
    import time

    settings = DiskSettings(directory=tmp_path, budget_bytes=1 << 30, write_bytes_per_second=200_000)
    tier = DiskTier(settings, "model-a")
    tier.open()
    started = time.monotonic()
    write(tier, payload())  # 75,776 tensor bytes in three pieces
    assert time.monotonic() - started >= 0.3
    assert tier.statistics().writes == 3


def snapshot_of_three_kinds(length: int = 40):
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from mlxcel.model.snapshot import SessionSnapshot

    generator = np.random.default_rng(5)

    def array(*shape):
        return mx.array(generator.standard_normal(shape, dtype=np.float32))

    plain = KVCache()
    plain.keys, plain.values, plain.offset = array(1, 2, length, 4), array(1, 2, length, 4), length
    window = RotatingKVCache(16, 0)
    window.keys, window.values, window.offset, window._idx = array(1, 2, 16, 4), array(1, 2, 16, 4), length, 8
    recurrent = ArraysCache(2)
    recurrent.cache = [array(1, 3, 4), None]
    snapshot = SessionSnapshot("mixed", [plain, window, recurrent], length)
    mx.eval([plain.keys, plain.values, window.keys, window.values, recurrent.cache[0]])
    return snapshot


def test_a_session_snapshot_round_trips_through_disk(tmp_path: Path) -> None:
    snapshot = snapshot_of_three_kinds()
    tokens = tuple(range(40))
    tier = open_tier(tmp_path)
    name = tier.plan_snapshot(CONTEXT, tokens)
    device = DeviceDisk(tier, 3, "mixed")
    device.persist_snapshot(snapshot, name)
    while device.has_work():
        device.work()
    tier.close()
    tier = open_tier(tmp_path)
    assert tier.plan_snapshot(CONTEXT, tokens) is None  # on disk already
    found = tier.probe_snapshot(CONTEXT, (*tokens, 7, 8), memory_len=0)
    assert found == name
    assert tier.probe_snapshot(CONTEXT, (*tokens[:-1], 99, 7), memory_len=0) is None  # another history
    assert tier.probe_snapshot(CONTEXT, (*tokens, 7), memory_len=40) is None  # memory has as much
    loaded = DeviceDisk(tier, 3, "mixed").load_snapshot(found)
    assert loaded is not None
    assert (loaded.length, loaded.family, loaded.cuttable) == (40, "mixed", False)
    plain, window, recurrent = loaded.layers
    assert plain.offset == 40
    assert np.array_equal(np.array(plain.keys), np.array(snapshot.layers[0].keys))
    assert (window.max_size, window.offset, window._idx) == (16, 40, 8)
    assert np.array_equal(np.array(window.values), np.array(snapshot.layers[1].values))
    assert recurrent.cache[1] is None
    assert np.array_equal(np.array(recurrent.cache[0]), np.array(snapshot.layers[2].cache[0]))
    # Another family's model, or a damaged file: refused, deleted, never loaded.
    assert DeviceDisk(tier, 3, "other").load_snapshot(found) is None
    assert tier.statistics().refusals["shape"] == 1
    assert not (tmp_path / found.filename).exists()


def test_a_retention_is_recorded_and_read_back_by_a_new_process(tmp_path: Path) -> None:
    prompt = TOKENS[:520]  # the retained prompt: 32 whole blocks and 8 tokens
    tier = open_tier(tmp_path)
    device = DeviceDisk(tier, LAYERS)
    device.persist(payload(), tier.plan_write(CONTEXT, TOKENS, prompt_len=len(prompt)), urgent=True)
    tier.record_retention(CONTEXT, prompt, 3600.0)
    while device.has_work():
        device.work()
    tier.close()
    pins = [path for path in tmp_path.iterdir() if disk_index.is_pin_name(path.name)]
    assert len(pins) == 1
    assert oct(pins[0].stat().st_mode & 0o777) == "0o600"
    # After a restart, the same prompt with a new turn: the run ends at the retained prompt's last block.
    reader = open_tier(tmp_path)
    request = (*prompt, 9, 9, 9)
    plan = reader.probe(CONTEXT, request, len(request) - 1, 0)
    assert plan is not None
    assert plan.num_tokens == 512
    assert 3590 < plan.retain_seconds <= 3600
    # Another prompt reaching into the same pieces but not ending there is not pinned.
    other = reader.probe(CONTEXT, (*TOKENS[:300], 7, 7), 301, 0)
    assert other is not None
    assert other.retain_seconds == 0.0


def test_a_retention_that_ran_out_pins_nothing_and_is_cleaned_up(tmp_path: Path) -> None:
    prompt = TOKENS[:520]
    tier = open_tier(tmp_path)
    device = DeviceDisk(tier, LAYERS)
    device.persist(payload(), tier.plan_write(CONTEXT, TOKENS, prompt_len=len(prompt)), urgent=True)
    tier.record_retention(CONTEXT, prompt, 60.0)
    while device.has_work():
        device.work()
    tier.close()
    (pin,) = (path for path in tmp_path.iterdir() if disk_index.is_pin_name(path.name))
    os.utime(pin, (1.0, 1.0))  # its time ran out long ago
    reader = open_tier(tmp_path)  # the start-up scan removes it
    assert not pin.exists()
    plan = reader.probe(CONTEXT, (*prompt, 9), len(prompt), 0)
    assert plan is not None
    assert plan.retain_seconds == 0.0
