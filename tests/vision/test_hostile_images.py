"""Hostile image requests through HTTP: sizes that would blow up a processor, refused before decoding."""

from __future__ import annotations

import base64
import io
from functools import partial

import anthropic
import httpx
import numpy as np
import openai
import pytest
import trio
from PIL import Image

from mlxcel.config import EngineConfig, SchedulerConfig
from mlxcel.engine import run_engine
from mlxcel.fixtures import vision_fixture_path
from tests.support import TEST_CACHE

pytestmark = pytest.mark.slow


def blank_png(width: int, height: int) -> str:
    """A base64 PNG of one colour: 1 x 7,000,000 pixels compress to about 27 KB."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


STRIP = blank_png(1, 7_000_000)
NORMAL = blank_png(50, 40)


def chat_body(image: str) -> dict:
    return {"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
        {"type": "text", "text": "what is this?"}]}]}


@pytest.fixture
def serve_family(nursery, start_server):
    async def start(family: str) -> str:
        config = EngineConfig(model_path=vision_fixture_path(family), prompt_cache=TEST_CACHE,
                              scheduler=SchedulerConfig(prefill_step_size=512, device_warmup=False))
        return await start_server(await nursery.start(run_engine, config))

    return start


def assert_refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "200-fold" in error["message"]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "mistral3"])
async def test_a_one_pixel_wide_strip_is_a_400_and_the_server_serves_on(serve_family, family) -> None:
    """Issue 33, item 0: llava's processor scaled the short side up (MemoryError) and the router died."""
    base_url = await serve_family(family)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        for _ in range(2):
            response = await client.post("/v1/chat/completions", json=chat_body(STRIP))
            assert_refused(response, "messages[0].content[0].image_url.url")
        wide = await client.post("/v1/chat/completions", json=chat_body(blank_png(7_000_000, 1)))
        assert_refused(wide, "messages[0].content[0].image_url.url")
        assert (await client.post("/v1/chat/completions", json=chat_body(NORMAL))).status_code == 200


async def test_every_route_that_takes_images_refuses_the_strip(serve_family) -> None:
    base_url = await serve_family("llava")
    part = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": STRIP}}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        render = await client.post("/v1/chat/completions/render", json=chat_body(STRIP))
        assert_refused(render, "messages[0].content[0].image_url.url")
        messages = await client.post("/v1/messages", json={"max_tokens": 1, "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "what is this?"}]}]})
        assert messages.status_code == 400, messages.text
        assert "200-fold" in messages.json()["error"]["message"]
        responses = await client.post("/v1/responses", json={"max_output_tokens": 1, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": f"data:image/png;base64,{STRIP}"},
                                         {"type": "input_text", "text": "what is this?"}]}]})
        assert responses.status_code == 400, responses.text
        assert "200-fold" in responses.json()["error"]["message"]
        assert (await client.post("/v1/chat/completions", json=chat_body(NORMAL))).status_code == 200
        assert (await client.get("/health")).status_code == 200


# --- Issue 31, item 3: the image hits users expect -------------------------------------------------------

MODEL = vision_fixture_path("llava").name
SYSTEM = "You look at screenshots. " + " ".join(f"rule{i} applies" for i in range(20))


def screenshot(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def openai_user(text: str, image: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                                        {"type": "text", "text": text}]}


def anthropic_user(text: str, image: str) -> dict:
    return {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}},
        {"type": "text", "text": text}]}


@pytest.fixture
async def llava_clients(serve_family):
    base_url = await serve_family("llava")
    return (openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120), base_url)


async def openai_chat(client: openai.OpenAI, messages: list, **kwargs):
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, model=MODEL, messages=messages,
                                                 temperature=0, max_tokens=kwargs.pop("max_tokens", 3), **kwargs))


async def anthropic_message(client: anthropic.Anthropic, messages: list):
    return await trio.to_thread.run_sync(partial(client.messages.create, model=MODEL, system=SYSTEM,
                                                 messages=messages, max_tokens=3))


async def test_an_exact_resend_of_an_image_request_hits(llava_clients) -> None:
    """Regenerate or retry: the same prompt again adopts all of it but the generation prompt."""
    openai_client, anthropic_client, _ = llava_clients
    messages = [{"role": "system", "content": SYSTEM}, openai_user("what is on the screen?", screenshot(1))]
    first = await openai_chat(openai_client, messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = await openai_chat(openai_client, messages)
    # Everything but the few tokens of the generation prompt ("<|im_start|>assistant\n").
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
    assert again.choices[0].message.content == first.choices[0].message.content
    # Two images, through the Anthropic SDK.
    two = [{"role": "user", "content": [*anthropic_user("compare", screenshot(2))["content"],
                                        *anthropic_user("with this", screenshot(3))["content"]]}]
    first_message = await anthropic_message(anthropic_client, two)
    assert first_message.usage.cache_read_input_tokens == 0
    resent = await anthropic_message(anthropic_client, two)
    assert resent.usage.cache_read_input_tokens >= first_message.usage.input_tokens - 4


@pytest.mark.parametrize("reply", ["\nIt is a screenshot.", "\n\n- a list", " leading space"])
async def test_a_follow_up_whose_reply_re_tokenizes_at_the_turn_keeps_the_image_turn(llava_clients, reply) -> None:
    """A reply that starts with a newline merges with the generation prompt's own ("\\n" + "\\n" is one token),
    so the follow-up parts from the stored prompt at its last token: the image turn must still be adopted."""
    openai_client, anthropic_client, _ = llava_clients
    image = screenshot(4)
    messages = [{"role": "system", "content": SYSTEM}, openai_user("what is on the screen?", image)]
    first = await openai_chat(openai_client, messages)
    follow_up = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "and the button?"}]
    hit = await openai_chat(openai_client, follow_up)
    assert hit.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
    # Regenerating the first turn afterwards still finds its entry (the follow-up's does not serve it).
    again = await openai_chat(openai_client, messages)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
    # The same through the Anthropic SDK, with another image (a fresh entry).
    other = screenshot(5)
    first_message = await anthropic_message(anthropic_client, [anthropic_user("what is shown?", other)])
    follow = await anthropic_message(anthropic_client, [anthropic_user("what is shown?", other),
                                                        {"role": "assistant", "content": reply},
                                                        {"role": "user", "content": "and then?"}])
    assert follow.usage.cache_read_input_tokens >= first_message.usage.input_tokens - 4


async def test_a_text_image_placeholder_without_an_image_part_is_a_400(llava_clients) -> None:
    openai_client, _, base_url = llava_clients
    with pytest.raises(openai.BadRequestError) as caught:
        await openai_chat(openai_client, [{"role": "user", "content": "describe <image> please"}])
    assert caught.value.body["param"] == "messages"
    assert "<image>" in caught.value.body["message"]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        response = await client.post("/v1/completions", json={"prompt": "a <image> b", "max_tokens": 1})
        assert (response.status_code, response.json()["error"]["param"]) == (400, "prompt")
        # Plain text still serves.
        ok = await client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
            {"role": "user", "content": "describe an image please"}]})
        assert ok.status_code == 200


@pytest.mark.parametrize("family", ["qwen2_vl", "mistral3"])
async def test_a_resend_hit_answers_as_a_cold_run(serve_family, family) -> None:
    """The resent prompt adopts the entry that ends before the generation prompt, then runs that as text
    (M-RoPE: at the cache index, past the images): its first-token logprobs are the cold run's."""
    base_url = await serve_family(family)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = vision_fixture_path(family).name
    messages = [{"role": "system", "content": SYSTEM}, openai_user("what is on the screen?", screenshot(6))]

    async def ask(**extra):
        return await trio.to_thread.run_sync(partial(
            client.chat.completions.create, model=model, messages=messages, temperature=0, max_tokens=2,
            logprobs=True, top_logprobs=5, **extra))

    first = await ask()
    hit = await ask()
    cold = await ask(extra_body={"cache_prompt": False})
    assert hit.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
    hot = {item.token: item.logprob for item in hit.choices[0].logprobs.content[0].top_logprobs}
    reference = {item.token: item.logprob for item in cold.choices[0].logprobs.content[0].top_logprobs}
    assert hot.keys() == reference.keys()
    assert max(abs(hot[token] - value) for token, value in reference.items()) < 1e-4
