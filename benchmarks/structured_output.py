"""What a grammar costs: decode tokens/s with and without one, and grammar compile time.

Usage: python benchmarks/structured_output.py [--model-path DIR] [--streams 1,16]
       [--reply-tokens 128] [--repeats 3] [--tools 50]

In-process engine (no HTTP), the llama fixture by default. For each stream
count, N simultaneous chats with distinct short prompts and --reply-tokens
each run four ways, interleaved round by round: unconstrained; all under a
JSON Schema of bounded strings (llguidance's dearest masks); all under one of
free strings; and half and half (constrained and free sequences in one
batch). The schemas ask for a long array, so a grammar never ends a reply
before --reply-tokens (random weights rarely sample EOS either). Decode tokens/s =
completion tokens after each stream's first / (last finish - first token);
each figure is the median of --repeats rounds after a warm-up round.

Then the compile cost of a --tools-tool agent schema: the JSON Schema check
and grammar build at the HTTP edge (what a new tool set costs a request) and
the forced-tool-call grammar of the same tools, and the first mask.
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

from mlxcel.blas import describe_blas, reexec_with_optimized_blas  # noqa: E402

# Bounded strings are llguidance's dearest case (0.24 ms median, 1.1 ms p90 per mask on the CPU box);
# free strings, numbers and enums cost ~0.01 ms.
SCHEMAS = {
    "bounded": {"type": "object", "required": ["items"], "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 400}}},
    "free": {"type": "object", "required": ["items"], "properties": {
        "items": {"type": "array", "items": {"type": "string"}, "minItems": 400}}},
}


def agent_tools(count: int, nonce: str = "") -> list[dict[str, Any]]:
    """``count`` tools shaped like a coding agent's: nested objects, enums, arrays, bounds (``nonce`` in each
    description keeps the edge's memos from answering)."""
    tools = []
    for index in range(count):
        tools.append({"type": "function", "function": {
            "name": f"tool_{index}", "description": f"Tool number {index}{nonce}: does one thing well. " * 3,
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "a file path"},
                "mode": {"type": "string", "enum": ["read", "write", "append", "delete"]},
                "lines": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 20},
                "options": {"type": "object", "properties": {
                    "recursive": {"type": "boolean"}, "depth": {"type": "integer", "minimum": 0, "maximum": 9},
                    "pattern": {"type": "string", "maxLength": 64},
                }, "additionalProperties": False},
            }, "required": ["path", "mode"], "additionalProperties": False},
        }})
    return tools


async def decode_rate(engine: Any, bodies: list[dict[str, Any]]) -> float:
    """Send the chat bodies at once; tokens/s = tokens after each stream's first / (last finish - first token)."""
    import trio

    from mlxcel.http.validation import parse_chat_request

    finishes: list[float] = []
    firsts: list[float] = []
    tokens_after_first = [0]

    async def one(body: dict[str, Any]) -> None:
        first = None
        async with engine.stream(parse_chat_request(body)) as deltas:
            async for delta in deltas:
                if first is None and (delta.text or delta.token_ids):
                    first = time.perf_counter()
                elif first is not None:
                    tokens_after_first[0] += len(delta.token_ids)
        assert first is not None
        firsts.append(first)
        finishes.append(time.perf_counter())

    async with trio.open_nursery() as nursery:
        for body in bodies:
            nursery.start_soon(one, body)
    return tokens_after_first[0] / (max(finishes) - min(firsts))


async def decode_round(engine: Any, streams: int, constrained: int, reply_tokens: int, round_index: int,
                       schema: str = "bounded") -> float:
    bodies: list[dict[str, Any]] = []
    for index in range(streams):
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": f"Round {round_index} stream {index}: list things."}],
            "max_tokens": reply_tokens, "temperature": 1.0, "seed": index,
        }
        if index < constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "list", "schema": SCHEMAS[schema]}}
        bodies.append(body)
    return await decode_rate(engine, bodies)


def compile_costs(num_tools: int, tokenizer: Any) -> dict[str, float]:
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer

    from mlxcel.core.tool_grammar import forced_tool_grammar
    from mlxcel.http import validation

    tools = agent_tools(num_tools, nonce=f" ({time.time_ns()})")
    figures: dict[str, float] = {}
    started = time.perf_counter()
    validation.parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    figures["tool_schema_checks_ms"] = 1000 * (time.perf_counter() - started)
    started = time.perf_counter()
    grammar = forced_tool_grammar(
        format_name="json_tools", tools=tools, names=[tool["function"]["name"] for tool in tools], parallel=True,
        start_marker="<tool_call>", end_marker="</tool_call>", special_ids={},
    )
    error = LLMatcher.validate_grammar(grammar)
    assert not error, error
    figures["forced_tool_grammar_build_and_check_ms"] = 1000 * (time.perf_counter() - started)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    started = time.perf_counter()
    ll_tokenizer = from_tokenizer(hf)
    figures["llguidance_tokenizer_once_ms"] = 1000 * (time.perf_counter() - started)
    started = time.perf_counter()
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    figures["matcher_for_50_tools_ms" if num_tools == 50 else f"matcher_for_{num_tools}_tools_ms"] = \
        1000 * (time.perf_counter() - started)
    started = time.perf_counter()
    matcher.compute_bitmask()
    figures["first_mask_ms"] = 1000 * (time.perf_counter() - started)
    return figures


async def main_async(arguments: argparse.Namespace) -> dict[str, Any]:
    import attrs

    from mlxcel.config import EngineConfig, PromptCacheConfig, SchedulerConfig
    from mlxcel.engine import open_engine
    from mlxcel.fixtures import fixture_path

    model_path = arguments.model_path or fixture_path("llama")
    config = EngineConfig(model_path=Path(model_path), prompt_cache=PromptCacheConfig(capacity_bytes=1 << 30),
                          scheduler=SchedulerConfig())
    config = attrs.evolve(config, scheduler=attrs.evolve(config.scheduler,
                                                         max_batch_size=max(32, max(arguments.streams))))
    results: dict[str, Any] = {"model": str(model_path), "blas": describe_blas(), "decode": []}
    async with open_engine(config) as engine:
        for streams in arguments.streams:
            ways = {"free": (0, "bounded"), "grammar": (streams, "bounded"), "grammar_free_strings": (streams, "free")}
            if streams > 1:
                ways["half"] = (streams // 2, "bounded")
            rates: dict[str, list[float]] = {way: [] for way in ways}
            for round_index in range(-1, arguments.repeats):  # round -1 warms up
                # Interleaved, so drift in the machine's speed falls on every way alike.
                for way, (constrained, schema) in ways.items():
                    rate = await decode_round(engine, streams, constrained, arguments.reply_tokens, round_index, schema)
                    if round_index >= 0:
                        rates[way].append(rate)
            free = statistics.median(rates["free"])
            for way, values in rates.items():
                rate = statistics.median(values)
                row = {"streams": streams, "way": way, "tokens_per_s": rate, "ratio_to_free": rate / free}
                results["decode"].append(row)
                print(json.dumps(row), flush=True)
        results["compile"] = compile_costs(arguments.tools, engine.model.tokenizer)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--streams", type=lambda text: [int(part) for part in text.split(",")], default=[1, 16])
    parser.add_argument("--reply-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tools", type=int, default=50)
    arguments = parser.parse_args()
    reexec_with_optimized_blas()
    import trio

    results = trio.run(main_async, arguments)
    print(json.dumps(results["compile"]))
    by_streams: dict[int, dict[str, float]] = {}
    for row in results["decode"]:
        by_streams.setdefault(row["streams"], {})[row["way"]] = row["tokens_per_s"]
    columns = ["grammar", "grammar_free_strings", "half"]
    print(f"{'streams':>7} {'free tok/s':>11} " + " ".join(f"{name + ' tok/s':>26} {'ratio':>6}" for name in columns))
    for streams, ways in by_streams.items():
        cells = [f"{ways[name]:>26.1f} {ways[name] / ways['free']:>6.2f}" if name in ways else " " * 33
                 for name in columns]
        print(f"{streams:>7} {ways['free']:>11.1f} " + " ".join(cells))


if __name__ == "__main__":
    main()
