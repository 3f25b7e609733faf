"""Hostile image requests through HTTP: sizes that would blow up a processor, refused before decoding."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from mlxcel.config import EngineConfig, SchedulerConfig
from mlxcel.engine import run_engine
from mlxcel.vision.fixtures import vision_fixture_path
from tests.support import TEST_CACHE


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
                              scheduler=SchedulerConfig(prefill_step_size=512, device_warmup="false"))
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
