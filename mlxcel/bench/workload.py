"""The multi-turn chat workload: N conversations x T turns on one system prompt.

Text is built from a fixed list of common English words, each of which the
Qwen BPE tokenizer encodes as one token both with and without a leading
space, so "S words" is "S tokens" on Qwen-tokenized models. With a model
folder's ``tokenizer.json`` the list is filtered to the words that hold that
property for that tokenizer and the lengths are measured; without one they
are approximations. Pure Python (``tokenizers`` only when given a folder).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import attrs

__all__ = ["UNSEEN_USER_STEP", "WORDS", "Shape", "Workload", "add_shape_arguments", "build_workload",
           "load_word_counter"]

# Single tokens in the Qwen BPE (checked against the fixture's tokenizer.json).
WORDS = tuple(
    """
    time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot
    right study book eye job word business issue side kind head house service friend father
    power hour game line end member law car city community name team minute idea kid body
    information back parent face others level office door health person art war history
    party result change reason research girl moment air teacher force education foot boy age
    policy music market sense nation plan college interest death experience effect class
    control care field development role rate heart drug show leader light voice wife mind
    price report decision son view relationship town road arm difference value building
    action model season tax director position player record paper space ground form event
    official matter center site project activity star table need court oil cost industry
    figure street image phone data picture practice piece land product doctor wall patient
    worker news test movie north love support technology step baby computer type attention
    film tree source organization hair window population truth song river summer winter
    bridge cloud stone forest letter chair lamp
    """.split()  # noqa: SIM905 (a block of words reads better than a list of strings)
)

# Unseen probe i's user turn is ``user_tokens + UNSEEN_USER_STEP * i`` words:
# a new prompt length per probe, so a per-length cost (a compile) shows.
UNSEEN_USER_STEP = 8


@attrs.frozen(kw_only=True)
class Shape:
    """The sizes asked for: conversations, turns, and tokens per part."""

    conversations: int = 6
    turns: int = 5
    system_tokens: int = 1020
    user_tokens: int = 117
    reply_tokens: int = 16
    seed: int = 0


def add_shape_arguments(parser: argparse.ArgumentParser, *, counts: bool = True) -> None:
    """The workload's size flags with ``Shape``'s defaults (``counts``: also conversations and turns)."""
    defaults = Shape()
    names = ("conversations", "turns") if counts else ()
    for name in (*names, "system_tokens", "user_tokens", "reply_tokens"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))


@attrs.frozen(kw_only=True)
class Workload:
    shape: Shape
    system_prompt: str = attrs.field(repr=False)
    # user_turns[conversation][turn]
    user_turns: tuple[tuple[str, ...], ...] = attrs.field(repr=False)
    # A stand-in reply of ``reply_tokens`` words per turn, for the in-process floor.
    stand_in_replies: tuple[tuple[str, ...], ...] = attrs.field(repr=False)
    system_tokens_measured: int | None = None
    user_tokens_measured: int | None = None
    tokenizer_source: str = "approximate (1 word = 1 token)"
    # The words the texts are drawn from (filtered for the model's tokenizer).
    words: tuple[str, ...] = attrs.field(default=WORDS, repr=False)

    def messages(self, conversation: int, turn: int, replies: list[str]) -> list[dict[str, str]]:
        """The chat messages of ``turn``, given the replies of the turns before it."""
        if len(replies) != turn:
            raise ValueError(f"turn {turn} needs {turn} earlier replies, got {len(replies)}")
        messages = [{"role": "system", "content": self.system_prompt}]
        for earlier in range(turn):
            messages.append({"role": "user", "content": self.user_turns[conversation][earlier]})
            messages.append({"role": "assistant", "content": replies[earlier]})
        messages.append({"role": "user", "content": self.user_turns[conversation][turn]})
        return messages

    def unseen_messages(self, index: int) -> list[dict[str, str]]:
        """Unseen probe ``index``: a new conversation's turn 0 that no earlier request shares a prefix with.

        A system prompt of ``system_tokens`` words whose first word differs from
        the workload's and from every other probe's (for up to ``len(words) - 1``
        probes), and a user turn of ``user_tokens + UNSEEN_USER_STEP * index``
        words. Drawn from the seed with RNGs of their own, so the chat texts
        are the same with or without probes.
        """
        if index < 0:
            raise ValueError(f"unseen probe index must be at least 0, got {index}")
        openers = [word for word in self.words if word != self.system_prompt.split(" ", 1)[0]]
        random.Random(f"unseen/{self.shape.seed}").shuffle(openers)
        rng = random.Random(f"unseen/{self.shape.seed}/{index}")
        system = [openers[index % len(openers)], *(rng.choice(self.words) for _ in range(self.shape.system_tokens - 1))]
        user = _text(rng, self.words, self.shape.user_tokens + UNSEEN_USER_STEP * index)
        return [{"role": "system", "content": " ".join(system)}, {"role": "user", "content": user}]

    def describe(self) -> dict[str, Any]:
        return {
            **attrs.asdict(self.shape),
            "system_tokens_measured": self.system_tokens_measured,
            "user_tokens_measured": self.user_tokens_measured,
            "tokenizer": self.tokenizer_source,
        }


def load_word_counter(model_path: str | Path | None) -> tuple[Any, str] | None:
    """A ``tokenizers.Tokenizer`` from the folder's tokenizer.json, or None."""
    if model_path is None:
        return None
    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)), str(path)


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def _single_token_words(tokenizer: Any) -> tuple[str, ...]:
    words = tuple(w for w in WORDS if _count(tokenizer, w) == 1 and _count(tokenizer, " " + w) == 1)
    # Another tokenizer family: fall back to the whole list, lengths become approximate.
    return words if len(words) >= 50 else WORDS


def _text(rng: random.Random, words: tuple[str, ...], count: int) -> str:
    return " ".join(rng.choice(words) for _ in range(count))


def build_workload(shape: Shape, *, model_path: str | Path | None = None) -> Workload:
    """The same texts for the same shape and seed, on every run and machine."""
    for name in ("conversations", "turns", "system_tokens", "user_tokens", "reply_tokens"):
        if getattr(shape, name) < 1:
            raise ValueError(f"{name.replace('_', '-')} must be at least 1")
    loaded = load_word_counter(model_path)
    words = WORDS if loaded is None else _single_token_words(loaded[0])
    rng = random.Random(shape.seed)
    system_prompt = _text(rng, words, shape.system_tokens)
    user_turns = tuple(
        tuple(_text(rng, words, shape.user_tokens) for _ in range(shape.turns))
        for _ in range(shape.conversations)
    )
    stand_in = tuple(
        tuple(_text(rng, words, shape.reply_tokens) for _ in range(shape.turns))
        for _ in range(shape.conversations)
    )
    if loaded is None:
        return Workload(shape=shape, system_prompt=system_prompt, user_turns=user_turns, stand_in_replies=stand_in,
                        words=words)
    tokenizer, source = loaded
    user_counts = sorted(_count(tokenizer, text) for turns in user_turns for text in turns)
    return Workload(
        shape=shape,
        system_prompt=system_prompt,
        user_turns=user_turns,
        stand_in_replies=stand_in,
        system_tokens_measured=_count(tokenizer, system_prompt),
        user_tokens_measured=user_counts[len(user_counts) // 2],
        tokenizer_source=source,
        words=words,
    )
