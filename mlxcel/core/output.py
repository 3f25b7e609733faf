"""Per-request output processing: sampled ids in, reply deltas out.

One ``RequestOutput`` per request owns its detokenizer, stop strings,
logprobs and usage counts; it knows nothing of channels or the device. The
tool-call and reasoning parsers belong here too.
"""

from __future__ import annotations

from typing import Any

import attrs

from mlxcel.types import Delta, SamplingParams, TokenLogprob, Usage


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting part of one."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
        # The stop string that ended the text, once feed found one.
        self.matched: str | None = None

    def feed(self, held: str, new_text: str) -> tuple[str, str, bool]:
        """Returns (text safe to emit, text to keep holding, whether a stop string ended it)."""
        text = held + new_text
        if not self._stop:
            return text, "", False
        found = [(index, stop) for stop in self._stop if (index := text.find(stop)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda pair: pair[0])
            return text[:cut], "", True
        keep = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:length]):
                    keep = length
                    break
        return text[: len(text) - keep], text[len(text) - keep :], False


@attrs.frozen(kw_only=True)
class TokenOut:
    """What the output makes of one sampled token."""

    # The delta to send now, if any.
    delta: Delta | None
    # Set when this token ends the reply: "stop", "length"...
    finish_reason: str | None = None
    # A stop string (not the device) ended it: the device still holds the sequence.
    stopped_by_text: bool = False


class RequestOutput:
    """Detokenizing, stop strings, logprobs and usage of one reply."""

    def __init__(
        self, *, tokenizer: Any, sampling: SamplingParams, eos_token_ids: frozenset[int],
        prompt_tokens: int, submitted_at: float, keep_text: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._detokenizer = tokenizer.detokenizer
        self._sampling = sampling
        self._eos_token_ids = eos_token_ids
        self._matcher = StopMatcher(sampling.stop)
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.submitted_at = submitted_at
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        # Text decoded but held back because it may be the start of a stop string.
        self._held_text = ""
        # Ids of tokens whose text has not gone out yet.
        self._pending_ids: list[int] = []
        # The reply so far, when asked for (the warmer renders the next turn from it).
        self._keep_text = keep_text
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def add(self, token: int, logprob: float, top: tuple[tuple[int, float], ...],
            finish_reason: str | None, now: float) -> TokenOut:
        if self.first_token_at is None:
            self.first_token_at = now
        is_eos = finish_reason == "stop" and token in self._eos_token_ids
        # As OpenAI does, the end-of-sequence token is neither counted nor given a logprob.
        if not is_eos:
            self.completion_tokens += 1
            self._detokenizer.add_token(token)
            self._pending_ids.append(token)
        if finish_reason is not None:
            self._detokenizer.finalize()
        emit, self._held_text, hit_stop = self._matcher.feed(self._held_text, self._detokenizer.last_segment)
        if finish_reason is not None and not hit_stop:
            # The device finished and dropped the sequence; flush what was held.
            emit, self._held_text = emit + self._held_text, ""
        logprobs = () if is_eos else self._logprobs(token, logprob, top)
        delta = None
        if emit or logprobs:
            if self._keep_text:
                self._parts.append(emit)
            token_ids, self._pending_ids = tuple(self._pending_ids), []
            delta = Delta(text=emit, logprobs=logprobs, token_ids=token_ids)
        if hit_stop:
            # The ids still pending spell the stop string, which is not part of the reply.
            self._pending_ids = []
            return TokenOut(delta=delta, finish_reason="stop", stopped_by_text=True)
        return TokenOut(delta=delta, finish_reason=finish_reason)

    def final(self, reason: str, now: float) -> Delta:
        """The last delta: finish reason, usage, and ids that have not gone out."""
        return Delta(finish_reason=reason, usage=self.usage(now), token_ids=tuple(self._pending_ids),
                     stop_string=self._matcher.matched if reason == "stop" else None)

    def usage(self, now: float) -> Usage:
        first_token_at = now if self.first_token_at is None else self.first_token_at
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            prompt_seconds=first_token_at - self.submitted_at,
            decode_seconds=now - first_token_at,
        )

    def _logprobs(self, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> tuple[TokenLogprob, ...]:
        if not self._sampling.logprobs:
            return ()
        decode = self._tokenizer.decode
        return (
            TokenLogprob(
                token=decode([token]),
                logprob=logprob,
                top=tuple((decode([tid]), value) for tid, value in top),
                token_id=token,
                top_ids=tuple(tid for tid, _ in top),
            ),
        )
