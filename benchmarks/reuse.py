"""Per server: share of the previous prompt covered by cached_tokens on turns >= 1."""
import json, sys, statistics, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
by = collections.defaultdict(dict)
for r in rows:
    if not r["unseen"]:
        by[r["server"]][(r["conversation"], r["turn"])] = r
for server, turns in by.items():
    cover, share = [], []
    for (c, t), r in turns.items():
        if t == 0: continue
        prev = turns[(c, t - 1)]
        cover.append(min(r["cached_tokens"] / prev["prompt_tokens"], 1.0))
        share.append(r["cached_tokens"] / r["prompt_tokens"])
    warm = [r["ttft_s"] for (c, t), r in turns.items() if t > 0]
    print(f"{server:10s} turns>=1: n={len(cover)} previous-prompt coverage min {min(cover):.3f} median {statistics.median(cover):.3f} "
          f">=0.95: {sum(x >= 0.95 for x in cover)}/{len(cover)}; cached/prompt median {statistics.median(share):.3f}; warm TTFT median {statistics.median(warm)*1e3:.1f} ms")
for server, turns in by.items():
    whole = sum(1 for (c, t), r in turns.items() if t and r["cached_tokens"] >= turns[(c, t - 1)]["prompt_tokens"] - 1)
    n = sum(1 for (c, t) in turns if t)
    print(f"{server:10s} warm turns that reused the whole previous prompt (to 1 token): {whole}/{n}")
