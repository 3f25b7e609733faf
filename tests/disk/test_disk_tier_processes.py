"""Two processes writing one disk-tier directory: the budget holds at every moment, and each reads the other's."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from mlxcel.disk import index as disk_index
from mlxcel.disk.directory import DiskSettings
from mlxcel.disk.index import PieceData, PieceName, PieceSpec
from mlxcel.disk.tier import DiskTier

PIECE_TOKENS = 32  # two blocks
NUM_PIECES = 40
TENSOR_BYTES = 2 * PIECE_TOKENS * 8 * 4  # (1, 2, 32, 8) float32
BUDGET = 12 * (2 * TENSOR_BYTES + 600)  # about twelve pieces


def spec(writer: int, index: int) -> PieceSpec:
    chain_hash = bytes([writer, index]) * 16
    return PieceSpec(name=PieceName(fingerprint="ab" * 16, first_block=0, end_block=2, chain_hash=chain_hash),
                     parent=b"\0" * 32)


def settings(directory: Path) -> DiskSettings:
    return DiskSettings(directory=directory, budget_bytes=BUDGET, write_bytes_per_second=1 << 30)


def write_pieces(directory: str, writer: int, ready: Any, start: Any) -> None:
    tier = DiskTier(settings(Path(directory)), "model")
    tier.open()
    ready.release()
    start.wait(30)  # both write at once, interleaved
    for index in range(NUM_PIECES):
        buffer = bytes([writer, index]) * (TENSOR_BYTES // 2)
        tensors = tuple((name, "F32", (1, 2, PIECE_TOKENS, 8), buffer) for name in disk_index.layer_names(0))
        tier.writer.submit(PieceData(spec=spec(writer, index), tensors=tensors, num_layers=1))
        time.sleep(0.01)
    tier.close()


def piece_bytes(directory: Path) -> int:
    total = 0
    for entry in os.scandir(directory):
        if disk_index.parse_name(entry.name):
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                total += entry.stat().st_size
    return total


def test_two_writers_keep_one_budget_and_read_each_others_pieces(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ready, start = context.Semaphore(0), context.Event()
    writers = [context.Process(target=write_pieces, args=(str(tmp_path), writer, ready, start)) for writer in (1, 2)]
    for process in writers:
        process.start()
    # Both started and opened their tiers before either writes (spawning takes seconds, unevenly).
    for _ in writers:
        assert ready.acquire(timeout=120)
    start.set()
    peak = 0
    while any(process.is_alive() for process in writers):
        peak = max(peak, piece_bytes(tmp_path))
    for process in writers:
        process.join(30)
        assert process.exitcode == 0
    assert 0 < peak <= BUDGET
    assert piece_bytes(tmp_path) <= BUDGET
    # A third process's tier reads what either wrote: the most recent pieces of both survive.
    tier = DiskTier(settings(tmp_path), "model")
    tier.open()
    found = {writer: [index for index in range(NUM_PIECES) if (tmp_path / spec(writer, index).filename).exists()]
             for writer in (1, 2)}
    assert found[1]
    assert found[2]
    for writer, indices in found.items():
        for index in indices:
            _metadata, tensors = tier.reader.read(spec(writer, index), num_layers=1)
            assert bytes(tensors[0][1][:2]) == bytes([writer, index])
    assert tier.statistics().entries == len(found[1]) + len(found[2])
