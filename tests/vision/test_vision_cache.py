"""Images end to end on random-weight vision fixtures: the whole-entry rule, the digest, cold equality."""

from __future__ import annotations

import base64
import io
from functools import partial

import httpx
import numpy as np
import openai
import pytest
import trio
from PIL import Image

from mlxcel.config import EngineConfig, SchedulerConfig
from mlxcel.engine import run_engine
from mlxcel.fixtures import VISION_FAMILIES, vision_fixture_path
from tests.support import TEST_CACHE

pytestmark = pytest.mark.slow

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
    async def start(family: str, scheduler: SchedulerConfig | None = None, **serve_options):
        config = EngineConfig(model_path=vision_fixture_path(family), prompt_cache=TEST_CACHE,
                              scheduler=scheduler or SchedulerConfig(prefill_step_size=512, device_warmup=False))
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
    engine, client = await serve_vision(family, allow_image_files=str(tmp_path))
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


async def post(base_url: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(f"{base_url}/v1/chat/completions", json=body)


async def test_bad_images_and_text_models_get_a_400_naming_the_part(start_engine, start_server, nursery) -> None:
    text_engine = await start_engine("llama")
    response = await post(await start_server(text_engine), {"messages": [user("what is this?", png(1))]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages[0].content[0].image_url.url", "unsupported_content")
    assert error["message"] == "multimodal input is not supported by this model"

    config = EngineConfig(model_path=vision_fixture_path("llava"), prompt_cache=TEST_CACHE,
                          scheduler=SchedulerConfig(prefill_step_size=512, device_warmup=False))
    engine = await nursery.start(run_engine, config)
    base_url = await start_server(engine)
    truncated = png(1)[:80]
    response = await post(base_url, {"messages": [user("a", png(2), truncated)], "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].content[1].image_url.url"
    assert "cannot be decoded" in response.json()["error"]["message"]
    # The text spelling the placeholder itself would take an image's place.
    response = await post(base_url, {"messages": [user("a <image> here", png(2))], "max_tokens": 1})
    assert response.status_code == 400
    assert "placeholder" in response.json()["error"]["message"]
    # The server keeps serving.
    response = await post(base_url, {"messages": [user("fine", png(2))], "max_tokens": 1})
    assert response.status_code == 200


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_the_split_model_gives_mlx_vlm_s_logits(family) -> None:
    """mlx-vlm's tower into mlx-lm's text model (M-RoPE families: mlx-vlm's layers at shifted positions):
    the logits of mlx-vlm's whole model, on two images and on one."""
    import mlx.core as mx
    from mlx_vlm.utils import load_model as load_vlm

    from mlxcel.model.loader import load_model
    from mlxcel.vision.encoder import VisionEncoder
    from mlxcel.vision.images import decode
    from mlxcel.vision.processing import ImagePreparer, expand

    folder = vision_fixture_path(family)
    loaded = load_model(folder)
    assert loaded.vision is not None
    encoder = VisionEncoder(folder, loaded.model, mrope=loaded.vision.mrope)

    def ours(tokens, vision):
        embeddings, positions = encoder.embed(list(tokens), vision)
        ids = mx.array(tokens)[None]
        if positions is None:
            return loaded.model(ids, input_embeddings=embeddings)
        return encoder.forward(ids, embeddings, positions, cache=None)

    def extras(image) -> dict:
        return {name: mx.array(value) for name, value in image.extras}

    preparer = ImagePreparer(loaded.vision)
    images = [preparer.prepare(decode(png(seed), "p")) for seed in (1, 2)]
    placeholder = loaded.vision.image_token_id
    tokens, vision = expand([1, 2, placeholder, 3, placeholder, 4, 5], loaded.vision, images)
    assert len(tokens) == 5 + sum(len(image.tokens) for image in images)
    reference = load_vlm(folder)
    table = reference.language_model.model.embed_tokens(mx.array(tokens)[None])
    for (start, end), image in zip(vision.spans, vision.images, strict=True):
        features = reference.get_input_embeddings(mx.array(tokens[start:end])[None], mx.array(image.pixel_values),
                                                  **extras(image)).inputs_embeds
        table = mx.concatenate([table[:, :start], features, table[:, end:]], axis=1)
    grids = {}
    if loaded.vision.mrope:
        grids = {"image_grid_thw": mx.concatenate([extras(image)["image_grid_thw"] for image in images])}
    expected = reference.language_model(mx.array(tokens)[None], inputs_embeds=table, **grids).logits
    split = ours(tokens, vision)
    assert float(mx.abs(split - expected).max()) < 1e-4
    # One image: mlx-vlm's whole model (its own merge over the whole prompt) agrees too.
    single, alone = expand([1, 2, placeholder, 3], loaded.vision, images[:1])
    whole = reference(mx.array(single)[None], mx.array(images[0].pixel_values), mask=None,
                      **extras(images[0])).logits
    assert float(mx.abs(ours(single, alone) - whole).max()) < 1e-4
    # The images change the output (the tower is not bypassed).
    assert float(mx.abs(split - loaded.model(mx.array(tokens)[None])).max()) > 1e-3


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_an_mrope_prefill_decodes_on_in_mlx_lm_as_mlx_vlm_does(family) -> None:
    """Qwen2-VL and Qwen2.5-VL: after a prefill at shifted positions, mlx-lm's text model at the cache index gives the
    logits mlx-vlm's own decode gives at the true position (index plus the rope delta)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model as load_vlm

    from mlxcel.model.loader import load_model
    from mlxcel.vision.encoder import VisionEncoder
    from mlxcel.vision.images import decode
    from mlxcel.vision.processing import ImagePreparer, expand

    folder = vision_fixture_path(family)
    loaded = load_model(folder)
    assert loaded.vision is not None
    image = ImagePreparer(loaded.vision).prepare(decode(png(3, size=(90, 40)), "p"))
    # The placeholder as the template renders it: <|vision_start|><|image_pad|><|vision_end|>.
    placeholder = loaded.tokenizer.encode(loaded.vision.placeholder)
    assert len(placeholder) == 3
    tokens, vision = expand([1, 2, *placeholder, 3], loaded.vision, [image])
    encoder = VisionEncoder(folder, loaded.model, mrope=True)
    embeddings, positions = encoder.embed(list(tokens), vision)
    ours_cache = make_prompt_cache(loaded.model)
    encoder.forward(mx.array(tokens)[None], embeddings, positions, ours_cache)
    reference = load_vlm(folder)
    reference_cache = make_prompt_cache(loaded.model)
    grid = mx.array(dict(image.extras)["image_grid_thw"])
    reference(mx.array(tokens)[None], mx.array(image.pixel_values), mask=None, cache=reference_cache,
              image_grid_thw=grid)
    delta = int(reference.language_model._rope_deltas.reshape(-1)[0].item())
    assert delta < 0  # the image takes fewer positions than tokens
    for token in (7, 8):
        step = mx.array([[token]])
        ours = loaded.model(step, cache=ours_cache)
        expected = reference.language_model(step, cache=reference_cache).logits
        assert float(mx.abs(ours - expected).max()) < 1e-4


async def test_anthropic_image_blocks_reach_the_cache(serve_vision) -> None:
    """The same image as an OpenAI data URL, then as an Anthropic base64 block: one digest, one entry."""
    import anthropic

    engine, openai_client = await serve_vision("mistral3")
    client = anthropic.Anthropic(base_url=str(openai_client.base_url).removesuffix("/v1/"), api_key="unused",
                                 max_retries=0, timeout=120)
    screenshot = png(4)
    (ok,) = engine.model.tokenizer.encode("ok")
    first = await create(openai_client, engine.model_id, [{"role": "system", "content": SYSTEM},
                                                          user("what is shown?", screenshot)],
                         logit_bias={str(ok): 100}, max_tokens=1)

    def block(data: bytes) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(data).decode()}}

    async def send(messages: list):
        return await trio.to_thread.run_sync(partial(client.messages.create, model=engine.model_id, system=SYSTEM,
                                                     messages=messages, max_tokens=1))

    def follow_up(data: bytes) -> list:
        return [{"role": "user", "content": [block(data), {"type": "text", "text": "what is shown?"}]},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]

    counted = await trio.to_thread.run_sync(partial(client.messages.count_tokens, model=engine.model_id, system=SYSTEM,
                                                    messages=follow_up(screenshot)[:1]))
    # The image counts as its run of placeholder tokens, as in the OpenAI request's usage.
    assert counted.input_tokens == first.usage.prompt_tokens
    hit = await send(follow_up(screenshot))
    assert hit.usage.cache_read_input_tokens >= first.usage.prompt_tokens
    missed = await send(follow_up(png(5)))
    assert missed.usage.cache_read_input_tokens == 0
    with pytest.raises(anthropic.BadRequestError, match="media_type"):
        await send([{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AAAA"}}]}])


async def test_responses_input_images_and_previous_response_id_reuse_the_entry(serve_vision) -> None:
    engine, client = await serve_vision("llava")
    image = {"type": "input_image", "image_url": data_url(png(6))}
    create = partial(client.responses.create, model=engine.model_id, instructions=SYSTEM, temperature=0,
                     max_output_tokens=1)
    first = await trio.to_thread.run_sync(partial(create, input=[
        {"role": "user", "content": [image, {"type": "input_text", "text": "what is shown?"}]}]))
    assert first.usage.input_tokens_details.cached_tokens == 0
    # The stored conversation carries the image: the next turn has the same digest and adopts the first turn.
    second = await trio.to_thread.run_sync(partial(create, previous_response_id=first.id, input="and then?"))
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
async def test_bucketed_starts_answer_images_as_the_plain_path_does(serve_vision, family, monkeypatch) -> None:
    """CUDA's shape buckets, forced on with small buckets: a padded cold start over embeddings (and, for
    M-RoPE, positions) and a cut hit give the plain path's first-token logprobs."""
    from mlxcel.core import placement

    monkeypatch.setattr(placement, "START_PREFIX_ALIGN", 16)
    monkeypatch.setattr(placement, "START_QUERY_BUCKET", 32)
    servers = {buckets: await serve_vision(family, scheduler=SchedulerConfig(
        prefill_step_size=64, device_warmup=False, start_buckets=buckets)) for buckets in (False, True)}
    replies: dict[str, list] = {}
    for buckets, (engine, client) in servers.items():
        (ok,) = engine.model.tokenizer.encode("ok")
        messages = [{"role": "system", "content": SYSTEM}, user("what is on the screen?", png(7))]
        first = await create(client, engine.model_id, messages, logit_bias={str(ok): 100}, max_tokens=1,
                             logprobs=True, top_logprobs=5)
        follow_up = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
        replies[buckets] = [first, await create(client, engine.model_id, follow_up, logprobs=True, top_logprobs=5)]
    for bucketed, plain in zip(replies[True], replies[False], strict=True):
        assert cached(bucketed) == cached(plain)
        hot, reference = first_logprobs(bucketed), first_logprobs(plain)
        assert hot.keys() == reference.keys()
        assert max(abs(hot[token] - value) for token, value in reference.items()) < 1e-4
    assert cached(replies[True][1]) >= replies[True][0].usage.prompt_tokens - 16


@pytest.mark.parametrize("family", ["mistral3", "qwen2_5_vl"])
async def test_a_reply_that_re_renders_differently_still_leaves_the_prompt_entry(serve_vision, family) -> None:
    """The prompt is stored at the end of its prefill too: a next turn whose reply tokens part from the
    stored reply (any random reply, re-tokenized) adopts the first prompt, image included, up to its
    generation prompt (where the prompt's entry ends)."""
    engine, client = await serve_vision(family)
    messages = [{"role": "system", "content": SYSTEM}, user("describe it", png(8))]
    first = await create(client, engine.model_id, messages, max_tokens=6)
    follow_up = [*messages, {"role": "assistant", "content": first.choices[0].message.content + " (edited)"},
                 {"role": "user", "content": "shorter"}]
    hit = await create(client, engine.model_id, follow_up)
    generation_prompt = len(engine.model.tokenizer.encode("<|im_start|>assistant\n"))
    assert cached(hit) >= first.usage.prompt_tokens - generation_prompt
    # Between the prompt's entry and the reply's, one entry's bytes (the prompt's is an alias of the reply's).
    stats = await engine.cache_stats()
    assert stats["aliases"] >= 1
