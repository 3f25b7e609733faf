"""llama.cpp's dialect: `/completion` reply bodies (driven by mlxcel/http/openai_chat.py), `/tokenize`,
`/detokenize`, `/apply-template`, `/props`, `/slots` and `/models`.

Field names and meanings follow llama.cpp's server README (tools/server).
The tokenizer is the engine's (`engine.model.tokenizer`, a plain tokenizers
object: no MLX here); it runs in a worker thread, as the router runs it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import trio
from quart import Response

from mlxcel.engine import EngineHandle
from mlxcel.errors import InvalidRequest
from mlxcel.http.route import RouteContext, json_response
from mlxcel.http.validation import (
    parse_chat_request,
    read_bool,
    read_int,
    read_list,
    read_required,
    read_root,
    read_string,
)
from mlxcel.types import CompletionRequest, Delta, TokenLogprob, Usage

__all__ = ["NativeReply", "TokenizerRoutes", "infill_prompt", "models", "props", "select_fields",
           "slots"]

# Tokenizer-route requests tokenized at once (each in a thread of its own).
TOKENIZER_ROUTE_THREADS = 2


# --- token bytes -----------------------------------------------------------------


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(character): byte for byte, character in zip(printable, characters, strict=True)}


def _backend(tokenizer: Any) -> Any:
    # mlx-lm's TokenizerWrapper keeps the transformers tokenizer in `_tokenizer`.
    return getattr(tokenizer, "_tokenizer", tokenizer)


def vocabulary_size(tokenizer: Any) -> int:
    return len(_backend(tokenizer))


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's own bytes, which may be part of a UTF-8 character."""
    backend = _backend(tokenizer)
    piece = backend.convert_ids_to_tokens(token_id)
    decoder = _byte_decoder()
    if isinstance(piece, str) and all(character in decoder for character in piece):
        return bytes(decoder[character] for character in piece)
    return backend.decode([token_id]).encode("utf-8")


def _piece(raw: bytes) -> str | list[int]:
    # llama.cpp: the piece as a string when it is valid UTF-8, else its bytes.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


# --- /tokenize and /detokenize ------------------------------------------------------


class TokenizerRoutes:
    """What bounds `/tokenize` and `/detokenize`: the prompt's own character bound (text that cannot fit
    the context is refused before it is tokenized: 15 MB took 25-59 s and +4 GB), the context size for
    ids, and threads of their own, so huge bodies never take the pool that rendering and parsing share."""

    def __init__(self, engine: EngineHandle, *, max_concurrent: int = TOKENIZER_ROUTE_THREADS) -> None:
        self._engine = engine
        self._limiter = trio.CapacityLimiter(max_concurrent)

    @functools.cached_property
    def max_chars(self) -> int:
        from mlxcel.actors.router import FALLBACK_CHARS_PER_TOKEN
        from mlxcel.model.tokenize import max_chars_per_token

        model = self._engine.model
        return model.context_size * (max_chars_per_token(model.tokenizer) or FALLBACK_CHARS_PER_TOKEN)

    @property
    def max_ids(self) -> int:
        return self._engine.model.context_size

    async def tokenize(self, context: RouteContext) -> Response:
        root = read_root(await context.read_body())
        content = read_string(read_required(root, "content"), "content")
        if len(content) > self.max_chars:
            raise InvalidRequest(
                f"content is {len(content)} characters, more than this model's context can hold "
                f"({self.max_chars} characters at most)", param="content", code="context_length_exceeded")
        return json_response(await trio.to_thread.run_sync(_tokenize_sync, self._engine.model.tokenizer, root,
                                                           limiter=self._limiter, abandon_on_cancel=True))

    async def detokenize(self, context: RouteContext) -> Response:
        root = read_root(await context.read_body())
        items = read_list(read_required(root, "tokens"), "tokens")
        if len(items) > self.max_ids:
            raise InvalidRequest(
                f"tokens holds {len(items)} ids, more than this model's context size ({self.max_ids})",
                param="tokens", code="context_length_exceeded")
        return json_response(await trio.to_thread.run_sync(_detokenize_sync, self._engine.model.tokenizer, root,
                                                           limiter=self._limiter, abandon_on_cancel=True))


def _tokenize_sync(tokenizer: Any, body: Mapping[str, Any]) -> dict[str, Any]:
    content = read_string(read_required(body, "content"), "content")
    add_special = _optional_bool(body, "add_special", False)
    with_pieces = _optional_bool(body, "with_pieces", False)
    parse_special = _optional_bool(body, "parse_special", True)
    ids = _backend(tokenizer).encode(content, add_special_tokens=add_special, split_special_tokens=not parse_special)
    if not with_pieces:
        return {"tokens": list(ids)}
    return {"tokens": [{"id": token_id, "piece": _piece(token_bytes(tokenizer, token_id))} for token_id in ids]}


def _detokenize_sync(tokenizer: Any, body: Mapping[str, Any]) -> dict[str, Any]:
    items = read_list(read_required(body, "tokens"), "tokens")
    last = vocabulary_size(tokenizer) - 1
    ids = [read_int(item, f"tokens[{index}]", 0, last) for index, item in enumerate(items)]
    return {"content": _backend(tokenizer).decode(ids)}


def detokenize_ids(tokenizer: Any, ids: tuple[int, ...]) -> str:
    """The text of ids, special tokens spelled out (what `/apply-template` answers)."""
    return str(_backend(tokenizer).decode(list(ids)))


def _optional_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    return default if value is None else read_bool(value, key)


# --- /completion replies ----------------------------------------------------------


class NativeReply:
    """The body (or events) of one `/completion` reply."""

    def __init__(self, request: CompletionRequest, engine: EngineHandle) -> None:
        self._request = request
        self._model = engine.model_id
        self._tokenizer = engine.model.tokenizer
        self._context_size = engine.model.context_size
        self._has_new_line = False

    def whole(
        self, text: str, finish_reason: str, usage: Usage, logprobs: tuple[TokenLogprob, ...],
        token_ids: tuple[int, ...], stop_string: str | None,
    ) -> dict[str, Any]:
        self._has_new_line = "\n" in text
        body = {"content": text, "tokens": list(token_ids) if self._request.return_tokens else [], "stop": True}
        if self._request.sampling.logprobs:
            body["completion_probabilities"] = self._probabilities(logprobs)
        return self._selected({**body, **self._final(finish_reason, usage, stop_string)})

    @property
    def selects_fields(self) -> bool:
        return bool(self._request.response_fields)

    def _selected(self, body: dict[str, Any]) -> dict[str, Any]:
        fields = self._request.response_fields
        return select_fields(body, fields) if fields else body

    def chunk(self, delta: Delta) -> dict[str, Any]:
        self._has_new_line = self._has_new_line or "\n" in delta.text
        body: dict[str, Any] = {"content": delta.text, "tokens": list(delta.token_ids),
                                "stop": delta.finish_reason is not None}
        if self._request.sampling.logprobs and delta.logprobs:
            body["completion_probabilities"] = self._probabilities(delta.logprobs)
        if delta.finish_reason is not None and delta.usage is not None:
            body.update(self._final(delta.finish_reason, delta.usage, delta.stop_string))
            return self._selected(body)
        return body

    def _final(self, finish_reason: str, usage: Usage, stop_string: str | None) -> dict[str, Any]:
        stop_type = "limit" if finish_reason == "length" else "word" if stop_string is not None else "eos"
        return {
            "model": self._model,
            "stop_type": stop_type,
            "stopping_word": stop_string or "",
            "has_new_line": self._has_new_line,
            # The context filled up before the reply ended (the router caps the reply to the room left).
            "truncated": finish_reason == "length" and usage.total_tokens >= self._context_size,
            "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_tokens,
            "generation_settings": self._generation_settings(),
            "timings": timings(usage),
        }

    def _generation_settings(self) -> dict[str, Any]:
        request = self._request
        sampling = request.sampling
        return {
            "n_ctx": self._context_size,
            "model": self._model,
            "n_predict": -1 if sampling.max_tokens is None else sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": -1 if sampling.seed is None else sampling.seed,
            "stop": list(sampling.stop),
            "n_probs": sampling.top_logprobs if sampling.logprobs else 0,
            "stream": request.stream,
            "cache_prompt": request.cache.cache_prompt,
            "return_tokens": request.return_tokens,
            "ignore_eos": sampling.ignore_eos,
        }

    def _probabilities(self, logprobs: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        def one(token_id: int, token: str, logprob: float) -> dict[str, Any]:
            return {"id": token_id, "token": token, "logprob": logprob,
                    "bytes": list(token_bytes(self._tokenizer, token_id))}

        return [
            {**one(item.token_id, item.token, item.logprob),
             "top_logprobs": [one(token_id, token, logprob)
                              for token_id, (token, logprob) in zip(item.top_ids, item.top, strict=False)]}
            for item in logprobs
        ]


def timings(usage: Usage) -> dict[str, float | int]:
    """llama.cpp's `timings`: prompt time is from submission to the first token, decode time after it."""
    prompt_n = usage.prompt_tokens - usage.cached_tokens
    prompt_ms = usage.prompt_seconds * 1000
    predicted_ms = usage.decode_seconds * 1000
    return {
        "cache_n": usage.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / usage.prompt_seconds if usage.prompt_seconds > 0 else 0.0,
        "predicted_n": usage.completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / usage.completion_tokens if usage.completion_tokens else 0.0,
        "predicted_per_second": (
            usage.completion_tokens / usage.decode_seconds if usage.decode_seconds > 0 else 0.0
        ),
    }


# --- response_fields ------------------------------------------------------------------


def select_fields(body: dict[str, Any], paths: tuple[str, ...]) -> dict[str, Any]:
    """llama.cpp's `response_fields`: only the fields named; "a/b" is `body["a"]["b"]`, under the key "a/b".

    A path that names nothing is left out, as llama.cpp does.
    """
    selected: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            selected[path] = value
    return selected


# --- the server's own routes: /props, /slots, /models -------------------------------------


def generation_defaults(engine: EngineHandle) -> dict[str, Any]:
    """What a `/completion` with no options runs with (its `generation_settings`)."""
    return {
        "n_ctx": engine.model.context_size, "model": engine.model_id, "n_predict": -1, "temperature": 1.0,
        "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": -1, "stop": [], "n_probs": 0, "stream": False,
        "cache_prompt": True, "return_tokens": False, "repeat_last_n": 20, "repeat_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False, "grammar": "",
        "timings_per_token": False,
    }


def props(engine: EngineHandle, *, total_slots: int, chat_template: str) -> dict[str, Any]:
    """`GET /props`: the settings llama.cpp's web UI and tools read at start."""
    tokenizer = _backend(engine.model.tokenizer)
    defaults = generation_defaults(engine)
    return {
        "default_generation_settings": {"n_ctx": defaults["n_ctx"], "params": defaults},
        "total_slots": total_slots,
        "model_alias": engine.model_id,
        "model_path": str(engine.model.path),
        "chat_template": chat_template,
        "bos_token": getattr(tokenizer, "bos_token", None) or "",
        "eos_token": getattr(tokenizer, "eos_token", None) or "",
        "modalities": {"vision": engine.model.vision is not None, "audio": False},
        "build_info": "mlxcel",
        "is_sleeping": False,
    }


def slots(engine: EngineHandle, *, total_slots: int, num_running: int) -> list[dict[str, Any]]:
    """`GET /slots`: one entry per batch place; the first `num_running` are busy (which request runs where
    is not tracked: a batch has no fixed slots)."""
    return [{"id": index, "id_task": -1, "n_ctx": engine.model.context_size, "speculative": False,
             "is_processing": index < num_running, "params": generation_defaults(engine)}
            for index in range(total_slots)]


def models(engine: EngineHandle) -> dict[str, Any]:
    """`GET /models`: llama.cpp's list, the OpenAI `data` and its own `models`."""
    meta = {"n_vocab": vocabulary_size(engine.model.tokenizer), "n_ctx_train": engine.model.context_size}
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": "mlxcel", "meta": meta}
                 for name in engine.model_names],
        "models": [{"name": name, "model": name, "type": "model", "description": "", "tags": [""],
                    "capabilities": ["completion"], "parameters": "", "details": {"format": "mlx"}}
                   for name in engine.model_names],
    }


# --- /infill ----------------------------------------------------------------------------

# The fill-in-the-middle tokens of the tokenizers that have them (prefix, suffix, middle), and the
# repository-level ones (repository name, file separator) where the family has them.
FIM_SPELLINGS: tuple[tuple[str, str, str, str | None, str | None], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>", "<file_sep>"),  # StarCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>", None, None),  # CodeLlama
    ("[PREFIX]", "[SUFFIX]", "[MIDDLE]", None, None),  # Codestral
)


@functools.cache
def _fim_ids(tokenizer: Any) -> tuple[int, int, int, int | None, int | None] | None:
    get_vocab = getattr(_backend(tokenizer), "get_vocab", None)
    vocabulary = get_vocab() if callable(get_vocab) else {}
    for prefix, suffix, middle, repository, separator in FIM_SPELLINGS:
        if prefix in vocabulary and suffix in vocabulary and middle in vocabulary:
            return (vocabulary[prefix], vocabulary[suffix], vocabulary[middle],
                    vocabulary.get(repository) if repository else None,
                    vocabulary.get(separator) if separator else None)
    return None


def fim_ids(tokenizer: Any) -> tuple[int, int, int, int | None, int | None] | None:
    """The tokenizer's (prefix, suffix, middle, repository, file separator) ids; None: it has no FIM tokens."""
    try:
        return _fim_ids(tokenizer)
    except TypeError:  # an unhashable tokenizer (a test's): not memoized
        return _fim_ids.__wrapped__(tokenizer)


def _infill_prompt_sync(tokenizer: Any, body: Mapping[str, Any]) -> tuple[int, ...]:
    """The infill prompt's ids: llama.cpp's layout (its README): extra files, then prefix, suffix, middle."""
    ids = fim_ids(tokenizer)
    if ids is None:
        raise InvalidRequest("this model's tokenizer has no fill-in-the-middle tokens, so it cannot infill",
                             param="input_prefix", code="unsupported_value")
    prefix_id, suffix_id, middle_id, repository_id, separator_id = ids
    backend = _backend(tokenizer)

    def encode(text: str) -> list[int]:
        return list(backend.encode(text, add_special_tokens=False)) if text else []

    def text_field(key: str) -> str:
        value = body.get(key)
        return "" if value is None else read_string(value, key)

    tokens: list[int] = []
    extra = body.get("input_extra")
    chunks = [] if extra is None else read_list(extra, "input_extra")
    if repository_id is not None and separator_id is not None:
        tokens += [repository_id, *encode("myproject\n")]
    for index, item in enumerate(chunks):
        path = f"input_extra[{index}]"
        chunk = _root_object(item, path)
        filename = read_string(chunk.get("filename") or "", f"{path}.filename")
        text = read_string(read_required(chunk, "text", path), f"{path}.text")
        if separator_id is not None:
            tokens += [separator_id, *encode(f"{filename}\n{text}")]
        else:
            tokens += encode(text)
    if repository_id is not None and separator_id is not None:
        tokens += [separator_id, *encode("filename\n")]
    tokens += [prefix_id, *encode(text_field("input_prefix")), suffix_id, *encode(text_field("input_suffix")),
               middle_id, *encode(text_field("prompt"))]
    return tuple(tokens)


def _root_object(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{path} must be an object", param=path, code="invalid_type")
    return value


async def infill_prompt(engine: EngineHandle, body: Mapping[str, Any]) -> tuple[int, ...]:
    return await trio.to_thread.run_sync(_infill_prompt_sync, engine.model.tokenizer, body)


# --- routes ----------------------------------------------------------------------------------
# llama.cpp's server routes (its README): what its web UI, tools and editor plugins call.
# `/completion` and `/infill` reply as the completions routes do (mlxcel/http/openai_chat.py).


def _total_slots(engine: EngineHandle) -> int:
    return int(getattr(getattr(engine.config, "scheduler", None), "max_batch_size", 1))


async def props_route(context: RouteContext) -> Response:
    return json_response(props(context.engine, total_slots=_total_slots(context.engine),
                               chat_template=context.chat_template()))


async def slots_route(context: RouteContext) -> Response:
    scheduler = await context.engine.scheduler_stats()
    return json_response(slots(context.engine, total_slots=_total_slots(context.engine),
                               num_running=scheduler.num_running))


async def models_route(context: RouteContext) -> Response:
    return json_response(models(context.engine))


async def apply_template(context: RouteContext) -> Response:
    """The prompt as the chat route would render it, as text (llama.cpp's `{"prompt": ...}`)."""
    parsed = await context.parse_body(parse_chat_request)
    token_ids = await context.engine.render_prompt(parsed)
    text = await trio.to_thread.run_sync(detokenize_ids, context.engine.model.tokenizer, token_ids)
    return json_response({"prompt": text})
