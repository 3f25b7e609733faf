"""The disk tier's files at rest: private modes, a directory only this user controls, and planted files.

The files hold prompts in the clear (their tokens), so who may read and write
the directory is the tier's whole protection (issue 33, item 6).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.cache.key import CacheContext
from mlxcel.disk import index as disk_index
from mlxcel.disk.device import DeviceDisk
from mlxcel.disk.directory import DiskSettings, UnsafeDirectory
from mlxcel.disk.tier import DiskTier
from mlxcel.model.kv import DetachedKV

CONTEXT = CacheContext(model_id="m", template_sig="t")
TOKENS = tuple(range(100, 700))  # pieces of blocks [0, 16), [16, 32), [32, 37)
LAYERS = 2


def stored_payload() -> DetachedKV:
    generator = np.random.default_rng(0)
    layers = [tuple(mx.array(generator.standard_normal((1, 2, len(TOKENS), 4), dtype=np.float32))
                    for _ in range(2)) for _ in range(LAYERS)]
    detached = DetachedKV.whole(layers, len(TOKENS))
    mx.eval(detached.arrays())
    return detached


def open_tier(directory: Path, **changes) -> DiskTier:
    tier = DiskTier(DiskSettings(directory=directory, budget_bytes=1 << 30, write_bytes_per_second=1 << 30,
                                 **changes), "model-a")
    tier.open()
    return tier


def write_all(tier: DiskTier) -> None:
    device = DeviceDisk(tier, LAYERS)
    device.persist(stored_payload(), tier.plan_write(CONTEXT, TOKENS), urgent=False)
    while device.has_work():
        device.work()
    tier.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_directory_is_0700_and_every_file_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)  # the usual umask, which made files 0644 before
    try:
        directory = tmp_path / "new" / "kv"
        write_all(open_tier(directory))
    finally:
        os.umask(old)
    assert mode(directory) == 0o700
    written = list(directory.iterdir())
    assert len(written) == 4  # three pieces and the lock file
    assert {path.name: mode(path) for path in written} == {path.name: 0o600 for path in written}


def test_an_own_directory_readable_by_others_is_tightened_with_its_old_files(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    write_all(open_tier(directory))
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)  # as an older version wrote them
    open_tier(directory).close()
    assert mode(directory) == 0o700
    assert {mode(path) for path in directory.iterdir() if disk_index.parse_name(path.name)} == {0o600}


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="can be written by other users"):
        open_tier(directory)
    assert list(directory.iterdir()) == []  # nothing written there


def test_a_directory_another_user_owns_is_refused(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o700)
    owner = directory.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # this process runs as someone else
    with pytest.raises(UnsafeDirectory, match=f"owned by uid {owner}"):
        open_tier(directory)


def test_the_cli_refuses_an_unsafe_directory_with_one_line_and_status_2(tmp_path: Path) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o777)
    result = subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "--prompt-cache-dir", str(directory), "--port", "0"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "can be written by other users" in lines[0]


def first_piece(tier: DiskTier):
    request = (*TOKENS, 1, 2, 3)
    plan = tier.probe(CONTEXT, request, len(request) - 1, 0)
    assert plan is not None
    return plan


def test_a_fifo_under_a_piece_name_is_refused_without_blocking(tmp_path: Path) -> None:
    write_all(open_tier(tmp_path))
    tier = open_tier(tmp_path)
    plan = first_piece(tier)
    target = tmp_path / plan.pieces[1].filename
    target.unlink()
    os.mkfifo(target)  # a plain open() would wait for a writer forever, and every step behind it
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(DeviceDisk(tier, LAYERS).load(plan, None)), daemon=True)
    reader.start()
    reader.join(20)
    assert not reader.is_alive(), "loading a disk hit blocked on a FIFO"
    (loaded,) = result
    assert isinstance(loaded, DetachedKV)
    assert loaded.length == 256  # the piece before it is used
    assert tier.statistics().refusals["malformed"] == 1
    assert not target.exists()


def test_a_symbolic_link_under_a_piece_name_is_refused(tmp_path: Path) -> None:
    write_all(open_tier(tmp_path))
    tier = open_tier(tmp_path)
    plan = first_piece(tier)
    target = tmp_path / plan.pieces[0].filename
    elsewhere = tmp_path.parent / f"{tmp_path.name}-outside"
    target.rename(elsewhere)
    target.symlink_to(elsewhere)
    assert DeviceDisk(tier, LAYERS).load(plan, None) is None
    assert tier.statistics().refusals["malformed"] == 1
    assert elsewhere.exists()  # only the link is deleted


def test_an_oversized_planted_file_costs_no_memory(tmp_path: Path) -> None:
    write_all(open_tier(tmp_path))
    tier = open_tier(tmp_path, max_piece_bytes=1 << 20)
    plan = first_piece(tier)
    target = tmp_path / plan.pieces[0].filename
    with open(target, "wb") as file:
        file.truncate(256 << 20)  # 256 MiB of zeros, a sparse file
    tracemalloc.start()
    try:
        assert DeviceDisk(tier, LAYERS).load(plan, None) is None
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"reading a planted file took {peak} bytes"
    assert tier.statistics().refusals["malformed"] == 1


def test_start_up_says_the_directory_holds_prompts_in_the_clear(tmp_path: Path, caplog) -> None:
    with caplog.at_level("WARNING", logger="mlxcel.disk.tier"):
        open_tier(tmp_path).close()
    assert any("holds prompts in the clear" in record.getMessage() and record.levelname == "WARNING"
               for record in caplog.records)


def test_a_directory_that_cannot_be_tightened_is_still_used(tmp_path: Path, monkeypatch, caplog) -> None:
    directory = tmp_path / "kv"
    write_all(open_tier(directory))
    directory.chmod(0o755)

    def read_only(_path: object, _mode: int) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "chmod", read_only)
    with caplog.at_level("WARNING"):
        tier = open_tier(directory)
    assert "cannot be made 0700" in caplog.text
    assert DeviceDisk(tier, LAYERS).load(first_piece(tier), None) is not None
