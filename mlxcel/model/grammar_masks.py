"""Grammar-constrained rows of the decode batch: llguidance matchers and their token masks, a step at a time."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import attrs

from mlxcel.core.plan import GrammarWork

logger = logging.getLogger(__name__)


class Grammars:
    """The grammar-constrained sequences' matchers, and their masks computed a step at a time.

    mlx-lm's step runs every sequence's logits processors, then every
    sequence's sampler. Each constrained sequence's processor only hands over
    the token sampled last, still lazy; the first of their samplers to run
    reads all those tokens back, starts the step's forward pass (the device
    computes logits meanwhile), feeds the matchers and computes their masks in
    parallel on llguidance's threads, and unpacks them on the device in one
    pass; each sampler then masks its own row. The logprobs the API reports are the model's, before
    the mask (as vLLM's default). The llguidance tokenizer is built on first
    use (~1 s).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        # Also what min_tokens / ignore_eos mask (the Grammars object is the executor's one view of them).
        self.eos_token_ids = frozenset(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        # Fed this step, mask not computed yet.
        self._pending: list[GrammarSequence] = []
        # Each computed sequence's row in `_allowed` (the step's unpacked masks).
        self._rows: dict[int, int] = {}
        self._allowed: Any = None
        # Since the last take_work().
        self._work = GrammarWork()

    def sequence(self, grammar: str) -> GrammarSequence:
        from llguidance import LLExecutor, LLMatcher

        if self._ll_tokenizer is None:
            from llguidance.hf import from_tokenizer

            if self._tokenizer is None:
                raise ValueError("a grammar-constrained request needs the model's tokenizer")
            # mlx-lm's wrapper holds the Hugging Face tokenizer.
            hf_tokenizer = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            self._ll_tokenizer = from_tokenizer(hf_tokenizer, eos_token=self._eos_token_ids or None)
            self._executor = LLExecutor()
        started = time.perf_counter()
        matcher = LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar rejected: {matcher.get_error()}")
        seconds = time.perf_counter() - started
        logger.debug("grammar matcher built in %.1f ms", 1000 * seconds)
        self._work = attrs.evolve(self._work, matchers_built=self._work.matchers_built + 1,
                                  build_seconds=self._work.build_seconds + seconds)
        return GrammarSequence(self, matcher)

    def take_work(self) -> GrammarWork | None:
        work, self._work = self._work, GrammarWork()
        return work if work.matchers_built or work.masks else None

    def fed(self, sequence: GrammarSequence) -> None:
        self._pending.append(sequence)

    def allowed(self, sequence: GrammarSequence, logprobs: Any) -> Any:
        """The step's mask of ``sequence``: True where its grammar allows the token."""
        if self._pending:
            self._compute(logprobs)
        return self._allowed[self._rows[id(sequence)]]

    def _compute(self, logprobs: Any) -> None:
        import mlx.core as mx
        import numpy as np

        started = time.perf_counter()
        pending, self._pending = self._pending, []
        vocab = logprobs.shape[-1]
        # The tokens first (they wait for the last step only), then the forward pass is
        # started: queued before them, it would hold their read-back up.
        tokens = [sequence.last_token for sequence in pending if sequence.last_token is not None]
        mx.eval(tokens)
        mx.async_eval(logprobs)
        for sequence in pending:
            if sequence.last_token is not None and not sequence.matcher.is_error():
                sequence.matcher.consume_token(int(sequence.last_token.item()))
            sequence.last_token = None
        width = (self._ll_tokenizer.vocab_size + 31) // 32
        packed = np.zeros((len(pending), max(width, (vocab + 31) // 32)), dtype=np.int32)
        working = [(sequence.matcher, row) for row, sequence in enumerate(pending) if not sequence.matcher.is_error()]
        if working:
            self._executor.unsafe_compute_mask_ptr(working, packed.ctypes.data, packed.shape[1] * 4, len(pending))
        words = packed.view(np.uint32)
        for row, sequence in enumerate(pending):
            matcher = sequence.matcher
            if matcher.is_error():
                logger.warning("grammar matcher failed: %s", matcher.get_error())
            # EOS passes where the grammar may end; a failed matcher passes nothing else, so the reply stops.
            may_end = matcher.is_error() or matcher.is_accepting()
            for eos in self._eos_token_ids:
                if eos < vocab:
                    bit = np.uint32(1 << (eos % 32))
                    words[row, eos // 32] = words[row, eos // 32] | bit if may_end else words[row, eos // 32] & ~bit
        word_index, bit_index = _bit_positions(vocab)
        self._allowed = ((mx.array(words)[:, word_index] >> bit_index) & 1).astype(mx.bool_)
        self._rows = {id(sequence): row for row, sequence in enumerate(pending)}
        seconds = time.perf_counter() - started
        logger.debug("grammar masks of %d sequences in %.2f ms", len(pending), 1000 * seconds)
        self._work = attrs.evolve(self._work, masks=self._work.masks + len(pending),
                                  mask_seconds=self._work.mask_seconds + seconds)


class GrammarSequence:
    """One sequence's matcher, its processor (``feed``) and its sampler's mask."""

    def __init__(self, grammars: Grammars, matcher: Any) -> None:
        self._grammars = grammars
        self.matcher = matcher
        self._started = False
        # The token to feed the matcher before this step's mask (None on the first step).
        self.last_token: Any = None

    def feed(self, tokens: Any, logits: Any) -> Any:
        """A logits processor that changes nothing: it hands over the token sampled last, still lazy."""
        self.last_token = tokens[-1] if self._started else None
        self._started = True
        self._grammars.fed(self)
        return logits

    def sampler(self, sample: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
        def masked(logprobs: Any) -> Any:
            import mlx.core as mx

            allowed = self._grammars.allowed(self, logprobs)
            logprobs = mx.where(allowed, logprobs, mx.array(-mx.inf, dtype=logprobs.dtype))
            return mx.argmax(logprobs, axis=-1) if sample is None else sample(logprobs)

        return masked


@functools.lru_cache(maxsize=4)
def _bit_positions(vocab: int) -> tuple[Any, Any]:
    """For each token id: its word in a packed mask and its bit in that word."""
    import mlx.core as mx

    ids = mx.arange(vocab, dtype=mx.uint32)
    return ids >> 5, ids & 31
