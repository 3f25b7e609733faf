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
import re
import threading
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
        self._pieces: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
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

    def encode(self, text: str) -> tuple[int, ...]:
        if self._splitter is None:
            return self._encode_whole(text)
        ids: list[int] = []
        for index, piece in enumerate(self._splitter.split(text)):
            if index % 2:
                ids.append(self._added[piece])
            elif piece:
                ids.extend(self._encode_piece(piece))
        return tuple(ids)

    def _encode_whole(self, text: str) -> tuple[int, ...]:
        if self._backend is not None and len(text) > self._part_chars:
            return self._encode_in_parts(text, self._part_chars)
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))

    def _encode_in_parts(self, text: str, part_chars: int) -> tuple[int, ...]:
        encodings = self._backend.encode_batch(_cut(text, part_chars), add_special_tokens=False)
        return tuple(token for encoding in encodings for token in encoding.ids)

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        with self._lock:
            cached = self._pieces.get(piece)
            if cached is not None:
                self._pieces.move_to_end(piece)
                return cached
        ids = self._encode_whole(piece)
        if len(piece) <= self._cache_chars:
            with self._lock:
                if piece not in self._pieces:
                    self._pieces[piece] = ids
                    self._chars += len(piece)
                    while self._chars > self._cache_chars:
                        evicted, _ = self._pieces.popitem(last=False)
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
