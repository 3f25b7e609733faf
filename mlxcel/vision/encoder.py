"""The vision tower on the device thread: a prompt's input embeddings with its images' features in place.

mlx-vlm builds the family's model from the folder; its vision tower,
projector and embedding merge are used (`get_input_embeddings`, one image at
a time over that image's token run). The text model is mlx-lm's
(`mlxcel/model/loader.py`): it runs the embeddings, fills an ordinary KV
cache and decodes in the batch. Text between the images is embedded by that
text model's own table.

For plain-RoPE families mlx-vlm's language layers are dropped at load. The
M-RoPE families (Qwen2-VL, Qwen2.5-VL) keep them, sharing mlx-lm's weight
arrays: a prompt with images is prefilled through mlx-vlm's layers, which
take 3-D positions, every position moved up by the prompt's rope delta so
that the text after the last image sits at its own index (see
`mlxcel/vision/processing.py`); mlx-lm's layers then carry on from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxcel.vision.processing import VisionInputs


class VisionEncoder:
    def __init__(self, folder: Path, text_model: Any, *, mrope: bool = False) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_vlm.utils import load_model

        model = load_model(Path(folder))
        language = model.language_model
        self._mrope = mrope
        if mrope:
            # The same arrays as mlx-lm's text model: no second copy of the language weights.
            shared = dict(tree_flatten(text_model.language_model.parameters()))
            own = dict(tree_flatten(language.parameters()))
            missing = sorted(set(own) - set(shared) - {"lm_head.weight"})
            if any(not name.endswith("inv_freq") for name in missing):
                raise ValueError(f"the text model lacks weights mlx-vlm's layers need: {missing[:3]}")
            language.update(_unflatten({name: value for name, value in shared.items() if name in own}),
                            strict=False)
        else:
            # The language model runs in mlx-lm; keep only what get_input_embeddings reads (the embedding table).
            inner = getattr(language, "model", language)
            inner.layers = []
            if hasattr(language, "lm_head"):
                del language.lm_head
        self._model = model
        self._embed_tokens = _embedding_table(text_model)
        mx.eval(model.parameters())

    def embed(self, tokens: list[int], vision: VisionInputs) -> tuple[Any, Any]:
        """The input embeddings of a whole prompt, (1, len(tokens), hidden), and its positions.

        Positions: None for plain-RoPE families; for M-RoPE families (3, 1, len(tokens)), shifted so
        that the text after the last image is at its index.
        """
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
        embeddings = mx.concatenate(pieces, axis=1)
        if not self._mrope:
            return embeddings, None
        grids = mx.concatenate([mx.array(dict(image.extras)["image_grid_thw"]) for image in vision.images], axis=0)
        positions, deltas = self._model.language_model.get_rope_index(mx.array(tokens)[None], grids)
        return embeddings, positions - deltas.reshape(1, -1, 1).astype(positions.dtype)

    def forward(self, tokens: Any, embeddings: Any, positions: Any, cache: list[Any]) -> Any:
        """mlx-vlm's language layers over embeddings at M-RoPE positions, into mlx-lm's caches; the logits."""
        return self._model.language_model(tokens, embeddings, cache=cache, position_ids=positions).logits


def _unflatten(flat: dict[str, Any]) -> Any:
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(flat.items()))


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
