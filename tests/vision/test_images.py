"""Image parts: validation's checks and flags, the digest, fetching, and the router's refusals."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import numpy as np
import pytest
from PIL import Image

from mlxcel.cache.key import TEXT_ONLY_MM_DIGEST, multimodal_digest
from mlxcel.errors import InvalidRequest
from mlxcel.http.validation import Limits, parse_chat_request
from mlxcel.types import ImageSource
from mlxcel.vision.images import IMAGE_SENTINEL, decode, resolve


def png(seed: int = 0, size: tuple[int, int] = (8, 6)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def body(*urls: str, detail: str | None = None) -> dict:
    parts: list[dict] = [{"type": "text", "text": "look:"}]
    for url in urls:
        image: dict = {"url": url}
        if detail is not None:
            image["detail"] = detail
        parts.append({"type": "image_url", "image_url": image})
    return {"messages": [{"role": "user", "content": parts}]}


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def refused(request: dict, limits: Limits | None = None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(request, limits=limits or Limits())
    assert caught.value.status == 400
    return caught.value


def test_a_data_url_is_decoded_in_order_and_stands_in_the_content_as_a_sentinel() -> None:
    one, two = png(1), png(2)
    request = parse_chat_request(body(data_url(one), data_url(two, "image/jpeg")))
    assert [image.data for image in request.images] == [one, two]
    assert request.images[1].param == "messages[0].content[2].image_url.url"
    assert request.messages[0]["content"] == "look:" + IMAGE_SENTINEL * 2


@pytest.mark.parametrize(("url", "why"), [
    ("data:image/png;base64,not base64!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"plain text, no image").decode(), "not an image"),
    ("data:text/plain;base64," + base64.b64encode(b"x").decode(), "media type"),
    ("data:image/png," + "abc", "base64"),
    ("ftp://example.com/a.png", "data URL"),
])
def test_a_bad_image_is_a_400_naming_its_part(url: str, why: str) -> None:
    error = refused(body(data_url(png()), url))
    assert error.param == "messages[0].content[2].image_url.url"
    assert why in error.message


def test_limits_on_size_count_and_detail() -> None:
    assert "limit of 100 bytes" in refused(body(data_url(png(size=(64, 64)))), Limits(max_image_bytes=100)).message
    error = refused(body(data_url(png()), data_url(png())), Limits(max_images=1))
    assert error.param == "messages[0].content[2]"
    error = refused(body(data_url(png()), detail="high"))
    assert (error.param, error.code) == ("messages[0].content[1].image_url.detail", "unsupported_parameter")
    assert parse_chat_request(body(data_url(png()), detail="auto")).images


def test_file_and_remote_urls_only_where_a_flag_allows(tmp_path) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(png())
    error = refused(body(f"file://{image}"))
    assert (error.code, "--allow-image-files" in error.message) == ("unsupported_parameter", True)
    inside = parse_chat_request(body(f"file://{image}"), limits=Limits(image_file_root=str(tmp_path)))
    assert resolve(inside.images[0]) == png()
    outside = refused(body("file:///etc/passwd"), Limits(image_file_root=str(tmp_path)))
    assert "outside" in outside.message
    error = refused(body("https://example.com/a.png"))
    assert "--allow-image-urls" in error.message
    allowed = parse_chat_request(body("https://example.com/a.png"), limits=Limits(allow_image_urls=True,
                                                                                   image_fetch_timeout_s=2.5))
    assert (allowed.images[0].url, allowed.images[0].timeout_s) == ("https://example.com/a.png", 2.5)


def test_remote_images_are_fetched_within_the_size_limit(tmp_path) -> None:
    (tmp_path / "small.png").write_bytes(png())
    (tmp_path / "big.png").write_bytes(png(size=(128, 128)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        allow = ("127.0.0.1",)
        assert resolve(ImageSource(param="p", url=f"{base}/small.png", max_bytes=4096, fetch_allow=allow)) == png()
        with pytest.raises(InvalidRequest, match="over this server's limit"):
            resolve(ImageSource(param="p", url=f"{base}/big.png", max_bytes=4096, fetch_allow=allow))
        with pytest.raises(InvalidRequest, match="cannot fetch") as caught:
            resolve(ImageSource(param="messages[0].content[1]", url=f"{base}/missing.png", fetch_allow=allow))
        assert caught.value.param == "messages[0].content[1]"
        # What the remote said stays out of the message: no status code, no port.
        assert "404" not in caught.value.message
        assert str(server.server_address[1]) not in caught.value.message
    finally:
        server.shutdown()
        server.server_close()


def test_an_image_that_does_not_decode_is_a_400_naming_its_part() -> None:
    truncated = png(size=(32, 32))[:60]
    with pytest.raises(InvalidRequest, match="cannot be decoded") as caught:
        decode(truncated, "messages[0].content[1].image_url.url")
    assert caught.value.param == "messages[0].content[1].image_url.url"
    assert decode(png(), "p").size == (8, 6)


def test_the_digest_covers_the_bytes_in_order() -> None:
    one, two = png(1), png(2)
    assert multimodal_digest([]) == TEXT_ONLY_MM_DIGEST
    assert multimodal_digest([one, two]) == multimodal_digest([bytes(one), bytes(two)])
    assert multimodal_digest([one, two]) != multimodal_digest([two, one])
    assert multimodal_digest([one]) != multimodal_digest([two])
    # Length prefixes: moving bytes from one image to the next changes the digest.
    assert multimodal_digest([b"ab", b"c"]) != multimodal_digest([b"a", b"bc"])


def test_the_image_flags_reach_the_request_limits(tmp_path) -> None:
    from mlxcel.config import ServerConfig
    from mlxcel.http.validation import request_limits

    limits = request_limits(ServerConfig(max_images=2, max_image_bytes=1000, allow_image_files=str(tmp_path),
                                         allow_image_urls=True, image_fetch_timeout=3.0))
    assert (limits.max_images, limits.max_image_bytes, limits.image_file_root, limits.allow_image_urls,
            limits.image_fetch_timeout_s) == (2, 1000, str(tmp_path), True, 3.0)
    allowing = request_limits(ServerConfig(allow_image_urls=True, image_fetch_allow=("10.0.0.0/8", "images.lan")))
    assert allowing.image_fetch_allow == ("10.0.0.0/8", "images.lan")
    request = parse_chat_request(body("http://images.lan/a.png"), limits=allowing)
    assert request.images[0].fetch_allow == ("10.0.0.0/8", "images.lan")
    assert (Limits().image_file_root, Limits().allow_image_urls) == (None, False)


def test_vision_families_not_served_are_refused_by_name(tmp_path) -> None:
    from mlxcel.vision.processing import vision_spec

    assert vision_spec({"model_type": "llama"}, tmp_path, None) is None
    qwen = vision_spec({"model_type": "qwen3_vl", "vision_config": {}}, tmp_path, None)
    assert qwen is not None
    assert qwen.refusal is not None
    assert "deepstack" in qwen.refusal
    served = vision_spec({"model_type": "qwen2_5_vl", "vision_config": {}}, tmp_path, None)
    assert served is not None
    assert (served.refusal, served.mrope) == (None, True)
    pixtral_llava = vision_spec({"model_type": "llava", "vision_config": {"model_type": "pixtral"}}, tmp_path, None)
    assert pixtral_llava is not None
    assert "'pixtral' vision tower" in (pixtral_llava.refusal or "")
    other = vision_spec({"model_type": "idefics3", "vision_config": {}}, tmp_path, None)
    assert other is not None
    assert "served: llava, mistral3, qwen2_vl, qwen2_5_vl" in (other.refusal or "")


def test_a_refused_family_answers_images_with_its_reason() -> None:
    from mlxcel.vision.processing import VisionSpec
    from mlxcel.vision.prompt import ImagePrompts

    prompts = ImagePrompts(VisionSpec(family="qwen3_vl", refusal="Qwen3-VL adds image features inside later layers"))
    with pytest.raises(InvalidRequest) as caught:
        prompts.read([ImageSource(param="messages[0].content[1].image_url.url", data=png())])
    assert caught.value.code == "unsupported_content"
    assert caught.value.param == "messages[0].content[1].image_url.url"
    assert caught.value.message.endswith(": Qwen3-VL adds image features inside later layers")


def test_sizes_are_checked_from_the_header_before_decoding() -> None:
    """A 1 x 7,000,000 strip is refused by its aspect ratio; within it, CLIP at 336 pixels would still
    scale a 1 x 200 strip to 336 x 67,200 (22.6 megapixels): refused by the resize bound."""
    from mlxcel.vision.images import check_dimensions
    from mlxcel.vision.processing import ImagePreparer, VisionSpec

    with pytest.raises(InvalidRequest, match="200-fold"):
        check_dimensions(1, 7_000_000, "p")
    with pytest.raises(InvalidRequest, match="limit of"):
        check_dimensions(10_000, 10_000, "p")
    check_dimensions(1, 200, "p")
    clip = ImagePreparer(VisionSpec(family="llava", image_token_id=5, placeholder="<image>", tokens_per_image=4,
                                    processor_config={"size": {"shortest_edge": 336},
                                                      "crop_size": {"height": 336, "width": 336}}))
    assert clip.resized_size(1, 200) == (336, 67_200)
    with pytest.raises(InvalidRequest, match="resized to 336x67200") as caught:
        clip.check_size(1, 200, "messages[0].content[1].image_url.url")
    assert caught.value.param == "messages[0].content[1].image_url.url"
    clip.check_size(640, 480, "p")


def test_the_entry_end_moves_with_the_image_runs() -> None:
    from mlxcel.vision.processing import PreparedImage, VisionSpec, expand

    spec = VisionSpec(family="llava", image_token_id=9, placeholder="<image>", tokens_per_image=3)
    image = PreparedImage(pixel_values=None, tokens=(9, 9, 9))
    # 1 9 2 | 3 4: the messages end after token 2 (position 3), the generation prompt is 3 4.
    tokens, vision = expand([1, 9, 2, 3, 4], spec, [image], entry_end=3)
    assert tokens == (1, 9, 9, 9, 2, 3, 4)
    assert (vision.end, vision.entry_end) == (4, 5)
    # No end given (or one not past the images): one token short of the prompt.
    assert expand([1, 9, 2, 3, 4], spec, [image])[1].entry_end == 6
    assert expand([1, 9, 2, 3, 4], spec, [image], entry_end=1)[1].entry_end == 6
    # An image at the very end leaves nothing before it worth an entry of its own.
    assert expand([1, 2, 9], spec, [image])[1].entry_end is None
