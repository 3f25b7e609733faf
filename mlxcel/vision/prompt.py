"""A chat request's images on their way into the prompt: read, digested, prepared, placed (the router's part).

Pure: no Trio, no MLX. Runs in the router's worker thread, so reading a
file or fetching a URL there holds up no other request's rendering beyond
its slot.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mlxcel.cache.key import multimodal_digest
from mlxcel.errors import InvalidRequest
from mlxcel.types import ImageSource
from mlxcel.vision.images import IMAGE_SENTINEL, decode, resolve
from mlxcel.vision.processing import (
    ImagePreparer,
    PreparedImage,
    VisionInputs,
    VisionSpec,
    expand,
    stray_placeholder,
)

UNSUPPORTED_MESSAGE = "multimodal input is not supported by this model"


@attrs.frozen(kw_only=True, eq=False)
class ReadImages:
    digest: bytes
    prepared: tuple[PreparedImage, ...] = attrs.field(repr=False)


class ImagePrompts:
    """One model's way from image parts to prompt tokens (refuses every image for a text model)."""

    def __init__(self, spec: VisionSpec | None) -> None:
        self._spec = spec
        self._preparer = ImagePreparer(spec) if spec is not None and spec.refusal is None else None

    def read(self, sources: Sequence[ImageSource]) -> ReadImages:
        """Every image's bytes, their digest in arrival order, and each prepared for the tower."""
        if self._preparer is None:
            reason = UNSUPPORTED_MESSAGE if self._spec is None else f"{UNSUPPORTED_MESSAGE}: {self._spec.refusal}"
            raise InvalidRequest(reason, param=sources[0].param, code="unsupported_content")
        payloads = [resolve(source) for source in sources]
        prepared = []
        preparer = self._preparer
        for source, data in zip(sources, payloads, strict=True):
            image = decode(data, source.param, functools.partial(self._check_size, param=source.param))
            try:
                prepared.append(preparer.prepare(image))
            except Exception as error:  # noqa: BLE001 - a processor's failure on one image is that part's 400
                raise InvalidRequest(f"{source.param}: the image cannot be prepared for this model: "
                                     f"{type(error).__name__}: {error}", param=source.param,
                                     code="invalid_value") from None
        return ReadImages(digest=multimodal_digest(payloads), prepared=tuple(prepared))

    def _check_size(self, width: int, height: int, *, param: str) -> None:
        assert self._preparer is not None
        self._preparer.check_size(width, height, param)

    def placeholders(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages with each image part's sentinel replaced by the model's placeholder text."""
        assert self._spec is not None
        placeholder = self._spec.placeholder
        out = []
        for message in messages:
            copy = dict(message)
            content = copy.get("content")
            if isinstance(content, str) and IMAGE_SENTINEL in content:
                copy["content"] = content.replace(IMAGE_SENTINEL, placeholder)
            out.append(copy)
        return out

    def expand(self, tokens: Sequence[int], images: ReadImages, *, entry_end: int | None = None
               ) -> tuple[tuple[int, ...], VisionInputs]:
        assert self._spec is not None
        return expand(tokens, self._spec, images.prepared, entry_end=entry_end)

    def refuse_stray_placeholders(self, tokens: Sequence[int], param: str) -> None:
        """A 400 naming the field when a prompt without images spells the model's image placeholder.

        The placeholder's id would reach the text model as if it were a word,
        where the model expects an image's features.
        """
        if self._spec is None or self._spec.refusal is not None:
            return
        index = stray_placeholder(tokens, self._spec)
        if index is not None:
            raise InvalidRequest(
                f"{param}: the text holds this model's image placeholder {self._spec.placeholder!r} (token "
                f"{self._spec.image_token_id} at position {index}) but no image part stands there; send the "
                "image as an image part", param=param, code="invalid_value")
