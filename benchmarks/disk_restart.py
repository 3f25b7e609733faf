"""The disk tier across a restart: a conversation's next turn after SIGTERM and a new server.

Usage:
  python benchmarks/disk_restart.py [--model-path DIR] [--system-words 2500] [--repeats 3] [--json FILE]

Starts `mlxcel serve` (the llama fixture by default) with --prompt-cache-dir
in a fresh temporary directory, sends turn 1 of a conversation with a long
system prompt, stops the server with SIGTERM at once (the pieces still
queued are written on the way out), starts a new server on the same
directory and sends turn 2 (the whole history, resent; with --warm-first, after one
unrelated uncached prompt of the same length). Its TTFT and
cached_tokens are the disk hit. Then, on the same server, the same turn-2
prompt with cache_prompt: false (a cold prefill) --repeats times, and once
more with the cache on (now a memory hit). TTFT is measured by the client,
to the first streamed chunk, with max_tokens 1.

Prints the figures and the second server's /v1/cache/stats disk block
(load_ms_per_mib: what reading the pieces cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import (  # noqa: E402
    WORDS,
    start_mlxcel,
    stop_server as _stop,  # noqa: E402
    wait_healthy,
)


def start_server(model: Path, directory: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    process, base_url = start_mlxcel(model, ["--prompt-cache-dir", str(directory), *extra], log=log)
    wait_healthy(process, base_url)
    return process, base_url


def stop_server(process: subprocess.Popen[bytes]) -> float:
    return _stop(process)[1]


def chat(base_url: str, messages: list[dict[str, str]], *, max_tokens: int, cache_prompt: bool = True
         ) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if not cache_prompt:
        body["cache_prompt"] = False
    started = time.monotonic()
    ttft = None
    text, usage = [], None
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.monotonic() - started
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
            usage = chunk.get("usage") or usage
    assert usage is not None
    return {"ttft_s": ttft, "text": "".join(text), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, help="model folder (default: the llama fixture)")
    parser.add_argument("--system-words", type=int, default=2500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-flag", action="append", default=[], help="one more `mlxcel serve` flag")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds to wait after turn 1 before SIGTERM (default 0: at once)")
    parser.add_argument("--warm-first", action="store_true",
                        help="before the disk hit, send the new server one unrelated prompt of the same length "
                             "(uncached): the hit then pays no first-request compiles, as the cold runs do not")
    args = parser.parse_args()
    from mlxcel.fixtures import fixture_path

    model = args.model_path or fixture_path("llama")
    system = " ".join(WORDS[(index * 7) % len(WORDS)] for index in range(args.system_words))
    with tempfile.TemporaryDirectory(prefix="mlxcel-disk-restart-") as scratch:
        directory, log = Path(scratch) / "cache", Path(scratch) / "server.log"
        history = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the rules."}]
        process, base_url = start_server(model, directory, log, args.serve_flag)
        first = chat(base_url, history, max_tokens=16)
        time.sleep(args.settle)
        shutdown_s = stop_server(process)
        files = sorted(path for path in directory.iterdir() if path.name.startswith("kv-"))
        piece_bytes = sum(path.stat().st_size for path in files)
        history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And then?"}]
        process, base_url = start_server(model, directory, log, args.serve_flag)
        try:
            warm_up = None
            if args.warm_first:
                other = " ".join(WORDS[(index * 11 + 3) % len(WORDS)] for index in range(args.system_words))
                warm_up = chat(base_url, [{"role": "system", "content": other}, *history[1:]], max_tokens=1,
                               cache_prompt=False)
            hit = chat(base_url, history, max_tokens=1)
            disk = httpx.get(f"{base_url}/v1/cache/stats", timeout=30).json()["disk"]
            colds = [chat(base_url, history, max_tokens=1, cache_prompt=False) for _ in range(args.repeats)]
            memory = chat(base_url, history, max_tokens=1)
        finally:
            stop_server(process)
        indexed = [line for line in log.read_text().splitlines() if "disk tier at" in line]
    cold_ttft = statistics.median(cold["ttft_s"] for cold in colds)
    figures = {
        "model": str(model), "turn1_prompt_tokens": first["prompt_tokens"], "turn1_ttft_s": first["ttft_s"],
        "sigterm_shutdown_s": shutdown_s, "pieces_written": len(files),
        "piece_bytes": piece_bytes,
        "turn2_prompt_tokens": hit["prompt_tokens"], "turn2_cached_tokens": hit["cached_tokens"],
        "turn2_disk_hit_ttft_s": hit["ttft_s"],
        "warm_up_ttft_s": warm_up["ttft_s"] if warm_up else None, "turn2_cold_ttft_s_median": cold_ttft,
        "turn2_cold_ttft_s": [cold["ttft_s"] for cold in colds], "turn2_memory_hit_ttft_s": memory["ttft_s"],
        "speedup_disk_vs_cold": cold_ttft / hit["ttft_s"] if hit["ttft_s"] else None,
        "disk_stats": disk, "start_up_index_lines": indexed,
    }
    for key, value in figures.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
