"""Draft-model proposals for speculative decoding (``--speculative draft --draft-model PATH``).

A smaller model of the same tokenizer proposes each row's next ``k``
tokens; ``SpeculativeBatch`` (``speculation.py``) verifies them exactly as
it verifies n-gram proposals. The draft keeps its own KV for the rows it
has proposed for, as one ``BatchKVCache`` whose rows are kept by uid:

- A row joins the draft batch lazily, the first time it proposes: its
  tokens so far are prefilled alone on a fresh cache (in prefill-sized
  chunks; counted in ``SpeculationStats.draft_prefill_*``), then merged
  in. Rows that never propose (grammars, opted out) cost the draft
  nothing; a row that ends or is removed leaves with the target batch's
  ``filter``.
- Each proposal step runs every member row: one pass feeds each row the
  tokens it has not seen (those accepted since, plus the token in flight;
  shorter rows right-padded, the padding then left as the rows' gaps, as
  the target's verify step does: ``gapped_cache.py``), then ``k - 1`` one-token passes. The
  passes are built lazily and evaluated once: no host round trip between
  them. Greedy rows take the draft's argmax; sampled rows sample the
  draft's distribution as the row's sampler forms it (``sampling_probs``),
  which the rejection rule needs as ``q``.
- After verification each member's draft KV keeps the tokens the target
  accepted (trimmed the way the target's is), so it always holds a prefix
  of the row's tokens; the rest is fed next time.

Chosen over per-row draft caches (one pass per row and draft token: 8 rows
cost 8x the passes) and over merging per-row caches each step (a copy of
every row's KV per step). Plain KV caches only; only the device thread uses it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from mlxcel.types import SamplingParams


@attrs.frozen(kw_only=True)
class DraftModel:
    """The draft model every decode batch of the device proposes with."""

    model: Any = attrs.field(repr=False)
    path: Path
    # Tokens a joining row's context is prefilled in at a time.
    prefill_step_size: int = 256
    # The tokenizer's ids are below this: logits past it (a padded embedding) are never proposed,
    # since the model may have no row for them. None: every logit.
    id_limit: int | None = None


def same_vocabulary(target: Any, draft: Any) -> bool:
    """Whether two tokenizers map every token to the same id (``get_vocab()``, added tokens included)."""
    return bool(target.get_vocab() == draft.get_vocab())


def read_vocabulary(path: str | Path) -> dict[str, int]:
    """A model folder's token-to-id map, read without MLX (for the CLI's start-up check)."""
    from mlxcel.model.loader import ModelLoadError, resolve_model

    folder = resolve_model(path)[0]
    try:
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return dict(Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True))
        from transformers import AutoTokenizer

        return dict(AutoTokenizer.from_pretrained(str(folder)).get_vocab())
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"cannot read the tokenizer of {folder}: {error}") from error


def check_draft_vocabulary(target_path: str | Path, draft_path: str | Path) -> None:
    """Raise ``ModelLoadError`` (one line) when the draft's vocabulary differs from the target's."""
    from mlxcel.model.loader import ModelLoadError

    if read_vocabulary(target_path) != read_vocabulary(draft_path):
        raise ModelLoadError(f"--draft-model {draft_path}: its tokenizer's vocabulary differs from the model's "
                             f"(a draft must share the model's tokenizer)")


def load_draft(path: str | Path, target_tokenizer: Any, *, prefill_step_size: int) -> DraftModel:
    """Load the draft with the target's loader; refuse another vocabulary or caches other than plain KV."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from mlxcel.model.loader import ModelLoadError, load_model

    loaded = load_model(path)
    if not same_vocabulary(target_tokenizer, loaded.tokenizer):
        raise ModelLoadError(f"--draft-model {path}: its tokenizer's vocabulary differs from the model's "
                             f"(a draft must share the model's tokenizer)")
    if not all(type(cache) is KVCache for cache in make_prompt_cache(loaded.model)):
        raise ModelLoadError(f"--draft-model {path}: only models with plain KV caches can draft")
    limit = max(target_tokenizer.get_vocab().values()) + 1
    return DraftModel(model=loaded.model, path=loaded.path, prefill_step_size=prefill_step_size, id_limit=limit)


@attrs.frozen(kw_only=True)
class DraftRequest:
    """A row that proposes this step: at most ``room`` tokens, sampled as ``sampling`` (greedy at 0)."""

    uid: int
    room: int
    sampling: SamplingParams
    # The row's generator, for the draft's own draws (None: greedy).
    rng: Any = None


class DraftRows:
    """The draft's KV for one decode batch's rows, and its proposals (see the module's docstring)."""

    def __init__(self, draft: DraftModel, stats: Any = None) -> None:
        self.draft = draft
        # speculation.SpeculationStats: the catch-up prefill is counted there.
        self.stats = stats
        self.cache: list[Any] | None = None
        # Row uids in the draft cache's order, and how many of each row's tokens its draft KV holds.
        self.members: list[int] = []
        self.held: dict[int, int] = {}
        # The last proposal step's passes (how many draft tokens each member was fed after the token in flight).
        self._extra_fed = 0

    def retain(self, uids: Sequence[int]) -> None:
        """Drop the members no longer in the target batch."""
        present = set(uids)
        keep = [m for m, uid in enumerate(self.members) if uid in present]
        if len(keep) == len(self.members):
            return
        for uid in self.members:
            if uid not in present:
                del self.held[uid]
        self.members = [self.members[m] for m in keep]
        if not keep:
            self.cache = None
        else:
            assert self.cache is not None
            for cache in self.cache:
                cache.filter(keep)

    def propose(self, uids: Sequence[int], tokens: Sequence[list[int]], pending: Sequence[int],
                requests: Sequence[DraftRequest]) -> dict[int, tuple[list[int], Any]]:
        """Each request's proposal and, for sampled rows, the draft's distribution at each token (else None).

        ``tokens[e]`` is row ``e``'s tokens in the target's KV, ``pending[e]`` its token in flight.
        """
        import mlx.core as mx

        from mlxcel.model.gapped_cache import keep_written
        from mlxcel.model.sampling import sampling_probs

        index = {uid: e for e, uid in enumerate(uids)}
        for request in requests:
            if request.uid not in self.held:
                self._join(request.uid, tokens[index[request.uid]])
        by_uid = {request.uid: request for request in requests}
        feeds = []
        for uid in self.members:
            e = index[uid]
            feeds.append([*tokens[e][self.held[uid]:], pending[e]])
        width = max(len(feed) for feed in feeds)
        matrix = [feed + [feed[-1]] * (width - len(feed)) for feed in feeds]
        assert self.cache is not None
        logits = self.draft.model(mx.array(matrix, dtype=mx.uint32), cache=self.cache)
        last = mx.array([len(feed) - 1 for feed in feeds])
        logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0, :]
        # The padding's positions become the rows' gaps (nothing moves).
        keep_written(self.cache, width, [len(feed) for feed in feeds])
        num_tokens = max(request.room for request in requests)
        sampled_rows = [(m, by_uid[uid]) for m, uid in enumerate(self.members)
                        if uid in by_uid and by_uid[uid].sampling.temperature != 0]
        drafted: list[Any] = []
        distributions: list[dict[int, Any]] = []
        for position in range(num_tokens):
            if position:
                logits = self.draft.model(drafted[-1][:, None], cache=self.cache)[:, -1, :]
            if self.draft.id_limit is not None and logits.shape[-1] > self.draft.id_limit:
                logits = logits[:, :self.draft.id_limit]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            chosen = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
            step_distributions: dict[int, Any] = {}
            if sampled_rows:
                columns = [chosen[m:m + 1] for m in range(len(self.members))]
                for m, request in sampled_rows:
                    probs = sampling_probs(logprobs[m:m + 1], request.sampling)
                    key = mx.random.key(int(request.rng.integers(0, 2**32)))
                    columns[m] = mx.random.categorical(mx.log(probs), key=key).astype(mx.uint32)
                    step_distributions[m] = probs[0]
                chosen = mx.concatenate(columns)
            drafted.append(chosen)
            distributions.append(step_distributions)
        mx.eval(drafted, distributions)
        self._extra_fed = num_tokens - 1
        for uid, feed in zip(self.members, feeds, strict=True):
            self.held[uid] += len(feed)
        columns_host = [column.tolist() for column in drafted]
        proposals: dict[int, tuple[list[int], Any]] = {}
        for m, uid in enumerate(self.members):
            wanted = by_uid.get(uid)
            if wanted is None:
                continue
            proposal = [columns_host[j][m] for j in range(wanted.room)]
            q = None
            if wanted.sampling.temperature != 0:
                q = mx.stack([distributions[j][m] for j in range(wanted.room)])
            proposals[uid] = (proposal, q)
        return proposals

    def settle(self, accepted: dict[int, int]) -> None:
        """After verification: each member's draft KV keeps its row's accepted draft tokens (absent: none)."""
        from mlxcel.model.gapped_cache import keep_written

        if self.cache is None or not self._extra_fed:
            return
        fed = self._extra_fed
        self._extra_fed = 0
        kept = [min(accepted.get(uid, 0), fed) for uid in self.members]
        keep_written(self.cache, fed, kept)
        for uid, count in zip(self.members, kept, strict=True):
            self.held[uid] += count

    def _join(self, uid: int, tokens: list[int]) -> None:
        """Prefill the row's tokens alone on a fresh draft cache, then merge it into the draft batch."""
        import mlx.core as mx
        from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

        started = time.perf_counter()
        caches = make_prompt_cache(self.draft.model)
        step = max(1, self.draft.prefill_step_size)
        for start in range(0, len(tokens), step):
            self.draft.model(mx.array(tokens[start:start + step], dtype=mx.uint32)[None], cache=caches)
            mx.eval([cache.state for cache in caches if cache.keys is not None])
        if self.stats is not None:
            self.stats.draft_prefill_tokens += len(tokens)
            self.stats.draft_prefill_seconds += time.perf_counter() - started
        joining = [BatchKVCache.merge([cache]) for cache in caches]
        if self.cache is None:
            self.cache = joining
        else:
            for cache, other in zip(self.cache, joining, strict=True):
                cache.extend(other)
        self.members.append(uid)
        self.held[uid] = len(tokens)
