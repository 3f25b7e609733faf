"""How close a hit from quantized stored KV is to a cold run, on the real SmolLM2-135M (CPU).

Three-turn conversations (the reuse matrix of tests/integration/test_real_model.py:
its system prompts and questions, ``--conversations`` of them; the first 22 are the
test's). Each turn's cold reply (greedy, ``--max-tokens``, a fresh cache) is computed
once and makes the history. Then, per setting, each conversation is replayed as the
server replays it: turn 1's prompt and reply are detached into the store
(``mlxcel.model.kv.detach``, in the setting's ``StoreFormat``: quantized as it is
copied out), turn 2 adopts the longest block-aligned stored prefix of its prompt
(``adopt``: dequantized), prefills the rest, and donates its own rows on the adopted
base, which turn 3 adopts in turn. Turns 2 and 3 are compared with their cold runs:

- greedy equal: the hit's greedy reply is the cold one. Checked teacher-forced: the
  hit's cache runs the rest of the prompt and the cold reply in one pass, and the
  reply is equal exactly when every position's argmax is the cold token (by
  induction on the tokens); the exact setting checks the method (all equal, 0 nats);
- the first token's logprob: |log p_hit(t) - log p_cold(t)| for the cold first token t;
- stored bytes per token against exact: the conversations' stored pieces (shared
  pieces once), and what the same format gives bf16 KV of head_dim 64 and 128
  (scales and biases in the KV dtype), the figure that matters on a GPU.

    python -m benchmarks.kv_quant_agreement [--conversations 110] [--settings 0 8 8:plain 4 ...]
        [--cold-cache /tmp/kv_quant_cold.json] [--json results.json]

A setting is BITS[:GROUP][:plain] (0: exact; plain: no Hadamard rotation, the
layout before issue 31). Cold replies are the slow part (a decode loop per turn);
``--cold-cache`` keeps them between runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 16  # the store adopts whole APC blocks
THIRD_QUESTIONS = ["What next?", "Give an example.", "Why is that?", "Say more.", "Sum it up.", "Is that all?"]
DEFAULT_SETTINGS = ["0", "8:64:plain", "8:32:plain", "8:64", "8:32", "4:64:plain", "4:32:plain", "4:64", "4:32"]


def conversation(index: int) -> tuple[str, str, str, str]:
    """System prompt and three questions: index < 22 is the integration test's pairing, then new ones."""
    from tests.integration.test_real_model import FIRST_QUESTIONS, SECOND_QUESTIONS, SYSTEM_PROMPTS

    rounds = index // len(SYSTEM_PROMPTS)
    return (SYSTEM_PROMPTS[index % len(SYSTEM_PROMPTS)],
            FIRST_QUESTIONS[(index + 11 * rounds) % len(FIRST_QUESTIONS)],
            SECOND_QUESTIONS[(index + 3 * rounds) % len(SECOND_QUESTIONS)],
            THIRD_QUESTIONS[(index + rounds) % len(THIRD_QUESTIONS)])


def parse_setting(text: str) -> Any:
    from mlxcel.model.kv import EXACT, StoreFormat

    parts = text.split(":")
    bits = int(parts[0])
    if bits == 0:
        return EXACT
    group = int(parts[1]) if len(parts) > 1 and parts[1] else 64
    return StoreFormat(bits, group, rotated="plain" not in parts[2:])


def label(store_format: Any) -> str:
    if not store_format.quantized:
        return "exact"
    return (f"{store_format.bits} bits, groups of {store_format.group_size}"
            f"{', Hadamard-rotated' if store_format.rotated else ', plain'}")


def bf16_ratio(store_format: Any, head_dim: int) -> float:
    """Exact bf16 bytes per row over the format's: packed words plus a bf16 scale and bias per group."""
    if not store_format.quantized:
        return 1.0
    return (2 * head_dim) / (head_dim * store_format.bits / 8 + 4 * head_dim / store_format.group_size)


def cold_turns(model: Any, tokenizer: Any, count: int, max_tokens: int, cache_file: Path | None) -> list[Any]:
    """Per conversation, per turn: (prompt ids, cold greedy reply ids, cold logprob of its first token)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    stored: list[Any] = []
    if cache_file is not None and cache_file.exists():
        stored = json.loads(cache_file.read_text())
        if stored and stored[0].get("max_tokens") != max_tokens:
            stored = []
    eos = set(tokenizer.eos_token_ids)
    started = time.perf_counter()
    for index in range(len(stored), count):
        system, *questions = conversation(index)
        messages = [{"role": "system", "content": system}]
        turns = []
        for question in questions:
            messages.append({"role": "user", "content": question})
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            cache = make_prompt_cache(model)
            logits = model(mx.array([ids]), cache=cache)[0, -1]
            token = int(mx.argmax(logits))
            first_logprob = float((logits - mx.logsumexp(logits))[token])
            reply = [token]
            while token not in eos and len(reply) < max_tokens:
                token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]))
                reply.append(token)
            turns.append([ids, reply, first_logprob])
            messages.append({"role": "assistant", "content": tokenizer.decode([t for t in reply if t not in eos])})
        stored.append({"max_tokens": max_tokens, "turns": turns})
        print(f"cold {index + 1}/{count} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        if cache_file is not None:
            cache_file.write_text(json.dumps(stored))
    return [entry["turns"] for entry in stored[:count]]


def common_prefix(first: list[int], second: list[int]) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


def replay(model: Any, conversations: list[Any], store_format: Any) -> dict[str, Any]:
    """Every conversation through the store in ``store_format``; the hit turns against their cold runs."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.model.kv import adopt, detach, use_store_format

    use_store_format(store_format)
    equal = first_equal = 0
    differences: list[float] = []
    stored_bytes = stored_tokens = 0
    started = time.perf_counter()
    try:
        for turns in conversations:
            stored = None
            held: list[int] = []
            pieces: dict[int, Any] = {}
            for ids, reply, cold_logprob in turns:
                adopted = 0
                if stored is not None:
                    adopted = min(common_prefix(held, ids), len(ids) - 1) // BLOCK * BLOCK
                caches = adopt(stored, adopted) if adopted else make_prompt_cache(model)
                logits = model(mx.array([ids[adopted:] + reply[:-1]]), cache=caches)[0]
                if stored is not None:
                    start = len(ids) - adopted - 1
                    chosen = mx.argmax(logits[start:start + len(reply)], axis=-1).tolist()
                    row = logits[start] - mx.logsumexp(logits[start])
                    differences.append(abs(float(row[reply[0]]) - cold_logprob))
                    equal += chosen == reply
                    first_equal += chosen[0] == reply[0]
                held = (ids + reply)[: len(ids) + len(reply) - 1]
                base = stored.cut(adopted) if stored is not None and adopted else None
                stored = detach(caches, len(held), base=base, split_at=len(ids))
                assert stored is not None
                pieces.update((id(piece), piece) for piece in stored.pieces())
            stored_bytes += sum(piece.nbytes for piece in pieces.values())
            stored_tokens += sum(piece.length for piece in pieces.values())
    finally:
        use_store_format(parse_setting("0"))
    turns_compared = len(differences)
    return {
        "setting": label(store_format), "bits": store_format.bits, "group_size": store_format.group_size,
        "rotated": store_format.rotated and store_format.quantized, "turns": turns_compared,
        "greedy_equal": equal, "greedy_equal_share": round(equal / turns_compared, 4),
        "first_token_equal": first_equal,
        "first_logprob_diff_max": round(max(differences), 4),
        "first_logprob_diff_median": round(statistics.median(differences), 5),
        "first_logprob_diff_mean": round(statistics.mean(differences), 5),
        "stored_bytes": stored_bytes, "stored_tokens": stored_tokens,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=110, help="three-turn conversations (2 hits each)")
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS)
    parser.add_argument("--family", default="smollm2-f32")
    parser.add_argument("--cold-cache", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here as well")
    args = parser.parse_args()

    from mlxcel.blas import load_optimized_blas_in_process

    load_optimized_blas_in_process()  # before mlx loads: OpenBLAS for the float32 fixture's matmuls
    from mlx_lm import load

    from mlxcel.fixtures import fixture_path

    model, tokenizer = load(str(fixture_path(args.family)))
    conversations = cold_turns(model, tokenizer, args.conversations, args.max_tokens, args.cold_cache)
    rows = []
    exact_bytes_per_token = None
    head_dim = model.layers[0].self_attn.head_dim
    for text in args.settings:
        row = replay(model, conversations, parse_setting(text))
        per_token = row["stored_bytes"] / row["stored_tokens"]
        if row["bits"] == 0:
            exact_bytes_per_token = per_token
        if exact_bytes_per_token is not None:
            row["exact_over_stored_bytes"] = round(exact_bytes_per_token / per_token, 3)
        store_format = parse_setting(text)
        row[f"bf16_ratio_head_dim_{head_dim}"] = round(bf16_ratio(store_format, head_dim), 3)
        row["bf16_ratio_head_dim_128"] = round(bf16_ratio(store_format, 128), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| stored KV | hit turns | greedy equal to cold | first-token logprob diff, max / median (nats) "
          f"| exact bytes / stored (float32 KV) | same for bf16 KV, head_dim {head_dim} / 128 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['setting']} | {row['turns']} | {row['greedy_equal']} ({100 * row['greedy_equal_share']:.1f}%) "
              f"| {row['first_logprob_diff_max']:.3f} / {row['first_logprob_diff_median']:.4f} "
              f"| {row.get('exact_over_stored_bytes', '-')}x "
              f"| {row[f'bf16_ratio_head_dim_{head_dim}']}x / {row['bf16_ratio_head_dim_128']}x |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
