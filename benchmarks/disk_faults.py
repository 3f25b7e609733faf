"""The disk tier's faults against real servers: each leaves the server serving, the bad piece refused.

Usage (as root on Linux: the full disk and the read-only directory are small tmpfs mounts):
  python benchmarks/disk_faults.py [--json FILE]

Scenarios, each on the llama fixture with a fresh directory:
  truncated    a piece cut in half between two runs of the server
  other_model  this model's first piece overwritten by another model's (llama-bench) at the same position
  full_disk    a 256 KiB tmpfs: writes fail with ENOSPC
  tiny_budget  --prompt-cache-disk-bytes 200000: the directory stays within it
  read_only    pieces written, then the tmpfs remounted read-only: reads still hit, nothing is written
  sigkill      SIGKILL while the writer is in the middle of a piece (a slow write budget)

For each: the HTTP statuses of the requests after the fault, the turn's
cached_tokens, the server's disk counters and the log lines the fault
produced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk_restart import chat, start_server, stop_server  # noqa: E402

from mlxcel.fixtures import fixture_path  # noqa: E402

SYSTEM = " ".join(("rule", "number", "alpha", "river", "stone", "paper", "music")[index % 7] + str(index % 13)
                  for index in range(1500))


def conversation(reply: str | None = None) -> list[dict[str, str]]:
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Start."}]
    if reply is not None:
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    return history


def pieces(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if path.name.startswith("kv-"))


def log_lines(log: Path, *needles: str) -> list[str]:
    return [line.split(" ", 2)[-1] for line in log.read_text().splitlines() if any(n in line for n in needles)]


def disk_stats(base_url: str) -> dict[str, Any]:
    disk = httpx.get(f"{base_url}/v1/cache/stats", timeout=30).json()["disk"]
    return {key: disk[key] for key in ("writable", "entries", "bytes", "hits", "tokens_loaded", "writes",
                                       "write_errors", "writes_dropped", "evictions", "refusals", "vanished")}


@contextlib.contextmanager
def serving(model: Path, directory: Path, log: Path, *extra: str) -> Iterator[str]:
    process, base_url = start_server(model, directory, log, list(extra))
    try:
        yield base_url
    finally:
        stop_server(process)


def first_turn(model: Path, directory: Path, log: Path, *extra: str) -> str:
    with serving(model, directory, log, *extra) as base_url:
        return chat(base_url, conversation(), max_tokens=8)["text"]


def serve_after_fault(model: Path, directory: Path, log: Path, reply: str, *extra: str) -> dict[str, Any]:
    """The next turn and two more requests on a new server; what it counted."""
    with serving(model, directory, log, *extra) as base_url:
        turn = chat(base_url, conversation(reply), max_tokens=4)
        statuses = [httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": f"unrelated question {index} " * 40}],
            "max_tokens": 4}).status_code for index in range(2)]
        time.sleep(1.0)
        return {"turn_cached_tokens": turn["cached_tokens"], "turn_prompt_tokens": turn["prompt_tokens"],
                "other_statuses": statuses, "disk": disk_stats(base_url)}


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    # mode=0700: a tmpfs root is 1777 otherwise, which the disk tier refuses (others could write it).
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model, other = fixture_path("llama"), fixture_path("llama-bench")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mlxcel-disk-faults-") as scratch_name:
        scratch = Path(scratch_name)

        # A piece cut short.
        directory, log = scratch / "truncated", scratch / "truncated.log"
        reply = first_turn(model, directory, log)
        target = pieces(directory)[2]
        whole = target.stat().st_size
        target.write_bytes(target.read_bytes()[: whole // 2])
        outcome = serve_after_fault(model, directory, log, reply)
        # Deleted when refused; the turn then prefilled those tokens and wrote the piece anew, whole.
        results["truncated"] = {**outcome, "piece_now_whole": target.exists() and target.stat().st_size == whole,
                                "log": log_lines(log, "refused")}

        # Another model's piece under this model's name.
        directory, log = scratch / "other", scratch / "other.log"
        first_turn(other, scratch / "other-model", log)
        reply = first_turn(model, directory, log)
        ours, theirs = pieces(directory)[0], pieces(scratch / "other-model")[0]
        shutil.copyfile(theirs, ours)
        results["other_model"] = {**serve_after_fault(model, directory, log, reply),
                                  "log": log_lines(log, "refused")}

        # A full disk.
        log = scratch / "full.log"
        with tmpfs(scratch / "full", "256k") as directory:
            reply = first_turn(model, directory, log)
            results["full_disk"] = {**serve_after_fault(model, directory, log, reply),
                                    "log": log_lines(log, "cannot write", "No space")[:3]}

        # A budget smaller than the conversation.
        directory, log = scratch / "tiny", scratch / "tiny.log"
        reply = first_turn(model, directory, log, "--prompt-cache-disk-bytes", "200000")
        outcome = serve_after_fault(model, directory, log, reply, "--prompt-cache-disk-bytes", "200000")
        results["tiny_budget"] = {**outcome, "directory_bytes": sum(path.stat().st_size for path in
                                                                     pieces(directory)), "budget": 200000}

        # A directory that cannot be written: read-only from the start, then turned read-only under a server.
        log = scratch / "ro.log"
        with tmpfs(scratch / "ro", "64m") as directory:
            reply = first_turn(model, directory, log)
            subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True)
            results["read_only"] = {**serve_after_fault(model, directory, log, reply),
                                    "log": log_lines(log, "READ-ONLY")}
            subprocess.run(["mount", "-o", "remount,rw", str(directory)], check=True)
            for path in pieces(directory):
                path.unlink()
            with serving(model, directory, log) as base_url:
                subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True)
                turn = chat(base_url, conversation(), max_tokens=4)
                time.sleep(1.0)
                after = chat(base_url, [{"role": "user", "content": "still there? " * 30}], max_tokens=4)
                results["turned_read_only"] = {"served": bool(turn["text"] is not None and after["text"] is not None),
                                               "disk": disk_stats(base_url),
                                               "log": log_lines(log, "no longer writable")}

        # SIGKILL in the middle of a write: 64 KiB/s, so each 128 KiB piece takes two seconds to write.
        directory, log = scratch / "killed", scratch / "killed.log"
        process, base_url = start_server(model, directory, log, ["--prompt-cache-disk-write-bytes-per-second",
                                                                   "65536"])
        reply = chat(base_url, conversation(), max_tokens=8)["text"]
        time.sleep(3.0)
        temps = [path.name for path in directory.iterdir() if path.name.startswith(".tmp-")]
        complete = len(pieces(directory))
        process.send_signal(signal.SIGKILL)
        process.wait()
        outcome = serve_after_fault(model, directory, log, reply)
        left = [path.name for path in directory.iterdir() if path.name.startswith(".tmp-")]
        results["sigkill"] = {"temps_at_kill": len(temps), "complete_pieces_at_kill": complete, **outcome,
                              "temps_left": left, "log": log_lines(log, "temporary files")}
    for name, result in results.items():
        print(f"{name}: {json.dumps(result)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
