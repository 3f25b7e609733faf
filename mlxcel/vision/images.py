"""An image part's bytes: where they come from, fetched within limits, decoded and checked.

Pure: no Trio, no MLX. Validation (`mlxcel/http/validation.py`) decodes
``data:`` URLs at once and checks the policy of ``file://`` and remote URLs;
the router reads those in its worker thread (`resolve`) and decodes every
image (`decode`) before the prompt is tokenized. Every failure is an
`InvalidRequest` naming the part.
"""

from __future__ import annotations

import io
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxcel.errors import InvalidRequest
from mlxcel.types import ImageSource as ImageSource

# What a content part's text stands for until the router swaps in the model's own placeholder.
IMAGE_SENTINEL = "\ue000mlxcel:image\ue000"
# Formats by their first bytes: what PIL decodes here and what clients send.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpeg"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
)
FORMATS = ("png", "jpeg", "gif", "webp", "bmp")
# Larger images are refused before decoding (a decompression bomb of a few kilobytes can be gigapixels).
MAX_IMAGE_PIXELS = 50_000_000
# Sides that differ more are refused before decoding: a processor that scales the short side up to its
# resolution would make a 1 x 7,000,000 strip gigapixels (Qwen2-VL's own processor refuses past 200).
MAX_ASPECT_RATIO = 200


def image_format(data: bytes) -> str | None:
    """The image format the bytes begin with, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    return None


def check_bytes(data: bytes, param: str, max_bytes: int) -> bytes:
    if len(data) > max_bytes:
        raise InvalidRequest(f"{param}: the image is {len(data)} bytes, over this server's limit of {max_bytes}",
                             param=param, code="invalid_value")
    if not data:
        raise InvalidRequest(f"{param}: the image is empty", param=param, code="invalid_value")
    if image_format(data) is None:
        raise InvalidRequest(f"{param}: not an image this server reads (expected one of {', '.join(FORMATS)})",
                             param=param, code="invalid_value")
    return data


def resolve(source: ImageSource) -> bytes:
    """The part's bytes: already there (data URL), read from a file, or fetched (allowed by validation)."""
    if source.data is not None:
        return source.data
    url = source.url
    assert url is not None, "validation gives every part data or a URL"
    if url.startswith("file://"):
        return _read_file(Path(url.removeprefix("file://")), source)
    return _fetch(url, source)


def _read_file(path: Path, source: ImageSource) -> bytes:
    try:
        with path.open("rb") as file:
            data = file.read(source.max_bytes + 1)
    except OSError as error:
        raise InvalidRequest(f"{source.param}: cannot read the image file: {error.strerror or error}",
                             param=source.param, code="invalid_value") from None
    return check_bytes(data, source.param, source.max_bytes)


def _fetch(url: str, source: ImageSource) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "mlxcel", "Accept": "image/*"})
    try:
        with urllib.request.urlopen(request, timeout=source.timeout_s) as response:  # noqa: S310 - scheme checked
            data = response.read(source.max_bytes + 1)
    except urllib.error.HTTPError as error:
        error.close()  # it holds the response's socket
        raise InvalidRequest(f"{source.param}: cannot fetch the image: HTTP {error.code}",
                             param=source.param, code="invalid_value") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        raise InvalidRequest(f"{source.param}: cannot fetch the image: {reason}",
                             param=source.param, code="invalid_value") from None
    return check_bytes(data, source.param, source.max_bytes)


def check_dimensions(width: int, height: int, param: str) -> None:
    """Refuse, from the header's size alone, an image no model here can take (before any pixel is decoded)."""
    if width < 1 or height < 1:
        raise InvalidRequest(f"{param}: the image is {width}x{height} pixels", param=param, code="invalid_value")
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidRequest(f"{param}: the image is {width}x{height} pixels, over this server's limit of "
                             f"{MAX_IMAGE_PIXELS}", param=param, code="invalid_value")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise InvalidRequest(f"{param}: the image is {width}x{height} pixels; its sides may differ at most "
                             f"{MAX_ASPECT_RATIO}-fold", param=param, code="invalid_value")


def decode(data: bytes, param: str, check: Callable[[int, int], None] | None = None) -> Any:
    """The image as an RGB PIL image; a 400 naming the part when it does not decode.

    PIL's ``open`` reads only the header, so the size is checked (and then
    ``check``, a model's bound on what its processor would resize it to)
    before the pixels are decoded.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            check_dimensions(width, height, param)
            if check is not None:
                check(width, height)
            opened.load()
            return opened.convert("RGB")
    except InvalidRequest:
        raise
    except Exception as error:  # noqa: BLE001 - PIL raises many kinds for a corrupt file (MemoryError included)
        raise InvalidRequest(f"{param}: the image cannot be decoded: {error}", param=param,
                             code="invalid_value") from None
