"""The vision tower on the device thread: a prompt's input embeddings with its images' features in place.

mlx-vlm builds the family's model from the folder; only its vision tower,
projector and embedding merge are used (`get_input_embeddings`, one image at
a time over that image's token run). Its language model layers are dropped
at load: the text model is mlx-lm's (`mlxcel/model/loader.py`), which runs
the embeddings, fills an ordinary KV cache and decodes in the batch. Text
between the images is embedded by that text model's own table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxcel.vision.processing import VisionInputs


class VisionEncoder:
    def __init__(self, folder: Path, text_model: Any) -> None:
        import mlx.core as mx
        from mlx_vlm.utils import load_model

        model = load_model(Path(folder))
        # The language model runs in mlx-lm; keep only what get_input_embeddings reads (the embedding table).
        language = model.language_model
        inner = getattr(language, "model", language)
        inner.layers = []
        if hasattr(language, "lm_head"):
            del language.lm_head
        self._model = model
        self._embed_tokens = _embedding_table(text_model)
        mx.eval(model.parameters())

    def embed(self, tokens: list[int], vision: VisionInputs) -> Any:
        """The input embeddings of a whole prompt, shape (1, len(tokens), hidden)."""
        import mlx.core as mx

        pieces = []
        previous = 0
        for (start, end), image in zip(vision.spans, vision.images, strict=True):
            if start > previous:
                pieces.append(self._embed_tokens(mx.array(tokens[previous:start])[None]))
            extras = {name: mx.array(value) for name, value in image.extras}
            features = self._model.get_input_embeddings(
                mx.array(tokens[start:end])[None], mx.array(image.pixel_values), **extras)
            pieces.append(features.inputs_embeds.astype(pieces[0].dtype if pieces else features.inputs_embeds.dtype))
            previous = end
        if previous < len(tokens):
            pieces.append(self._embed_tokens(mx.array(tokens[previous:])[None]))
        return mx.concatenate(pieces, axis=1)


def _embedding_table(text_model: Any) -> Any:
    """mlx-lm's embedding module of a vision checkpoint's text model."""
    for path in (("language_model", "model", "embed_tokens"), ("model", "embed_tokens")):
        module = text_model
        for name in path:
            module = getattr(module, name, None)
            if module is None:
                break
        if module is not None:
            return module
    raise ValueError(f"cannot find the embedding table of {type(text_model).__name__}")
