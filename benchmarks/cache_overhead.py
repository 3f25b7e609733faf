"""CPU overhead of the prompt-cache store per request (lookup + insert).

Usage: python benchmarks/cache_overhead.py [--quick] [--requests N]

The store is filled with `entries` conversations that share a system prompt
and differ in their last 512 tokens (one session each), then measured on
three kinds of request, each a lookup followed by the insert of the
finished sequence (prompt + 32 generated tokens):

  continue  the next turn of a stored conversation (whole-prefix hit)
  diverge   a new conversation on the shared system prompt (APC partial hit)
  cold      unrelated tokens (miss, then a cold insert that hashes every block)

It also prints the cost of hashing 1k tokens into APC blocks per algorithm.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from mlxcel.cache.apc import BlockHasher
from mlxcel.cache.key import TEXT_ONLY_MM_DIGEST, CacheContext
from mlxcel.cache.store import ApcSettings, PromptCacheStore, StoreLimits

PROMPT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
ENTRY_COUNTS = (10, 100, 1000, 10000)
UNIQUE_TAIL = 512
NEW_TURN = 64
GENERATED = 32
VOCAB = 150_000
# Cells whose stored tokens exceed this are skipped: owners keep their packed
# tokens (4 bytes each), and no real KV budget holds that many tokens anyway.
MAX_STORED_TOKENS = 48_000_000


def _tokens(rng: random.Random, count: int) -> list[int]:
    return rng.choices(range(VOCAB), k=count)


def _context(session: int) -> CacheContext:
    return CacheContext(model_id="bench", template_sig="t" * 64, session_key=f"conversation-{session}")


def _fill(prompt_len: int, num_entries: int, rng: random.Random) -> tuple[PromptCacheStore, list[int], list[list[int]]]:
    store = PromptCacheStore(
        StoreLimits(capacity_bytes=1 << 60, max_entries=num_entries),
        ApcSettings(algorithm="sha256"),
    )
    system = _tokens(rng, max(prompt_len - UNIQUE_TAIL, 0))
    tail = min(UNIQUE_TAIL, prompt_len)
    conversations = []
    for session in range(num_entries):
        tokens = system + _tokens(rng, tail)
        store.insert(_context(session), tokens, object(), 1, now=0.0)
        conversations.append(tokens)
    return store, system, conversations


def _measure(prompt_len: int, num_entries: int, num_requests: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    store, system, conversations = _fill(prompt_len, num_entries, rng)
    timings: dict[str, list[float]] = {"continue": [], "diverge": [], "cold": []}
    now = 1.0
    next_session = num_entries
    for _ in range(num_requests):
        for kind in timings:
            if kind == "continue":
                session = rng.randrange(num_entries)
                prompt = conversations[session] + _tokens(rng, NEW_TURN)
            elif kind == "diverge":
                session = next_session
                next_session += 1
                prompt = system + _tokens(rng, prompt_len - len(system))
            else:
                session = next_session
                next_session += 1
                prompt = _tokens(rng, prompt_len)
            finished = prompt + _tokens(rng, GENERATED)
            context = _context(session)
            now += 0.001
            start = time.perf_counter()
            store.lookup(context, prompt, now, max_len=len(prompt) - 1)
            store.insert(context, finished, object(), 1, now)
            timings[kind].append(time.perf_counter() - start)
            if kind == "continue":
                conversations[session] = finished
    return {kind: statistics.median(values) * 1e6 for kind, values in timings.items()}


def _hash_cost(algorithm: str, repeats: int = 50) -> float:
    """Microseconds to chain 1k tokens (64 blocks of 16)."""
    hasher = BlockHasher(algorithm=algorithm, block_size=16)
    tokens = _tokens(random.Random(1), 1024)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        hasher.chain(tokens, TEXT_ONLY_MM_DIGEST)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, for a smoke run")
    parser.add_argument("--requests", type=int, default=30, help="requests of each kind per cell")
    arguments = parser.parse_args()
    lengths = (1024, 8192) if arguments.quick else PROMPT_LENGTHS
    counts = (10, 1000) if arguments.quick else ENTRY_COUNTS

    print("median lookup+insert per request, microseconds (continue / diverge / cold)")
    print(f"{'tokens':>8} | " + " | ".join(f"{count:>7} entries{'':8}" for count in counts))
    for prompt_len in lengths:
        cells = []
        for num_entries in counts:
            if prompt_len * num_entries > MAX_STORED_TOKENS:
                cells.append("skipped")
                continue
            result = _measure(prompt_len, num_entries, arguments.requests)
            cells.append(f"{result['continue']:5.0f} /{result['diverge']:5.0f} /{result['cold']:5.0f}")
        print(f"{prompt_len:>8} | " + " | ".join(f"{cell:>23}" for cell in cells), flush=True)

    print()
    for algorithm in ("sha256", "blake3"):
        print(f"APC {algorithm}: {_hash_cost(algorithm):.0f} us per 1k tokens (block 16)")


if __name__ == "__main__":
    main()
