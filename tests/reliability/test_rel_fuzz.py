"""Schema-driven fuzzing of the generation endpoints against one real server.

Each test starts one engine and one hypercorn on loopback, then runs a
hypothesis loop (sync, in a worker thread, with a sync httpx client) against
it. Bodies are mostly schema-shaped with one or more mutations: wrong JSON
types at every level, unknown roles, bad content parts, absurd numbers, too
many stop strings, invalid UTF-8, oversize bodies, prompts over the context.

Properties: never a 5xx; every 4xx carries the OpenAI error body; a 200 is a
well-formed reply; afterwards the server is healthy, serves a normal request
and its cache stats are consistent.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

# A small body limit so the oversize mutation is cheap to send.
MAX_BODY_BYTES = 64 << 10
EXAMPLES = 100
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}

# --- value strategies ------------------------------------------------------------

# Any JSON value, small.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
# Values that are never a valid small max_tokens (null excluded: absent means "until the context is full").
bad_max_tokens = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=(1 << 20) + 1, max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not float(x).is_integer() or abs(x) > 1e6),
    st.just(5.0),
    st.sampled_from(["NaN", "Infinity", "-1", "3", "", "1e9"]),
    st.booleans(),
    st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=2),
    st.just({"value": 3}),
)
small_max_tokens = st.integers(min_value=1, max_value=3)
out_of_range_sampling = st.one_of(
    st.floats(min_value=2.0001, max_value=1e300),
    st.floats(max_value=-0.0001, min_value=-1e300),
    st.sampled_from(["0.5", "NaN", "nan", "inf"]),
    st.booleans(),
    st.just([0.5]),
)
words = st.text(alphabet="abcdefgh xyz.,!?éü你", min_size=1, max_size=24)
roles = st.sampled_from(["system", "user", "assistant", "developer"])
VOCAB_SIZE = 151_646
# Ids inside the vocabulary, at its edge and far past it.
token_ids = st.one_of(
    st.integers(min_value=0, max_value=5000),
    st.integers(min_value=151_640, max_value=151_700),
    st.integers(min_value=151_700, max_value=2**31 - 1),
)
# What callers put in chat_template_kwargs, a caller-supplied template (bomb or not) included.
template_kwargs = st.one_of(
    st.fixed_dictionaries({"enable_thinking": st.booleans()}),
    st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=8), words, max_size=3),
    st.fixed_dictionaries({"chat_template": st.sampled_from([
        '{{ "ab " * 30000000 }}', "{% for m in messages %}{{ m.content }}{% endfor %}", "{{ raise }}",
        "{% for i in range(10**9) %}x{% endfor %}",
    ])}),
)
unknown_roles = st.one_of(
    st.sampled_from(["wizard", "USER", "System", "function", "", " user", "root"]),
    st.text(max_size=8).filter(lambda r: r not in ("system", "developer", "user", "assistant", "tool")),
)

# --- body strategies -----------------------------------------------------------------


# Grammar bombs within the fuzz server's 64 KiB body: each shape whose compile time grows fast
# (patternProperties, properties, enum members, nesting, GBNF rules and branches), from well within
# the bounds to past them, and regexes llguidance cannot enforce.
regexes = st.sampled_from(["^a+$", "(a+)+$", "(?=x)", "[", "^(a|b|ab){1,20}$", "\\p{L}+", "x{2,1}", "."])


@st.composite
def schema_bombs(draw: st.DrawFn) -> Any:
    shape = draw(st.sampled_from(["pattern_properties", "properties", "enum", "nested", "any_of", "pattern"]))
    count = draw(st.one_of(st.integers(min_value=0, max_value=80), st.integers(min_value=500, max_value=2500)))
    if shape == "pattern_properties":
        return {"type": "object", "patternProperties": {
            f"^a{i}[a-z]+{i}$": {"type": "string"} for i in range(min(count, 900))}}
    if shape == "properties":
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}
    if shape == "enum":
        return {"enum": [f"v{i}" for i in range(count * 4)]}
    if shape == "nested":
        schema: Any = {"type": "string"}
        for _ in range(min(count, 60)):
            schema = {"type": "array", "items": schema}
        return schema
    if shape == "any_of":
        return {"anyOf": [{"const": i} for i in range(count)]}
    return {"type": "string", "pattern": draw(regexes)}


# Grammars that compile at once but whose masks are dear: ambiguous rules make llguidance's Earley
# parser slow (the first, ~0.5 s a mask here: past --grammar-mask-timeout-ms) or past its item limit.
MASK_BOMBS = (
    'root ::= e\ne ::= e e | e e e | "(" e ")" | [a-z]+ | [a-z0-9 ]',
    'root ::= e\ne ::= e "+" e | e "*" e | "(" e ")" | [a-z]+ | e e',
    'root ::= s\ns ::= s s | "a" | "aa" | "b" | [a-z]',
)
# Their outcome when the reply is already streaming: an error event naming the grammar's field.
GRAMMAR_STREAM_ERRORS = ("grammar_too_slow", "grammar_failed")


@st.composite
def gbnf_bombs(draw: st.DrawFn) -> str:
    shape = draw(st.sampled_from(["rules", "branches", "broken", "masks"]))
    if shape == "masks":
        return draw(st.sampled_from(MASK_BOMBS))
    count = draw(st.one_of(st.integers(min_value=1, max_value=60), st.integers(min_value=500, max_value=2000)))
    if shape == "rules":
        return "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(count)) + f'r{count} ::= "z"'
    if shape == "branches":
        return "root ::= " + " | ".join(f'"a{i}"' for i in range(count * 3))
    return draw(st.sampled_from(['root ::= "yes', "root ::= missing", "root ::= ( ( (", "::=", 'root ::= [a-']))


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    messages = [{"role": "user", "content": draw(words)}]
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        messages.insert(0, {"role": draw(roles), "content": draw(words)})
    body: dict[str, Any] = {"messages": messages, "max_tokens": draw(small_max_tokens)}
    optional = {
        "temperature": st.floats(min_value=0, max_value=2),
        "top_p": st.floats(min_value=0.01, max_value=1),
        "seed": st.integers(min_value=-(2**63), max_value=2**64 - 1),
        "stop": st.one_of(words, st.lists(words, max_size=4)),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "logprobs": st.booleans(),
        "user": words,
        "prompt_cache_key": words,
        "cache_salt": words,
        "cache_prompt": st.booleans(),
        "n": st.just(1),
        "presence_penalty": st.floats(min_value=-2, max_value=2),
        "frequency_penalty": st.floats(min_value=-2, max_value=2),
        "top_k": st.integers(min_value=0, max_value=200_000),
        "min_p": st.floats(min_value=0, max_value=1),
        "repetition_penalty": st.floats(min_value=0.01, max_value=100),
        "logit_bias": st.dictionaries(token_ids.map(str), st.floats(min_value=-100, max_value=100), max_size=4),
        "model": st.just("llama-v1-seed0"),
        "chat_template_kwargs": template_kwargs,
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=5)):
        body[key] = draw(optional[key])
    if body.get("logprobs") is True and draw(st.booleans()):
        body["top_logprobs"] = draw(st.integers(min_value=0, max_value=20))
    return body


@st.composite
def completion_bodies(draw: st.DrawFn, native: bool) -> dict[str, Any]:
    prompt: Any = draw(st.one_of(words, st.lists(token_ids, min_size=1, max_size=8)))
    if not native and draw(st.booleans()):
        prompt = [prompt]
    body: dict[str, Any] = {"prompt": prompt}
    body["n_predict" if native and draw(st.booleans()) else "max_tokens"] = draw(small_max_tokens)
    optional = {
        "temperature": st.floats(min_value=0, max_value=2),
        "top_p": st.floats(min_value=0.01, max_value=1),
        "stop": st.one_of(words, st.lists(words, max_size=4)),
        "stream": st.booleans(),
        "cache_prompt": st.booleans(),
        "seed": st.integers(min_value=-1, max_value=2**32),
        "prompt_cache_key": words,
        "cache_salt": words,
        "top_k": st.integers(min_value=0, max_value=200_000),
        "min_p": st.floats(min_value=0, max_value=1),
        "presence_penalty": st.floats(min_value=-2, max_value=2),
        "frequency_penalty": st.floats(min_value=-2, max_value=2),
        "repeat_penalty" if native else "repetition_penalty": st.floats(min_value=0.01, max_value=100),
        "logit_bias": st.dictionaries(token_ids.map(str), st.floats(min_value=-100, max_value=100), max_size=4)
        if not native else st.lists(st.tuples(token_ids, st.one_of(st.just(False), st.floats(-100, 100))).map(list),
                                    max_size=4),
    }
    if not native:
        optional["logprobs"] = st.integers(min_value=0, max_value=5)
        optional["stream_options"] = st.fixed_dictionaries({"include_usage": st.booleans()})
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=4)):
        body[key] = draw(optional[key])
    return body


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (the root excluded)."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            found.append(prefix + (key,))
            found.extend(_paths(item, prefix + (key,)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.append(prefix + (index,))
            found.extend(_paths(item, prefix + (index,)))
    return found


def _set(body: Any, path: tuple, value: Any) -> None:
    target = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value


LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "n_predict")


class Case:
    """One request to send; a short repr keeps hypothesis's failure report readable."""

    def __init__(self, label: str, raw: bytes, headers: dict[str, str]) -> None:
        self.label, self.raw, self.headers = label, raw, headers

    def __repr__(self) -> str:
        shown = self.raw if len(self.raw) <= 600 else self.raw[:600] + b"...(%d bytes)" % len(self.raw)
        return f"Case({self.label!r}, {shown!r})"


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]], kind: str) -> Case:
    """(label, raw body, extra headers): a schema-shaped body with mutations applied."""
    body = draw(base)
    labels = []
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        choice = draw(st.sampled_from([
            "retype", "retype", "retype", "max_tokens", "sampling", "stop_many", "cache_key",
            "role", "parts", "context", "unknown_field", "grammar",
        ]))
        labels.append(choice)
        if choice == "retype":
            # Any field at any depth gets any JSON value (never null for the generation limit).
            paths = [p for p in _paths(body) if p[-1] not in LIMIT_KEYS]
            if paths:
                _set(body, draw(st.sampled_from(paths)), draw(json_values))
        elif choice == "max_tokens":
            key = "n_predict" if kind == "native" and "n_predict" in body else "max_tokens"
            body[key] = draw(bad_max_tokens)
            if kind == "native" and body[key] == -1:
                body[key] = -2
        elif choice == "sampling":
            body[draw(st.sampled_from(["temperature", "top_p", "frequency_penalty", "top_logprobs"]))] = draw(
                out_of_range_sampling)
        elif choice == "stop_many":
            body["stop"] = draw(st.lists(words, min_size=17, max_size=40))
        elif choice == "cache_key":
            body[draw(st.sampled_from(["prompt_cache_key", "user", "cache_salt"]))] = draw(
                st.one_of(st.integers(), st.booleans(), st.lists(words, max_size=2), st.just({"k": "v"}),
                          st.just("s" * 300)))
        elif choice == "role" and kind == "chat" and isinstance(body.get("messages"), list) and body["messages"]:
            index = draw(st.integers(min_value=0, max_value=len(body["messages"]) - 1))
            if isinstance(body["messages"][index], dict):
                body["messages"][index]["role"] = draw(unknown_roles)
        elif choice == "parts" and kind == "chat" and isinstance(body.get("messages"), list) and body["messages"]:
            index = draw(st.integers(min_value=0, max_value=len(body["messages"]) - 1))
            if isinstance(body["messages"][index], dict):
                body["messages"][index]["content"] = draw(st.lists(st.one_of(
                    st.fixed_dictionaries({"type": st.just("text"), "text": json_values}),
                    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "bogus", 3]),
                                           "image_url": st.just({"url": "data:,"})}),
                    json_scalars,
                ), min_size=1, max_size=3))
        elif choice == "context":
            # Far over the 4096-token context of the fixture: refused after tokenizing, no prefill.
            long_text = "word " * draw(st.integers(min_value=4500, max_value=9000))
            if kind == "chat":
                body["messages"] = [{"role": "user", "content": long_text}]
            else:
                body["prompt"] = long_text
        elif choice == "grammar":
            if kind == "native":
                if draw(st.booleans()):
                    body["grammar"] = draw(gbnf_bombs())
                else:
                    body["json_schema"] = draw(schema_bombs())
            else:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "bomb", "schema": draw(schema_bombs())}}
        elif choice == "unknown_field":
            key = draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in LIMIT_KEYS))
            body[key] = draw(json_values)
    raw = json.dumps(body, allow_nan=True).encode()
    headers = {"content-type": "application/json"}
    # Raw-byte mutations of the encoded body.
    byte_choice = draw(st.sampled_from(["none"] * 6 + ["utf8", "truncate", "oversize", "nan", "not_object", "empty"]))
    if byte_choice == "utf8":
        at = draw(st.integers(min_value=0, max_value=len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"])) + raw[at:]
    elif byte_choice == "truncate":
        raw = raw[: draw(st.integers(min_value=0, max_value=max(0, len(raw) - 1)))]
    elif byte_choice == "oversize":
        raw = raw[:-1] + b', "pad": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
    elif byte_choice == "nan":
        raw = raw[:-1] + b', "temperature": NaN}'
    elif byte_choice == "not_object":
        raw = json.dumps(draw(st.one_of(json_scalars, st.lists(json_scalars)))).encode()
    elif byte_choice == "empty":
        raw = b""
    if byte_choice != "none":
        labels.append(byte_choice)
    return Case("+".join(labels) or "valid", raw, headers)


# --- checking one response -----------------------------------------------------------


def _has_out_of_vocabulary_id(raw: bytes) -> bool:
    """A body that parses and whose token-id prompt holds an id the model has no embedding for."""
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not isinstance(prompt, list) or not all(type(item) is int for item in prompt):
        return False
    return any(item >= VOCAB_SIZE for item in prompt)


def check_response(response: httpx.Response, label: str, raw: bytes, kind: str) -> None:
    context = f"{label}: {raw[:300]!r} -> {response.status_code} {response.text[:300]!r}"
    assert response.status_code < 500, context
    if _has_out_of_vocabulary_id(raw):
        # Refused: for the id, or for something checked before it (size, another field).
        assert response.status_code in (400, 413), context
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, context
        error = body["error"]
        if kind == "native" and error.get("type") == "exceed_context_size_error":
            # llama.cpp's own shape for a prompt past the context, which its clients read.
            assert set(error) == {"code", "message", "type", "n_ctx", "n_prompt_tokens"}, context
            assert error["n_prompt_tokens"] > error["n_ctx"], context
            return
        assert set(error) == {"message", "type", "param", "code"}, context
        assert isinstance(error["message"], str), context
        assert error["message"], context
        assert isinstance(error["type"], str), context
        assert isinstance(error["code"], str), context
        assert error["param"] is None or isinstance(error["param"], str), context
        return
    assert response.status_code == 200, context
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events, context
        if kind != "native":
            assert events[-1] == "[DONE]", context
            events = events[:-1]
        decoded = [json.loads(event) for event in events]
        if "error" in decoded[-1] and decoded[-1]["error"].get("code") in GRAMMAR_STREAM_ERRORS:
            # A grammar that gave up mid-reply (its masks too slow, or past llguidance's limits).
            assert set(decoded[-1]["error"]) == {"message", "type", "param", "code"}, context
            decoded = decoded[:-1]
            if not decoded:
                return
            assert not any("error" in event for event in decoded), context
            return
        assert not any("error" in event for event in decoded), context
        if kind == "native":
            assert decoded[-1]["stop"] is True, context
        else:
            finishes = [c["finish_reason"] for e in decoded for c in e["choices"] if c.get("finish_reason")]
            assert len(finishes) == 1, context
            assert finishes[0] in ("stop", "length"), context
        return
    body = response.json()
    if kind == "native":
        assert isinstance(body["content"], str), context
        assert body["stop"] is True, context
        assert body["tokens_predicted"] <= 3, context
    else:
        choice = body["choices"][0]
        assert choice["finish_reason"] in ("stop", "length"), context
        assert body["usage"]["completion_tokens"] <= 3, context
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0, context


def check_cache_stats(stats: dict[str, Any]) -> None:
    for key in ("entries", "bytes", "capacity_bytes", "max_entries", "hits", "misses",
                "total_blocks_stored", "unique_block_hashes"):
        assert isinstance(stats[key], int), (key, stats)
        assert not isinstance(stats[key], bool), (key, stats)
        assert stats[key] >= 0, (key, stats)
    assert stats["bytes"] <= stats["capacity_bytes"], stats
    assert stats["entries"] <= stats["max_entries"], stats
    assert stats["total_blocks_stored"] >= stats["unique_block_hashes"], stats
    assert stats["scheduler"] == {"num_waiting": 0, "num_running": 0}, stats


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

ROUTES = {
    "chat": ("/v1/chat/completions", chat_bodies()),
    "completions": ("/v1/completions", completion_bodies(native=False)),
    "native": ("/completion", completion_bodies(native=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(ROUTES))
async def test_fuzzed_bodies_never_get_a_5xx(start_engine, start_server, kind: str) -> None:
    engine = await start_engine()
    base_url = await start_server(engine, max_body_bytes=MAX_BODY_BYTES)
    path, base = ROUTES[kind]
    seen: dict[str, int] = {}
    history: list[tuple[Case, int, float]] = []

    with httpx.Client(base_url=base_url, timeout=60) as client:

        @FUZZ_SETTINGS
        @given(case=mutated(base, kind))
        def fuzz(case: Case) -> None:
            label, raw, headers = case.label, case.raw, case.headers
            started = time.monotonic()
            try:
                response = client.post(path, content=raw, headers=headers)
            except httpx.TransportError as error:
                raise AssertionError(f"{error!r} after {time.monotonic() - started:.1f} s; "
                                     f"the previous requests: {history[-3:]}") from error
            history.append((case, response.status_code, round(time.monotonic() - started, 2)))
            seen[str(response.status_code)] = seen.get(str(response.status_code), 0) + 1
            check_response(response, label, raw, kind)

        with trio.fail_after(120):
            await trio.to_thread.run_sync(fuzz)

        # The loop exercised both sides of the edge.
        assert seen.get("200", 0) >= 5, seen
        assert seen.get("400", 0) >= 5, seen

        def after() -> dict[str, Any]:
            assert client.get("/health").status_code == 200
            good = client.post("/v1/chat/completions", json=GOOD_CHAT)
            assert good.status_code == 200, good.text
            assert good.json()["choices"][0]["finish_reason"] in ("stop", "length")
            stats = client.get("/v1/cache/stats")
            assert stats.status_code == 200
            return stats.json()

        stats = await trio.to_thread.run_sync(after)
    check_cache_stats(stats)
    scheduler = await engine.scheduler_stats()
    assert scheduler.num_running == 0
    assert scheduler.num_waiting == 0


OVERSIZE_CASES = [pytest.param(True, id="chunked"), pytest.param(False, id="content-length")]


@pytest.mark.slow
@pytest.mark.parametrize("chunked", OVERSIZE_CASES)
async def test_oversize_body_is_413_with_the_documented_code(start_engine, start_server, chunked: bool) -> None:
    """docs/api.md: bodies over the limit get 413 `request_too_large`, whichever way they are framed."""
    engine = await start_engine()
    base_url = await start_server(engine, max_body_bytes=MAX_BODY_BYTES)
    raw = json.dumps({**GOOD_CHAT, "pad": "x" * (MAX_BODY_BYTES + 1)}).encode()

    def send() -> httpx.Response:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            content: Any = iter([raw[:1000], raw[1000:]]) if chunked else raw
            return client.post("/v1/chat/completions", content=content,
                               headers={"content-type": "application/json"})

    response = await trio.to_thread.run_sync(send)
    assert response.status_code == 413
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "request_too_large"


# --- unread bodies then a kept-alive follow-up -----------------------------------------

FUZZ_KEY = "fuzz-key"
AUTH = b"Authorization: Bearer " + FUZZ_KEY.encode()
# (expected status, request head for a body of n bytes); each reply comes before or without reading the body.
UNREAD_BODY_CASES = {
    200: lambda n: b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n%s\r\nContent-Length: %d\r\n\r\n" % (AUTH, n),
    401: lambda n: b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % n,
    404: lambda n: b"POST /v2/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n%s\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % (AUTH, n),
    405: lambda n: b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % n,
    413: lambda n: b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n%s\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % (AUTH, MAX_BODY_BYTES + n),
    400: lambda n: b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n%s\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % (AUTH, n),
}


@pytest.mark.slow
async def test_unread_bodies_on_every_status_leave_the_connection_answering(start_engine, start_server) -> None:
    from tests.reliability.test_rel_connections import unread_body_then_follow_up

    base_url = await start_server(await start_engine(), max_body_bytes=MAX_BODY_BYTES, api_key=FUZZ_KEY)
    outcomes: dict[tuple[int, str], int] = {}

    def run() -> None:
        @settings(FUZZ_SETTINGS, max_examples=60)
        @given(status=st.sampled_from(sorted(UNREAD_BODY_CASES)),
               body=st.text(max_size=2048).map(lambda text: json.dumps({"pad": text}).encode()))
        def one(status: int, body: bytes) -> None:
            got, headers, follow_up = unread_body_then_follow_up(base_url, UNREAD_BODY_CASES[status](len(body)), body)
            assert got == status, (got, headers)
            # Either the next request is answered, or the reply announced Connection: close and the
            # server closed; a follow-up that hangs raises TimeoutError.
            outcomes[(status, follow_up)] = outcomes.get((status, follow_up), 0) + 1

        one()

    await trio.to_thread.run_sync(run)
    assert {status for status, _ in outcomes} == set(UNREAD_BODY_CASES), outcomes
    # Bodies the server could wait for keep the connection; refusals that never read it close it.
    assert all(follow_up == "answered" for (status, follow_up) in outcomes if status in (200, 404, 405, 400)), outcomes


# --- the tokenizer routes -----------------------------------------------------------

# The repeated text stays under the body limit (at most 60 KB): the padded bodies below are the 413s, and a
# run keeps enough 200s for its floor (with up to 180 KB, 44 of 80 bodies were 413s and one run drew 4 200s).
tokenize_bodies = st.fixed_dictionaries(
    {"content": st.one_of(words, json_values, st.integers(min_value=0, max_value=20_000).map(lambda n: "ab " * n))},
    optional={"add_special": st.one_of(st.booleans(), json_values), "with_pieces": st.one_of(st.booleans(), json_values),
              "parse_special": st.one_of(st.booleans(), json_values)},
)
detokenize_bodies = st.fixed_dictionaries({"tokens": st.one_of(
    st.lists(token_ids, max_size=8), json_values,
    st.integers(min_value=4000, max_value=8000).map(lambda n: [1] * n),  # around the 4,096 context
)})


@pytest.mark.slow
async def test_fuzzed_tokenizer_route_bodies_never_get_a_5xx(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine, max_body_bytes=MAX_BODY_BYTES)
    seen: dict[str, int] = {}

    with httpx.Client(base_url=base_url, timeout=60) as client:

        @settings(FUZZ_SETTINGS, max_examples=80)
        @given(path=st.sampled_from(["/tokenize", "/detokenize"]), data=st.data())
        def fuzz(path: str, data: st.DataObject) -> None:
            body = data.draw(tokenize_bodies if path == "/tokenize" else detokenize_bodies)
            raw = json.dumps(body).encode()
            if data.draw(st.integers(min_value=0, max_value=9)) == 0:
                raw = raw[:-1] + b', "pad": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            seen[str(response.status_code)] = seen.get(str(response.status_code), 0) + 1
            context = f"{path} {raw[:200]!r} -> {response.status_code} {response.text[:200]!r}"
            assert response.status_code in (200, 400, 413), context
            if response.status_code == 200:
                key = "tokens" if path == "/tokenize" else "content"
                assert key in response.json(), context
            else:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}, context

        with trio.fail_after(120):
            await trio.to_thread.run_sync(fuzz)
        assert seen.get("200", 0) >= 5, seen
        assert seen.get("400", 0) >= 5, seen
        good = await trio.to_thread.run_sync(lambda: client.post("/v1/chat/completions", json=GOOD_CHAT))
        assert good.status_code == 200


# --- slow bodies ------------------------------------------------------------------------


@pytest.mark.slow
async def test_fuzzed_slow_bodies_are_answered_or_timed_out_never_stuck(start_engine, start_server) -> None:
    """Fuzzed bodies sent in pieces at fuzzed pace: within --body-timeout they get their answer
    (never a 5xx), past it a 408; either way the server serves a normal request afterwards."""
    from tests.reliability.test_rel_connections import read_response

    engine = await start_engine()
    base_url = await start_server(engine, max_body_bytes=MAX_BODY_BYTES, body_timeout=1.0)
    host, port = base_url.removeprefix("http://").split(":")
    seen: dict[str, int] = {}

    @settings(FUZZ_SETTINGS, max_examples=30)
    @given(case=mutated(chat_bodies(), "chat"), num_pieces=st.integers(min_value=1, max_value=6),
           pause=st.sampled_from([0.0, 0.05, 0.15, 0.4]))
    def fuzz(case: Case, num_pieces: int, pause: float) -> None:
        raw = case.raw
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(raw))
        size = max(1, -(-len(raw) // num_pieces))
        # Generous: the first grammar builds llguidance's tokenizer tables (seconds on this CPU).
        with socket.create_connection((host, int(port)), timeout=90) as sock:
            sock.sendall(head)
            try:
                for start in range(0, len(raw), size):
                    time.sleep(pause)
                    sock.sendall(raw[start:start + size])
            except OSError:
                pass  # refused before the body ended (a 413, a 408): the answer below says which
            started = time.monotonic()
            try:
                response = read_response(sock)
            except TimeoutError as error:
                raise AssertionError(f"no answer after {time.monotonic() - started:.1f} s: {case!r}") from error
        assert response is not None, case
        status = response[0]
        seen[str(status)] = seen.get(str(status), 0) + 1
        assert status < 500, (case, response)
        if pause * num_pieces > 1.5:
            assert status in (408, 413, 400), (case, response)

    with trio.fail_after(240):
        await trio.to_thread.run_sync(fuzz)
    assert seen.get("200", 0) >= 1, seen

    def after() -> tuple[int | None, int]:
        # A body still arriving after --body-timeout (1 s here) is a 408, then a normal request is served.
        raw = json.dumps(GOOD_CHAT).encode()
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                         b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw[:5])
            time.sleep(1.5)
            late = read_response(sock)
        with httpx.Client(base_url=base_url, timeout=30) as client:
            return (late[0] if late else None), client.post("/v1/chat/completions", json=GOOD_CHAT).status_code

    assert await trio.to_thread.run_sync(after) == (408, 200)
