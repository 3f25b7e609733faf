"""The cost of enforcing Codex's apply_patch grammar: compile time and per-token mask time.

A Codex request's tools become, in the router, one llguidance grammar: free
text until the model's `<tool_call>` marker, then a call whose `apply_patch`
input must match the Lark grammar (as the JSON string's pattern). This builds
that grammar exactly as the server does (responses.prepare, then the router's
strict-tools grammar), compiles it against the fixtures' Qwen tokenizer
(151k tokens), and walks a realistic reply token by token (some text, then
an apply_patch call), timing the mask of every token as the device computes it.

usage: PYTHONPATH=. python3 -m benchmarks.custom_tool_grammar [--repeats N] [--json OUT]
It needs no accelerator (llguidance runs on the CPU in both places).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from transformers import AutoTokenizer

from mlxcel.core.tool_grammar import strict_tools_grammar
from mlxcel.fixtures import SPECIAL_TOKENS, fixture_path
from mlxcel.http.responses import prepare
from tests.integration.client_shapes import codex_request

PATCH = (
    "*** Begin Patch\n*** Update File: src/app/server.py\n@@ def handle(request):\n"
    "-    return render(request)\n+    response = render(request)\n+    response.headers[\"X-Frame-Options\"] = \"DENY\"\n"
    "+    return response\n     \n*** Add File: docs/security.md\n+# Security headers\n+\n"
    "+Every page is served with X-Frame-Options: DENY.\n*** End Patch\n"
)
PREAMBLE = "I'll add the header in the handler and document it.\n"


def codex_grammar() -> str:
    prepared = prepare(codex_request("bench", stream=False), None, chat_template="")
    return strict_tools_grammar(format_name="json_tools", tools=prepared.chat.tools or (), parallel=False,
                                start_marker="<tool_call>", end_marker="</tool_call>", special_ids={})


def reply_text() -> str:
    call = {"name": "apply_patch", "arguments": {"input": PATCH}}
    return f"{PREAMBLE}<tool_call>\n{json.dumps(call)}\n</tool_call>"


def run(repeats: int) -> dict[str, Any]:
    hf_tokenizer = AutoTokenizer.from_pretrained(str(fixture_path("llama")))
    started = time.perf_counter()
    ll_tokenizer = from_tokenizer(hf_tokenizer, eos_token=[SPECIAL_TOKENS["<|im_end|>"]])
    tokenizer_seconds = time.perf_counter() - started
    grammar = codex_grammar()
    tokens = hf_tokenizer.encode(reply_text(), add_special_tokens=False)
    call_start = len(hf_tokenizer.encode(PREAMBLE, add_special_tokens=False))
    compiles: list[float] = []
    free_masks: list[float] = []
    call_masks: list[float] = []
    slowest: list[tuple[float, int]] = []
    bitmask = allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    for _ in range(repeats):
        started = time.perf_counter()
        matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        compiles.append(time.perf_counter() - started)
        assert not matcher.is_error(), matcher.get_error()
        for index, token in enumerate(tokens):
            started = time.perf_counter()
            fill_next_token_bitmask(matcher, bitmask, 0)
            seconds = time.perf_counter() - started
            allowed = bool(bitmask[0, token // 32] >> (token % 32) & 1)
            assert allowed, f"token {index} ({hf_tokenizer.decode([token])!r}) is masked off"
            (call_masks if index >= call_start else free_masks).append(seconds)
            slowest.append((seconds, index))
            assert matcher.consume_token(token), matcher.get_error()
        fill_next_token_bitmask(matcher, bitmask, 0)
        assert matcher.is_accepting()
    # The same grammar refuses a patch that breaks it: the mask forbids the first wrong token.
    broken = LLMatcher(ll_tokenizer, grammar, log_level=0)
    bad = hf_tokenizer.encode(f"{PREAMBLE}<tool_call>\n" + json.dumps(
        {"name": "apply_patch", "arguments": {"input": "*** Begin Patch\nnot a hunk"}}), add_special_tokens=False)
    refused_at = next((index for index, token in enumerate(bad) if not broken.consume_token(token)), None)

    def micro(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"mean_us": 1e6 * statistics.fmean(values), "p50_us": 1e6 * ordered[len(ordered) // 2],
                "p99_us": 1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
                "max_us": 1e6 * ordered[-1], "over_1ms": sum(value > 1e-3 for value in values), "count": len(values)}

    return {
        "vocab_size": ll_tokenizer.vocab_size, "grammar_chars": len(grammar), "reply_tokens": len(tokens),
        "tokenizer_build_ms": 1000 * tokenizer_seconds,
        "compile_ms": {"first": 1000 * compiles[0], "median": 1000 * statistics.median(compiles)},
        "mask_free_text": micro(free_masks), "mask_in_call": micro(call_masks),
        "slowest_masks": [{"ms": 1000 * seconds, "before_token": index, "text": hf_tokenizer.decode(tokens[index:index + 1])}
                          for seconds, index in sorted(slowest, reverse=True)[:6]],
        "broken_patch_refused_at_token": refused_at, "bitmask_dtype": str(np.asarray(bitmask).dtype),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    figures = run(args.repeats)
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
