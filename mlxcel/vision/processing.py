"""What a vision model needs of an image before the device sees it: pixel values and its placeholder tokens.

Pure: no Trio, no MLX (the image processors are transformers' PIL ones).
`vision_spec` reads a model folder's ``config.json`` (and
``preprocessor_config.json``) into a `VisionSpec`: which family, its image
token, and how an image turns into pixels and into a run of tokens in the
prompt. The router renders each image part as the family's placeholder,
tokenizes, and `expand` replaces every placeholder token with that image's
run; the device later writes the vision tower's features over those rows.

Families served: ``llava`` (a CLIP tower, a fixed number of tokens per image),
``mistral3`` (Pixtral's tower, rows of ``[IMG]`` split by ``[IMG_BREAK]``
and closed by ``[IMG_END]``), and ``qwen2_vl`` / ``qwen2_5_vl`` (a run of
``<|image_pad|>`` between ``<|vision_start|>`` and ``<|vision_end|>``, one
token per 2x2 merged patches). The first two run a plain-RoPE language
model. The Qwen families rotate with M-RoPE: an image's tokens take 3-D
(time, row, column) positions and the text after an image continues from
the largest of them, behind its index by the prompt's ``rope_delta``. The
device prefills such a prompt with every position moved up by that delta
(attention sees only differences of positions, so the logits are the
same), which puts the text after the last image at its own index, where
mlx-lm's text model rotates it when it decodes or extends the prompt.
Other vision families are refused by name (``refusal``): Qwen3-VL feeds
image features into later layers too (deepstack), not only the embeddings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from mlxcel.errors import InvalidRequest

SUPPORTED_FAMILIES = ("llava", "mistral3", "qwen2_vl", "qwen2_5_vl")
# The families whose image tokens take multi-axis positions (see the module's docstring).
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
_REFUSALS = {
    "qwen3_vl": "Qwen3-VL adds image features inside later layers (deepstack), which the text model cannot take",
    "qwen3_vl_moe": "Qwen3-VL adds image features inside later layers (deepstack), which the text model cannot take",
}


@attrs.frozen(kw_only=True)
class VisionSpec:
    """A vision model's image handling, as the router and the device need it (plain values)."""

    family: str
    # Why images are refused for this model (a vision family this server does not serve); None: served.
    refusal: str | None = None
    image_token_id: int = -1
    # The text an image part renders as in the chat template (one token).
    placeholder: str = ""
    break_token_id: int | None = None
    end_token_id: int | None = None
    # llava: the tokens of every image; mistral3: the side of one token's square of pixels;
    # qwen: patches merged into one token (merge_size squared).
    tokens_per_image: int = 0
    patch: int = 0
    # Image tokens take M-RoPE positions (the Qwen families).
    mrope: bool = False
    processor_config: dict[str, Any] = attrs.field(factory=dict, repr=False, eq=False)


@attrs.frozen(kw_only=True, eq=False)
class PreparedImage:
    """One image ready for the vision tower: pixel values (numpy), extra tower inputs, its prompt tokens."""

    pixel_values: Any = attrs.field(repr=False)
    # mlx-vlm's keyword inputs beside the pixels (mistral3: image_sizes), numpy values.
    extras: tuple[tuple[str, Any], ...] = attrs.field(default=(), repr=False)
    tokens: tuple[int, ...] = attrs.field(repr=False)


@attrs.frozen(kw_only=True, eq=False)
class VisionInputs:
    """A request's images as the device encodes them: each image and its token span in the prompt."""

    images: tuple[PreparedImage, ...] = attrs.field(repr=False)
    spans: tuple[tuple[int, int], ...]
    # Where the prompt's own cache entry ends (None: the whole prompt): before the generation prompt,
    # which an exact resend runs again and a next turn may re-tokenize along with the reply.
    entry_end: int | None = None

    @property
    def end(self) -> int:
        """The prompt position just past the last image token: a KV prefix must cover it to skip the tower."""
        return self.spans[-1][1]


def _token_id(tokenizer: Any, text: str) -> int:
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    token_id = backend.convert_tokens_to_ids(text)
    if not isinstance(token_id, int) or token_id < 0:
        raise ValueError(f"the tokenizer has no {text!r} token")
    return token_id


def vision_spec(config: dict[str, Any], folder: Path, tokenizer: Any) -> VisionSpec | None:
    """The vision handling of a model folder; None for a text-only model."""
    if "vision_config" not in config:
        return None
    family = str(config.get("model_type", ""))
    if family not in SUPPORTED_FAMILIES:
        reason = _REFUSALS.get(family, f"the {family!r} vision family is not served by this server "
                                       f"(served: {', '.join(SUPPORTED_FAMILIES)})")
        return VisionSpec(family=family, refusal=reason)
    preprocessor_file = folder / "preprocessor_config.json"
    processor_config = json.loads(preprocessor_file.read_text()) if preprocessor_file.is_file() else {}
    vision = config["vision_config"] if isinstance(config["vision_config"], dict) else {}
    image_token_id = int(config.get("image_token_index", config.get("image_token_id", -1)))
    if family in MROPE_FAMILIES:
        merge = int(vision.get("spatial_merge_size", 2))
        return VisionSpec(family=family, image_token_id=int(config.get("image_token_id", 151655)),
                          placeholder="<|vision_start|><|image_pad|><|vision_end|>", patch=merge * merge, mrope=True,
                          processor_config=processor_config)
    if family == "llava" and vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        return VisionSpec(family=family, refusal=f"llava with a {vision.get('model_type')!r} vision tower is not "
                                                 "served (only CLIP's)")
    if family == "llava":
        side = int(vision.get("image_size", 336)) // int(vision.get("patch_size", 14))
        extra = 0 if config.get("vision_feature_select_strategy", "default") == "default" else 1
        return VisionSpec(family=family, image_token_id=image_token_id, placeholder="<image>",
                          tokens_per_image=side * side + extra, processor_config=processor_config)
    patch = int(vision.get("patch_size", 14)) * int(config.get("spatial_merge_size", 2))
    return VisionSpec(family=family, image_token_id=image_token_id, placeholder="[IMG]",
                      break_token_id=_token_id(tokenizer, "[IMG_BREAK]"),
                      end_token_id=_token_id(tokenizer, "[IMG_END]"), patch=patch, processor_config=processor_config)


# The most pixels an image may be resized to before a processor crops or patches it (float32 RGB: 192 MiB).
MAX_RESIZED_PIXELS = 1 << 24
_PROCESSOR_KEYS = ("do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor",
                   "do_normalize", "image_mean", "image_std", "do_convert_rgb")
_QWEN_PROCESSOR_KEYS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")


class ImagePreparer:
    """Turns decoded images into `PreparedImage` for one model (its image processor is built once)."""

    def __init__(self, spec: VisionSpec) -> None:
        if spec.refusal is not None:
            raise ValueError(spec.refusal)
        self.spec = spec
        keys = _PROCESSOR_KEYS + (_QWEN_PROCESSOR_KEYS if spec.mrope else ())
        config = {key: spec.processor_config[key] for key in keys if key in spec.processor_config}
        if spec.family == "llava":
            from transformers import CLIPImageProcessorPil

            self._processor: Any = CLIPImageProcessorPil(**config)
        elif spec.mrope:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            self._processor = Qwen2VLImageProcessorPil(**config)
        else:
            from transformers import PixtralImageProcessorPil

            self._processor = PixtralImageProcessorPil(**config)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) this model's processor resizes an image of that size to, computed from the size
        alone (the processors' own rules), so a target too large is refused before anything is decoded."""
        size = self._processor.size
        if self.spec.mrope:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

            factor = int(self._processor.patch_size) * int(self._processor.merge_size)
            resized_height, resized_width = smart_resize(height, width, factor=factor,
                                                         min_pixels=size.shortest_edge, max_pixels=size.longest_edge)
            return int(resized_width), int(resized_height)
        if size.shortest_edge:  # CLIP: the short side scaled to shortest_edge
            short = min(width, height)
            return math.ceil(width * size.shortest_edge / short), math.ceil(height * size.shortest_edge / short)
        if size.longest_edge:  # Pixtral: scaled down until the long side fits
            ratio = max(width, height) / size.longest_edge
            return (width, height) if ratio <= 1 else (math.floor(width / ratio), math.floor(height / ratio))
        return int(size.width or width), int(size.height or height)

    def check_size(self, width: int, height: int, param: str) -> None:
        """A 400 naming the part when the processor would resize the image to nothing or to too many pixels."""
        try:
            resized_width, resized_height = self.resized_size(width, height)
        except (ValueError, ZeroDivisionError, OverflowError) as error:
            raise InvalidRequest(f"{param}: a {width}x{height} image cannot be prepared for this model: {error}",
                                 param=param, code="invalid_value") from None
        if resized_width < 1 or resized_height < 1 or resized_width * resized_height > MAX_RESIZED_PIXELS:
            raise InvalidRequest(
                f"{param}: a {width}x{height} image would be resized to {resized_width}x{resized_height} pixels "
                f"for this model (at most {MAX_RESIZED_PIXELS} and at least 1x1)", param=param, code="invalid_value")

    def prepare(self, image: Any) -> PreparedImage:
        spec = self.spec
        if spec.family == "llava":
            pixels = self._processor(images=[image], return_tensors="np")["pixel_values"]
            return PreparedImage(pixel_values=pixels.astype("float32"),
                                 tokens=(spec.image_token_id,) * spec.tokens_per_image)
        if spec.mrope:
            out = self._processor(images=[image], return_tensors="np")
            grid = out["image_grid_thw"][:1]
            count = int(grid[0].prod()) // spec.patch
            return PreparedImage(pixel_values=out["pixel_values"].astype("float32"),
                                 extras=(("image_grid_thw", grid),), tokens=(spec.image_token_id,) * count)
        out = self._processor(images=[image], return_tensors="np",
                              patch_size={"height": spec.patch, "width": spec.patch})
        height, width = (int(value) for value in out["image_sizes"][0])
        rows, columns = height // spec.patch, width // spec.patch
        assert spec.break_token_id is not None
        assert spec.end_token_id is not None
        tokens: list[int] = []
        for row in range(rows):
            tokens += [spec.image_token_id] * columns
            tokens.append(spec.break_token_id if row < rows - 1 else spec.end_token_id)
        return PreparedImage(pixel_values=out["pixel_values"][:, :, :height, :width].astype("float32"),
                             extras=(("image_sizes", out["image_sizes"][:1]),), tokens=tuple(tokens))


def expand(tokens: Sequence[int], spec: VisionSpec, images: Sequence[PreparedImage], *,
           entry_end: int | None = None) -> tuple[tuple[int, ...], VisionInputs]:
    """The prompt with each image's placeholder token replaced by its run, and where the runs lie.

    ``entry_end`` is a position in ``tokens`` where the prompt's cache entry
    should end (the end of the last message, before the generation prompt);
    it moves with the runs, and is kept only past the last image. Without
    it, or when it is not past the images, the entry ends one token short
    of the prompt (a resend of it prefills that one token again).

    A 400 when the rendered prompt holds a different number of placeholders
    than the request has images (the text spelled the placeholder itself, or
    the template dropped an image).
    """
    positions = [index for index, token in enumerate(tokens) if token == spec.image_token_id]
    if len(positions) != len(images):
        raise InvalidRequest(
            f"the rendered prompt holds {len(positions)} image placeholders ({spec.placeholder!r}) for "
            f"{len(images)} images: the text may not spell the placeholder itself", param="messages",
            code="invalid_value")
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    previous = 0
    for position, image in zip(positions, images, strict=True):
        out.extend(tokens[previous:position])
        spans.append((len(out), len(out) + len(image.tokens)))
        out.extend(image.tokens)
        previous = position + 1
    out.extend(tokens[previous:])
    image_end = spans[-1][1] if spans else 0
    end = len(out) - 1
    if entry_end is not None and positions and positions[-1] < entry_end < len(tokens):
        end = entry_end + (len(out) - len(tokens))
    return tuple(out), VisionInputs(images=tuple(images), spans=tuple(spans),
                                    entry_end=end if end > image_end else None)


def stray_placeholder(tokens: Sequence[int], spec: VisionSpec) -> int | None:
    """The index of the first image placeholder token in a prompt that carries no image (None: none)."""
    if spec.image_token_id < 0:
        return None
    try:
        return list(tokens).index(spec.image_token_id)
    except ValueError:
        return None
