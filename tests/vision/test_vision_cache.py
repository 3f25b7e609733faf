"""Images end to end on random-weight vision fixtures: the whole-entry rule, the digest, cold equality."""

from __future__ import annotations

import base64
import io
from functools import partial

import numpy as np
import openai
import pytest
import trio
from PIL import Image

from mlxcel.config import EngineConfig, SchedulerConfig
from mlxcel.engine import run_engine
from mlxcel.http.validation import Limits
from mlxcel.vision.fixtures import VISION_FAMILIES, vision_fixture_path
from tests.support import TEST_CACHE

SYSTEM = "You look at screenshots. " + " ".join(f"rule{i} applies" for i in range(40))


def png(seed: int, size: tuple[int, int] = (50, 40)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(text: str, *images: bytes) -> dict:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": data_url(image)}}
                                          for image in images), {"type": "text", "text": text}]}


@pytest.fixture
def serve_vision(nursery, start_server):
    async def start(family: str, **serve_options):
        config = EngineConfig(model_path=vision_fixture_path(family), prompt_cache=TEST_CACHE,
                              scheduler=SchedulerConfig(prefill_step_size=512, device_warmup="false"))
        engine = await nursery.start(run_engine, config)
        return engine, openai.OpenAI(base_url=f"{await start_server(engine, **serve_options)}/v1", api_key="unused",
                                     max_retries=0, timeout=120)

    return start


async def create(client: openai.OpenAI, model: str, messages: list, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 3)
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, model=model, messages=messages,
                                                 **kwargs))


def cached(completion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


def first_logprobs(completion) -> dict[str, float]:
    return {item.token: item.logprob for item in completion.choices[0].logprobs.content[0].top_logprobs}


@pytest.mark.parametrize("family", VISION_FAMILIES)
async def test_follow_up_on_the_same_image_adopts_the_whole_entry(serve_vision, family) -> None:
    engine, client = await serve_vision(family)
    model = engine.model_id
    screenshot = png(1)
    # A reply that re-renders to the same tokens (random weights say nothing re-tokenizable otherwise).
    (ok,) = engine.model.tokenizer.encode("ok")
    messages = [{"role": "system", "content": SYSTEM}, user("what is on the screen?", screenshot)]
    first = await create(client, model, messages, logit_bias={str(ok): 100}, max_tokens=1)
    assert cached(first) == 0
    assert first.choices[0].message.content == "ok"
    follow_up = [*messages, {"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and the button?"}]
    hit = await create(client, model, follow_up, logprobs=True, top_logprobs=5)
    cold = await create(client, model, follow_up, logprobs=True, top_logprobs=5, extra_body={"cache_prompt": False})
    # The image's tokens and the whole first turn come from the store; only the new text runs.
    assert cached(hit) >= first.usage.prompt_tokens
    assert hit.usage.prompt_tokens - cached(hit) < 16
    assert cached(cold) == 0
    hot, reference = first_logprobs(hit), first_logprobs(cold)
    assert hot.keys() == reference.keys()
    assert max(abs(hot[token] - value) for token, value in reference.items()) < 1e-4
    assert hit.choices[0].message.content == cold.choices[0].message.content


@pytest.mark.parametrize("family", VISION_FAMILIES)
async def test_other_images_miss_and_the_same_bytes_hit(serve_vision, family, tmp_path) -> None:
    engine, client = await serve_vision(family, limits=Limits(image_file_root=str(tmp_path)))
    model = engine.model_id
    one, two = png(1), png(2)
    (tmp_path / "one.png").write_bytes(one)
    (ok,) = engine.model.tokenizer.encode("ok")

    def turn(*images: dict) -> list:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [*images, {"type": "text", "text": "compare these"}]}]

    def part(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    first = await create(client, model, turn(part(data_url(one)), part(data_url(two))), logit_bias={str(ok): 100},
                         max_tokens=1)
    assert cached(first) == 0

    def follow_up(*images: dict) -> list:
        return [*turn(*images), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]

    # The same text with a different second image, and the same images swapped: other digests, no entry.
    assert cached(await create(client, model, follow_up(part(data_url(one)), part(data_url(png(3)))))) == 0
    assert cached(await create(client, model, follow_up(part(data_url(two)), part(data_url(one))))) == 0
    # The first image by another URL (a file holding the same bytes): the same digest, the whole entry.
    hit = await create(client, model, follow_up(part(f"file://{tmp_path / 'one.png'}"), part(data_url(two))))
    assert cached(hit) >= first.usage.prompt_tokens
