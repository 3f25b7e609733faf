"""Tokenizing chat prompts without re-tokenizing the history every turn.

A chat client resends the whole conversation each turn, and a byte-level BPE
tokenizer costs several milliseconds per thousand tokens, so an 8k-token
history spends more time in the tokenizer than a cache hit spends on the
device. Added tokens (``<|im_start|>``, ``<|im_end|>``...) are matched before
the tokenizer's normalizer and pre-tokenizer run, so the text between two of
them is encoded independently of its neighbours: encoding the pieces one by
one and joining them gives the same ids as encoding the whole text. Pieces
(in practice, messages) are memoized, so each turn only encodes what is new.

The equivalence is checked on a probe at construction; a tokenizer whose
added tokens strip or normalize their surroundings fails the check and is
used whole, as before.

A long piece (a never-seen 8k-token system prompt) is also cut into parts of
about PART_CHARS characters, at single spaces between two words, and the
parts are encoded together with the Rust tokenizer's ``encode_batch``
(threads). Byte-level BPE pre-tokenizers (GPT-2, Llama 3, Qwen) split there
anyway, so the ids are the same; the Qwen fixture's 8,141-token prompt took
50 ms whole and 12-14 ms in parts on 2 cores. This too is checked on a
probe: a tokenizer that treats a part's leading space differently (say, a
normalizer that strips it) fails it and encodes long pieces whole.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Hashable
from typing import Any

# Memoized text, in characters (a few hundred thousand tokens' worth of pieces).
DEFAULT_CACHE_CHARS = 8 << 20
# Long pieces are encoded in parts of about this many characters.
PART_CHARS = 2000
# A single space between a letter or digit and a letter: a pre-token boundary.
_PART_BOUNDARY = re.compile(r"(?<=[^\W_]) (?=[^\W\d_])")


class SegmentTokenizer:
    def __init__(
        self, tokenizer: Any, *, cache_chars: int = DEFAULT_CACHE_CHARS, part_chars: int = PART_CHARS
    ) -> None:
        self._tokenizer = tokenizer
        self._cache_chars = cache_chars
        self._part_chars = part_chars
        # The Rust tokenizer behind a transformers one, for encode_batch (None: parts are not used).
        self._backend = _backend_of(tokenizer)
        if self._backend is not None and not self._parts_agree_with_whole_encoding():
            self._backend = None
        # Keyed by (namespace, piece): a tenant's memo hits never speed up another's requests.
        self._pieces: collections.OrderedDict[tuple[Hashable, str], tuple[int, ...]] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        added = _added_vocabulary(tokenizer)
        self._added = added
        self._splitter = (
            re.compile("(" + "|".join(re.escape(token) for token in sorted(added, key=len, reverse=True)) + ")")
            if added else None
        )
        if self._splitter is not None and not self._agrees_with_whole_encoding():
            self._splitter = None

    @property
    def segmenting(self) -> bool:
        return self._splitter is not None

    @property
    def encodes_in_parts(self) -> bool:
        return self._backend is not None

    def encode(self, text: str, *, namespace: Hashable = None) -> tuple[int, ...]:
        """The ids of ``text``; memo entries are shared only between calls with equal ``namespace``."""
        if self._splitter is None:
            return self._encode_whole(text)
        ids: list[int] = []
        for index, piece in enumerate(self._splitter.split(text)):
            if index % 2:
                ids.append(self._added[piece])
            elif piece:
                ids.extend(self._encode_piece(piece, namespace))
        return tuple(ids)

    def _encode_whole(self, text: str) -> tuple[int, ...]:
        if self._backend is not None and len(text) > self._part_chars:
            return self._encode_in_parts(text, self._part_chars)
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))

    def _encode_in_parts(self, text: str, part_chars: int) -> tuple[int, ...]:
        encodings = self._backend.encode_batch(_cut(text, part_chars), add_special_tokens=False)
        return tuple(token for encoding in encodings for token in encoding.ids)

    def _encode_piece(self, piece: str, namespace: Hashable) -> tuple[int, ...]:
        key = (namespace, piece)
        with self._lock:
            cached = self._pieces.get(key)
            if cached is not None:
                self._pieces.move_to_end(key)
                return cached
        ids = self._encode_whole(piece)
        if len(piece) <= self._cache_chars:
            with self._lock:
                if key not in self._pieces:
                    self._pieces[key] = ids
                    self._chars += len(piece)
                    while self._chars > self._cache_chars:
                        (_, evicted), _ = self._pieces.popitem(last=False)
                        self._chars -= len(evicted)
        return ids

    def _agrees_with_whole_encoding(self) -> bool:
        probe_parts = [" leading space", "word", "\n\n newline ", "tail  ", "x"]
        tokens = sorted(self._added)
        probe = ""
        for index, token in enumerate(tokens[:16]):
            probe += probe_parts[index % len(probe_parts)] + token
        probe += " end"
        return self.encode(probe) == self._encode_whole(probe)

    def _parts_agree_with_whole_encoding(self) -> bool:
        probe = ("Words, numbers 12 345 and  double  spaces; it's what they'll say.\n"
                 "Tabs\tand newlines\n\n next line ünïcödé wörds 日本語 テキスト émigré x1 y2 z ") * 4
        try:
            in_parts = self._encode_in_parts(probe, 8)
        except Exception:  # noqa: BLE001 - an unusual backend just encodes whole
            return False
        return in_parts == tuple(self._tokenizer.encode(probe, add_special_tokens=False))


def _backend_of(tokenizer: Any) -> Any:
    """The Rust ``tokenizers.Tokenizer`` of a transformers tokenizer or of mlx-lm's wrapper of one."""
    for candidate in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        backend = getattr(candidate, "backend_tokenizer", None)
        if backend is not None:
            return backend
    return None


def _cut(text: str, part_chars: int) -> list[str]:
    """``text`` in parts of at least ``part_chars`` characters, cut at _PART_BOUNDARY (the space starts a part)."""
    parts, start = [], 0
    while len(text) - start > part_chars:
        boundary = _PART_BOUNDARY.search(text, start + part_chars)
        if boundary is None:
            break
        parts.append(text[start:boundary.start()])
        start = boundary.start()
    parts.append(text[start:])
    return parts


def _added_vocabulary(tokenizer: Any) -> dict[str, int]:
    get_added_vocab = getattr(tokenizer, "get_added_vocab", None)
    if get_added_vocab is None:
        return {}
    try:
        return {str(token): int(token_id) for token, token_id in get_added_vocab().items() if token}
    except Exception:  # noqa: BLE001 - an exotic tokenizer just is not segmented
        return {}


# Normalizers that never shrink text, and NFC/NFKC, whose composition turns at
# most 4 code points into one (the longest canonical decomposition is 4).
_SAFE_NORMALIZERS = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "NFC": 4, "NFKC": 4}
# Pre-tokenizers that keep every character of their input.
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Sequence"}


def max_chars_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the characters of input one token can stand for, or None if unknown.

    ``len(text) / bound`` is then a lower bound on the tokens of ``text``, which
    lets a prompt that cannot fit the context be refused before it is tokenized.
    A vocabulary entry's string is at least as long as the characters it encodes
    (byte-level entries spell one byte per character, SentencePiece ones the text
    itself), as long as nothing on the way drops input: only tokenizers whose
    normalizer, pre-tokenizer and model are known to keep every character get a
    bound (no WordPiece, whose unknown-word token covers a whole word).
    """
    backend = _backend_of(tokenizer)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if backend is None or get_vocab is None:
        return None
    try:
        factor = _normalizer_factor(_spec_of(backend.normalizer))
        model = backend.model
        model_spec = {"type": type(model).__name__, "byte_fallback": getattr(model, "byte_fallback", False),
                      "fuse_unk": getattr(model, "fuse_unk", True)}
        if factor is None or not _keeps_characters(_spec_of(backend.pre_tokenizer), model_spec):
            return None
        longest = max((len(str(entry)) for entry in get_vocab()), default=0)
    except Exception:  # noqa: BLE001 - an unusual tokenizer just gets no bound
        return None
    return longest * factor if longest > 0 else None


def _spec_of(component: Any) -> Any:
    """The JSON description of a normalizer or pre-tokenizer (None when there is none)."""
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_factor(spec: Any) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", ()):
            part_factor = _normalizer_factor(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        return 1 if isinstance(pattern, str) and len(spec.get("content", "")) >= len(pattern) else None
    return _SAFE_NORMALIZERS.get(kind)


def _keeps_characters(pre_tokenizer: Any, model: dict[str, Any]) -> bool:
    parts = [pre_tokenizer] if pre_tokenizer else []
    byte_level = False
    while parts:
        part = parts.pop()
        kind = part.get("type")
        if kind == "Split" or kind == "Punctuation":
            if part.get("behavior") == "Removed":
                return False
        elif kind not in _SAFE_PRE_TOKENIZERS:
            return False
        byte_level |= kind == "ByteLevel"
        parts.extend(part.get("pretokenizers", ()))
    if model.get("type") != "BPE":
        return False
    # Unknown characters fused into one token would cover any number of characters.
    return byte_level or bool(model.get("byte_fallback")) or not model.get("fuse_unk")


def vocabulary_size(tokenizer: Any, config: dict[str, Any]) -> int | None:
    """How many token ids the model accepts: the smaller of its embedding rows
    (``vocab_size`` in the config the weights were loaded with) and the tokenizer's size."""
    sizes = []
    for scope in (config.get("text_config"), config):
        if isinstance(scope, dict) and isinstance(scope.get("vocab_size"), int) and scope["vocab_size"] > 0:
            sizes.append(scope["vocab_size"])
            break
    for candidate in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        try:
            sizes.append(len(candidate))  # type: ignore[arg-type]  # None raises TypeError too
            break
        except TypeError:
            continue
    return min(sizes) if sizes else None
