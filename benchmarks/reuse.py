"""How much of the previous prompt each later turn reused, per server, from a `mlxcel bench` request log.

    python benchmarks/reuse.py OUT/requests.jsonl

For every chat turn after the first: the share of the previous turn's
prompt that ``cached_tokens`` covers (min, median, how many reached 95 %),
how many reused the whole previous prompt (to one token: a lookup is capped
one token short of the prompt), cached over prompt tokens, and the warm
TTFT median. Servers that report no cached tokens are listed with their
TTFT only.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys


def main(path: str) -> None:
    turns: dict[str, dict[tuple[int, int], dict]] = collections.defaultdict(dict)
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            if not record["unseen"] and record["error"] is None:
                turns[record["server"]][(record["conversation"], record["turn"])] = record
    for server, records in turns.items():
        later = [(record, records.get((conversation, turn - 1)))
                 for (conversation, turn), record in sorted(records.items()) if turn > 0]
        warm = statistics.median(record["ttft_s"] for record, _ in later) * 1e3
        if any(record["cached_tokens"] is None for record, _ in later):
            print(f"{server}: {len(later)} later turns, warm TTFT median {warm:.1f} ms (no cached tokens reported)")
            continue
        pairs = [(record, previous) for record, previous in later if previous is not None]
        cover = [min(record["cached_tokens"] / previous["prompt_tokens"], 1.0) for record, previous in pairs]
        whole = sum(record["cached_tokens"] >= previous["prompt_tokens"] - 1 for record, previous in pairs)
        share = statistics.median(record["cached_tokens"] / record["prompt_tokens"] for record, _ in later)
        print(f"{server}: {len(pairs)} later turns; previous prompt covered min {min(cover):.3f}, median "
              f"{statistics.median(cover):.3f}, >= 95 % in {sum(c >= 0.95 for c in cover)}; whole previous prompt "
              f"in {whole}; cached/prompt median {share:.3f}; warm TTFT median {warm:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
