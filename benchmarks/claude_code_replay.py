"""A Claude-Code-shaped session replayed through the anthropic SDK against `mlxcel serve`.

Claude Code sends `/v1/messages` requests whose system prompt starts with a
block like `x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli;
cch=<changes every request>;`, then a long system prompt and ~20 tool schemas,
and the whole conversation so far. This replays such a session: mlxcel is
started twice on the same model folder, with the volatile-block normalization
on (the default) and off (`--normalize-volatile-system=false`), and each time
the same `--turns` turns are sent, streamed, one after another:

- turn 1: the user's request;
- each later turn: the history the server returned (the assistant's text, to
  which a scripted `tool_use` is added: a random-weight model never calls a
  tool), a `tool_result` for that call and a new user text.

The header's `cch=` is new on every request. Printed per turn: the time to the
first streamed event carrying content (`content_block_delta`; the
`message_start` time when a reply has no content), the prompt's size and its
split into `input_tokens`, `cache_read_input_tokens` and
`cache_creation_input_tokens`, and the read share (cache_read / prompt).

The server renders with a ChatML template that writes the tools and tool calls
into the prompt (the fixtures' own template drops them), so the tool schemas
count. Without --model the `llama-bench` random-weight fixture is used.

    python benchmarks/claude_code_replay.py [--model DIR] [--system-tokens 3000] [--tools 20] [--turns 10]
        [--max-tokens 8] [--ctx-size 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlxcel.bench.launcher import ServerSpec, start_server  # noqa: E402

# ChatML with tools (as Qwen2.5's template writes them) and the calls in assistant turns.
TOOL_CHATML = (
    "{%- if messages and messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- if system or tools %}<|im_start|>system\n{{ system }}"
    "{%- if tools %}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.{%- endif %}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

TOOL_NAMES = ["Bash", "Read", "Edit", "MultiEdit", "Write", "Glob", "Grep", "LS", "NotebookEdit", "WebFetch",
              "WebSearch", "TodoWrite", "Task", "ExitPlanMode", "BashOutput", "KillShell", "SlashCommand",
              "AskUserQuestion", "Skill", "ListMcpResources", "ReadMcpResource", "Lint", "Test", "Format"]
WORDS = ("the", "user", "file", "code", "change", "test", "run", "command", "tool", "output", "read", "write",
         "edit", "search", "result", "error", "line", "project", "repository", "branch", "commit", "function",
         "class", "module", "import", "path", "directory", "always", "never", "must", "should", "only", "when",
         "before", "after", "check", "verify", "explain", "keep", "concise", "safe", "careful", "plan", "task",
         "step")
QUESTIONS = ["Fix the failing test in tests/test_parser.py.", "Now run the whole suite.",
             "Why did that fail?", "Read the config module.", "Rename the helper to parse_line.",
             "Update the docs for it.", "Check the linter.", "Commit this.", "What else uses parse_line?",
             "Summarize what we changed."]


def text_of(num_words: int, rng: random.Random) -> str:
    sentences = []
    while num_words > 0:
        length = min(num_words, rng.randint(8, 20))
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(length)).capitalize() + ".")
        num_words -= length
    return " ".join(sentences)


def make_tools(count: int, rng: random.Random) -> list[dict[str, Any]]:
    tools = []
    for index in range(count):
        name = TOOL_NAMES[index] if index < len(TOOL_NAMES) else f"Tool{index}"
        properties = {f"arg_{number}": {"type": rng.choice(["string", "integer", "boolean"]),
                                        "description": text_of(12, rng)} for number in range(4)}
        tools.append({"name": name, "description": text_of(60, rng), "input_schema": {
            "type": "object", "properties": properties, "required": ["arg_0"], "additionalProperties": False}})
    # Claude Code marks its tools (and system prompt, and last message) as cache breakpoints.
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    return tools


def billing_header(rng: random.Random) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.37.abc; cc_entrypoint=cli; cch={rng.randbytes(3).hex()[:5]};"


def replay(base_url: str, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import anthropic

    rng = random.Random(args.seed)
    system_prompt = text_of(int(args.system_tokens / 1.25), rng)
    tools = make_tools(args.tools, rng)
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": QUESTIONS[0], "cache_control": {"type": "ephemeral"}}]}]
    rows = []
    for turn in range(1, args.turns + 1):
        system = [{"type": "text", "text": billing_header(rng)},
                  {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
                  {"type": "text", "text": system_prompt, "cache_control": {"type": "ephemeral"}}]
        started = time.perf_counter()
        first_event = first_content = None
        with client.messages.stream(model=model, max_tokens=args.max_tokens, system=system, tools=tools,
                                    messages=messages, metadata={"user_id": "user_bench_session_1"},
                                    extra_body={"temperature": 0}) as stream:
            for event in stream:
                now = time.perf_counter()
                first_event = first_event or now
                if event.type == "content_block_delta" and first_content is None:
                    first_content = now
            final = stream.get_final_message()
        usage = final.usage
        read = usage.cache_read_input_tokens or 0
        creation = usage.cache_creation_input_tokens or 0
        prompt = usage.input_tokens + read + creation
        rows.append({"turn": turn, "ttft_ms": 1000 * ((first_content or first_event or time.perf_counter()) - started),
                     "prompt_tokens": prompt, "input_tokens": usage.input_tokens, "cache_read_input_tokens": read,
                     "cache_creation_input_tokens": creation, "read_share": read / prompt if prompt else 0.0,
                     "output_tokens": usage.output_tokens})
        print(f"  turn {turn:2d}  ttft {rows[-1]['ttft_ms']:8.1f} ms  prompt {prompt:6d}  input {usage.input_tokens:5d}"
              f"  cache_read {read:6d}  cache_creation {creation:6d}  read share {rows[-1]['read_share']:6.1%}",
              flush=True)
        # The history as the server returned it, plus a scripted call (a random-weight model makes none).
        reply = [{"type": "text", "text": block.text} for block in final.content if block.type == "text" and block.text]
        call_id = f"toolu_{turn:02d}"
        tool = tools[turn % len(tools)]
        reply.append({"type": "tool_use", "id": call_id, "name": tool["name"], "input": {"arg_0": f"value {turn}"}})
        for message in messages:
            # Claude Code keeps the cache marker on the newest user message only.
            if message["role"] == "user" and isinstance(message["content"], list):
                for block in message["content"]:
                    block.pop("cache_control", None)
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id, "content": text_of(40, rng)},
            {"type": "text", "text": QUESTIONS[turn % len(QUESTIONS)], "cache_control": {"type": "ephemeral"}}]})
    client.close()
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    later = rows[1:]
    return {
        "turn1_ttft_ms": rows[0]["ttft_ms"],
        "later_ttft_ms_median": statistics.median(row["ttft_ms"] for row in later) if later else 0.0,
        "later_read_share_min": min(row["read_share"] for row in later) if later else 0.0,
        "later_read_share_mean": statistics.fmean(row["read_share"] for row in later) if later else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the llama-bench fixture)")
    parser.add_argument("--system-tokens", type=int, default=3000, help="about this many tokens of system prompt")
    parser.add_argument("--tools", type=int, default=20, help="tool schemas sent on every turn")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ctx-size", type=int, default=16384, help="the server's context size (the fixtures say 4096)")
    parser.add_argument("--modes", nargs="+", choices=("on", "off"), default=["on", "off"],
                        help="normalization settings to run, in order")
    parser.add_argument("--json", type=Path, default=None, help="write every row and summary here")
    args = parser.parse_args()
    if args.model is None:
        from mlxcel.fixtures import fixture_path

        args.model = fixture_path("llama-bench")
    # The servers run this checkout's mlxcel (`python -m mlxcel`), whatever the venv has installed.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    results: dict[str, Any] = {"model": str(args.model), "system_tokens": args.system_tokens, "tools": args.tools,
                               "turns": args.turns, "max_tokens": args.max_tokens, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="claude-code-replay-") as scratch:
        template = Path(scratch) / "tool_chatml.jinja"
        template.write_text(TOOL_CHATML)
        for mode in args.modes:
            spec = ServerSpec(name=f"mlxcel-normalize-{mode}", argv=(
                sys.executable, "-m", "mlxcel", "serve", "-m", "{model}", "--host", "127.0.0.1", "--port", "{port}",
                "--chat-template", str(template), f"--normalize-volatile-system={'true' if mode == 'on' else 'false'}",
                "--ctx-size", str(args.ctx_size), "--log-level", "warning"))
            print(f"normalization {mode}: starting mlxcel on {args.model}", flush=True)
            server = start_server(spec, str(args.model), Path(scratch) / "logs")
            try:
                import httpx

                model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
                rows = replay(server.base_url, model, args)
            finally:
                server.stop()
            results["runs"][mode] = {"rows": rows, "summary": summary(rows)}
            print(f"normalization {mode}: {json.dumps(summary(rows))}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
