"""The scheduling core: every decision about what the device runs, synchronous and pure.

The scheduler actor feeds it (``add``, ``abort``, ``warm``, cache lookups it
asks for), calls ``schedule(now)`` for a ``StepPlan``, has the device carry
the plan out, and hands the ``StepResult`` to ``update``. The policy lives
here and only here:

- admission: free batch slots, the waiting queue, its bound (503 beyond it);
- in-flight prefix sharing: a request whose prompt shares more with a prompt
  being prefilled than the store can give it waits (parks) for that prefill;
- where each start runs: directly (its whole uncached part fits one prefill
  chunk: prefilled on its own cache, first token in this step), alone
  (longer than a chunk, with buckets: chunks on its own cache, then its rest
  starts directly) or in the batch (chunked prefill, then decode);
- the token budget of direct starts (a chunk's worth per step, with a charge
  per start on CUDA; the rest wait)
  and the batch hold (decode waits for them at most MAX_BATCH_HOLDS steps);
- bucketing: the prefix cut of a start and the padding of its tokens;
- donation of prompt KV (early, for parked requests and retaining ones) and of finished replies;
- background warm-ups of session snapshots, only while idle.

It computes the shapes and costs of starts with ``core/placement.py`` and
keeps its warm-up jobs in ``core/warmups.py``; how the server caches (off,
KV prefixes or session snapshots, and what goes with each) comes whole in
the ``CachePlan`` (``core/cache_plan.py``).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any, Literal, Protocol

import attrs

from mlxcel.cache.key import CacheContext, SessionId, TrieKey, session_id, trie_key
from mlxcel.cache.snapshots import common_prefix_length
from mlxcel.core.cache_plan import CACHE_OFF, CachePlan
from mlxcel.core.effects import (
    CacheLookedUp,
    DonateSequence,
    DonateSnapshot,
    Effect,
    ReplyFinished,
    RequestFinished,
    SchedulerStats,
    ShedCache,
    SnapshotRestoreFailed,
)
from mlxcel.core.output import ReplyFormat, RequestOutput, TokenRelay
from mlxcel.core.placement import AlonePrefill, Pending, Placement, shares_a_pass, snapshot_points
from mlxcel.core.plan import (
    AloneChunk,
    Capabilities,
    DetachedSequence,
    DiskRead,
    DiskReadDone,
    DiskWrite,
    GrammarFailure,
    InsertBatch,
    Removal,
    SampledToken,
    SnapshotPoint,
    Start,
    StartAlone,
    StartDirect,
    StepPlan,
    StepResult,
)
from mlxcel.core.warmups import WarmSession as WarmSession, WarmUps
from mlxcel.errors import GenerationFailed, InvalidRequest, MlxcelError, ServerBusy
from mlxcel.types import ChatRequest, Delta, SamplingParams

logger = logging.getLogger(__name__)

# Steps in a row in which direct starts may hold back the batch's decode step.
MAX_BATCH_HOLDS = 4
# Cancels remembered for requests not yet submitted (the cancel overtook them).
MAX_EARLY_CANCELS = 1024


@attrs.frozen(kw_only=True)
class NewRequest:
    """A routed request: its prompt tokens and how to run and cache it."""

    request_id: str
    prompt_tokens: tuple[int, ...] = attrs.field(repr=False)
    sampling: SamplingParams
    max_tokens: int
    # None: this request neither reads nor donates cache entries.
    cache_context: CacheContext | None
    # Tokens of the rendered conversation history before the newest user message.
    history_boundary: int | None = None
    # Tokens of the prefix conversations share: the system prompt and tool schemas.
    shared_prefix: int | None = None
    # The chat request itself, so the warmer can render the next turn's history.
    chat: ChatRequest | None = attrs.field(default=None, repr=False)
    # More requests were already queued at the router behind this one.
    more_pending: bool = False
    # Keep the stored prompt against eviction this long (cache_control ttl, prompt_cache_retention);
    # > 0 also donates the prompt's KV at the end of its prefill, so a cancel during decoding keeps it.
    retain_seconds: float = 0.0
    # The request's images (mlxcel.vision.processing.VisionInputs; its `end` is past the last image token).
    vision: Any = attrs.field(default=None, repr=False)
    # The edge (an API process) processes the output: the sampled tokens go out as they are (TokenRelay), unless
    # the engine needs the reply's text itself (the warmer).
    edge_output: bool = False


# --- cache lookups the core asks for ---------------------------------------------------


@attrs.frozen(kw_only=True)
class Lookup:
    """A question for the cache store, answered with ``resolve``.

    ``peek``: how much the prefix store holds, counting nothing (in-flight
    sharing compares it with a running prefill); ``prefix`` / ``snapshot``:
    the real lookup of an admission; ``warm``: a warm-up's snapshot, counting nothing.
    """

    kind: Literal["peek", "prefix", "snapshot", "warm"]
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)

    @property
    def record(self) -> bool:
        return self.kind in ("prefix", "snapshot")


@attrs.frozen(kw_only=True)
class Hit:
    length: int
    payload: Any = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class Miss:
    # None: nothing stored; else why the stored snapshot was refused.
    refusal: str | None = None


@attrs.frozen(kw_only=True)
class OnDisk:
    """The disk tier holds more of the prompt than memory: the start carries ``read``, else ``memory`` stands."""

    read: DiskRead
    memory: Hit | Miss


LookupResult = Hit | Miss | OnDisk


class Clients(Protocol):
    """Where a request's events go; the core never sees a channel."""

    def send(self, request_id: str, delta: Delta | SampledToken) -> bool:
        """Deliver a delta (or, to an edge that processes the output, a sampled token) now; False: the client
        is gone or too slow (the request is then cancelled)."""

    def fail(self, request_id: str, error: MlxcelError) -> None: ...

    def close(self, request_id: str) -> None: ...


# --- the core's own state ---------------------------------------------------------------


@attrs.define(kw_only=True)
class _Running:
    request: NewRequest
    sequence_id: int
    output: RequestOutput | TokenRelay
    prompt_done: bool = False
    finished: bool = False
    # Its cache context's trie and session keys, computed once: a wave's admissions compare every pair.
    trie: TrieKey | None = None
    session: SessionId | None = None


@attrs.define(kw_only=True)
class _Candidate:
    """The head of the queue while its lookups are answered."""

    request: NewRequest
    leader: int | None = None
    shared: int = 0
    leader_checked: bool = False
    peeked: LookupResult | None = None
    found: LookupResult | None = None


class SchedulerCore:
    def __init__(
        self,
        capabilities: Capabilities,
        *,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        max_queued_requests: int = 256,
        cache: CachePlan = CACHE_OFF,
        keep_reply_text: bool = False,
        on_trace: Callable[[str], None] | None = None,
    ) -> None:
        self.capabilities = capabilities
        self._placement = Placement(capabilities)
        self._tokenizer = tokenizer
        # The model's thinking and tool-call markers and its mlx-lm tool parser.
        self._reply_format = ReplyFormat.of(tokenizer)
        self._eos_token_ids = eos_token_ids
        self._max_queued = max_queued_requests
        # How this server caches (off, KV prefixes or session snapshots), decided once at start-up.
        self._cache = cache
        self._snapshots = cache.snapshots
        self._keep_reply_text = keep_reply_text
        self._trace = on_trace
        self._waiting: collections.deque[NewRequest] = collections.deque()
        self._candidate: _Candidate | None = None
        self._running: dict[int, _Running] = {}
        self._sequence_of: dict[str, int] = {}
        self._cancelled_early: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Requests waiting for a prefilling sequence's prompt KV, by that sequence's id.
        self._parked: dict[int, list[NewRequest]] = {}
        self._next_sequence_id = 0
        # Starts decided since the last plan, and direct starts over a step's budget.
        self._admitted: list[Pending] = []
        self._deferred: list[Pending] = []
        # Starts sent with a snapshot to restore or a disk read, until their step reports: one whose
        # restore fails is placed again, cold; one whose read gives less, again on what it gave.
        self._restoring: dict[int, Pending] = {}
        # Stored payloads the disk tier lacks, for the next plan (core/plan.py's DiskWrite).
        self._disk_writes: list[DiskWrite] = []
        # Long prompts prefilled alone, oldest first.
        self._alone: list[AlonePrefill] = []
        # What the device holds: sequences in its batch, prefilling there, owing a first token.
        self._in_batch: set[int] = set()
        self._batch_prefilling: set[int] = set()
        self._awaiting_first: set[int] = set()
        self._batch_holds = 0
        self._removals: list[Removal] = []
        self._release: list[Any] = []
        # Finished sequences whose KV is still on its way back: (context, prompt length, retain seconds).
        self._pending_donations: dict[int, tuple[CacheContext, int, float]] = {}
        self._warm_ups = WarmUps()
        self._effects: list[Effect] = []
        self._num_steps = 0
        # Speculative decoding since start: verify steps, proposed tokens, accepted tokens.
        self._speculation = (0, 0, 0)
        self._num_completed = 0
        self._num_cancelled = 0
        self._num_failed = 0
        self._num_interleaved_steps = 0
        self._num_shared_prefills = 0
        self._decode_batch_sizes: collections.Counter[int] = collections.Counter()

    # --- input ----------------------------------------------------------------------------

    def add(self, request: NewRequest, clients: Clients) -> None:
        if request.request_id in self._cancelled_early:
            del self._cancelled_early[request.request_id]
            clients.close(request.request_id)
            return
        num_parked = sum(len(parked) for parked in self._parked.values())
        if len(self._waiting) + num_parked >= self._max_queued:
            clients.fail(request.request_id, ServerBusy(
                f"the server is at capacity ({len(self._waiting)} requests waiting); retry shortly"))
            clients.close(request.request_id)
            return
        self._waiting.append(request)

    def abort(self, request_id: str, clients: Clients, now: float) -> None:
        """The client went away: free the sequence, donate nothing."""
        sequence_id = self._sequence_of.get(request_id)
        if sequence_id is not None:
            running = self._running.get(sequence_id)
            if running is not None and not running.finished:
                self._num_cancelled += 1
                self._finish(running, clients, now, donate=False, reason=None)
            return
        queues = [self._waiting, *self._parked.values()]
        for queue in queues:
            for queued in queue:
                if queued.request_id == request_id:
                    queue.remove(queued)
                    if self._candidate is not None and self._candidate.request is queued:
                        self._candidate = None
                    clients.close(request_id)
                    self._num_cancelled += 1
                    return
        # The cancel overtook its submission (still in the router).
        self._cancelled_early[request_id] = None
        while len(self._cancelled_early) > MAX_EARLY_CANCELS:
            self._cancelled_early.popitem(last=False)

    def stop(self, request_id: str, clients: Clients, now: float) -> None:
        """The edge found a stop string in a relayed reply: it ends as a stop string ends it here (donating).

        Nothing happens if the reply ended meanwhile (the device finished it, or the client left).
        """
        sequence_id = self._sequence_of.get(request_id)
        running = None if sequence_id is None else self._running.get(sequence_id)
        if running is not None and not running.finished and type(running.output) is TokenRelay:
            self._finish(running, clients, now, donate=True, reason="stop")

    def warm(self, job: WarmSession) -> None:
        """Queue a warm-up; it replaces a pending one of the same conversation (whose tokens it extends)."""
        if not self._snapshots:
            return
        self._warm_ups.queue(job)

    def release(self, payloads: tuple[Any, ...]) -> None:
        """Payloads the stores let go of, to be dropped on the device thread with the next step."""
        self._release.extend(payloads)

    def persist(self, writes: tuple[DiskWrite, ...]) -> None:
        """Disk writes the cache store planned: the next plan carries them (an idle device gets a plan of them)."""
        self._disk_writes.extend(writes)

    def take_disk_writes(self) -> tuple[DiskWrite, ...]:
        """The disk writes not yet planned (the scheduler hands them over when it stops)."""
        writes, self._disk_writes = tuple(self._disk_writes), []
        return writes

    def take_release(self) -> tuple[Any, ...]:
        """The released payloads, for the next step's message (the core keeps no reference)."""
        release, self._release = tuple(self._release), []
        return release

    def has_work(self) -> bool:
        if (self._waiting or self._running or self._removals or self._warm_ups.is_running() or self._release
                or self._disk_writes):
            return True
        return self._warm_ups.has_pending() and self._idle()

    def can_plan_ahead(self) -> bool:
        """The next plan may go to the device before the step in flight reports.

        vLLM's async scheduling: the device then never waits for the host
        between steps. A plan that only decodes (and removes) may go ahead,
        and so may one whose starts all run in a shared pass (a text prompt
        from nothing stored or from a prefix in memory): placing those reads
        nothing the device reports, and a wave's passes then follow each other
        without the host's round trip between them. Anything else (a chunked
        prefill, a snapshot or a disk read, a request still being looked up)
        is planned once every step has reported. A sequence that the step in
        flight finishes decodes one token more; ``update`` drops tokens of
        finished sequences, and the removal follows in the next plan.
        """
        if self._alone or self._restoring or not self._candidate_waits_for_nothing():
            return False
        starts = [*self._deferred, *self._admitted]
        if not starts:
            return bool(self._in_batch)
        return all(self._runs_in_a_shared_pass(pending) for pending in starts)

    def _runs_in_a_shared_pass(self, pending: Pending) -> bool:
        placement = self._placement
        return placement.starts_directly(pending) and shares_a_pass(placement.direct(pending))

    def _candidate_waits_for_nothing(self) -> bool:
        # A queued request not yet admitted (the batch is full) does not block decoding ahead.
        return not self._waiting or len(self._running) >= self.capabilities.max_batch_size

    def starting_from_idle(self) -> bool:
        """Nothing runs, more requests are right behind the newest, and the batch has rows for them: worth gathering
        them. (Not bounded by the step's token budget: what a request will prefill is known only after its lookup,
        and a conversation's next turn keeps most of its prompt.)"""
        return (not self._running and bool(self._waiting) and self._waiting[-1].more_pending
                and len(self._waiting) < self.capabilities.max_batch_size)

    def take_effects(self) -> list[Effect]:
        effects, self._effects = self._effects, []
        return effects

    # --- admission: the lookups it needs ----------------------------------------------------

    def next_lookup(self, now: float) -> Lookup | None:
        """The cache lookup the next admission waits for, or None when the step can be planned."""
        if self._waiting and self._warm_ups.is_running():
            if all(self._extends_a_warm_up(request) for request in self._waiting):
                # Only the next turns of the conversations being warmed are waiting: the
                # warm-ups compute exactly the prefix they resume from, so they wait for them.
                return None
            # Other foreground work arrived: warm-ups give way at once and store nothing.
            for sequence_id in self._warm_ups.preempt():
                self._remove(sequence_id, donate=False)
        while self._waiting and len(self._running) < self.capabilities.max_batch_size:
            if self._awaits_a_donation(self._waiting[0]):
                break
            lookup = self._admit_head(now)
            if lookup is not None:
                return lookup
        if not self._admitted and self._idle() and not self._warm_ups.is_running():
            job = self._warm_ups.next_lookup()
            if job is not None:
                return Lookup(kind="warm", context=job.context, tokens=job.tokens)
        return None

    def _awaits_a_donation(self, request: NewRequest) -> bool:
        """A reply of the request's context has ended and its KV is still on its way from the device: the
        lookup waits for it (the next turn of a conversation must find its last reply), at most a step."""
        context = request.cache_context
        return context is not None and any(pending[0] == context for pending in self._pending_donations.values())

    def _extends_a_warm_up(self, request: NewRequest) -> bool:
        """``request`` is a running warm-up's conversation, its prompt going on from the warmed tokens."""
        prompt = request.prompt_tokens
        return any(job.context == request.cache_context and len(prompt) > len(job.tokens)
                   and prompt[:len(job.tokens)] == job.tokens for job in self._warm_ups)

    def resolve(self, lookup: Lookup, result: LookupResult) -> None:
        if lookup.kind == "warm":
            self._start_warmup(self._warm_ups.looked_up(), result)
            return
        candidate = self._candidate
        assert candidate is not None
        if lookup.kind == "peek":
            candidate.peeked = result
        else:
            candidate.found = result

    def _admit_head(self, now: float) -> Lookup | None:
        request = self._waiting[0]
        candidate = self._candidate
        if candidate is None or candidate.request is not request:
            candidate = self._candidate = _Candidate(request=request)
        context = request.cache_context
        if not candidate.leader_checked:
            candidate.leader, candidate.shared = self._prefix_leader(request)
            candidate.leader_checked = True
        if candidate.leader is not None and context is not None:
            if candidate.peeked is None:
                return Lookup(kind="peek", context=context, tokens=request.prompt_tokens)
            matched = candidate.peeked.length if isinstance(candidate.peeked, Hit) else 0
            if candidate.shared - matched >= self._cache.share_threshold:
                self._waiting.popleft()
                self._candidate = None
                self._parked.setdefault(candidate.leader, []).append(request)
                return None
            candidate.leader = None
        if context is not None and self._cache.enabled and len(request.prompt_tokens) > 1 and candidate.found is None:
            return Lookup(kind="snapshot" if self._snapshots else "prefix", context=context,
                          tokens=request.prompt_tokens)
        self._waiting.popleft()
        self._candidate = None
        self._admit(request, candidate.found, now)
        return None

    def _prefix_leader(self, request: NewRequest) -> tuple[int | None, int]:
        """A prefilling sequence whose prompt KV may serve this request better than the store."""
        context = request.cache_context
        if not self._cache.prompt_donation or context is None or len(request.prompt_tokens) < 2:
            return None, 0
        best_sequence, best_shared = None, 0
        trie, session = trie_key(context), session_id(context)
        for running in self._running.values():
            if running.prompt_done or running.finished or running.trie is None:
                continue
            if running.trie != trie:
                continue
            if not self._cache.cross_session and running.session != session:
                continue
            shared = common_prefix_length(running.request.prompt_tokens, request.prompt_tokens)
            if shared > best_shared:
                best_sequence, best_shared = running.sequence_id, shared
        if best_sequence is None or best_shared < self._cache.share_threshold:
            return None, 0
        return best_sequence, best_shared

    def _admit(self, request: NewRequest, found: LookupResult | None, now: float) -> None:
        if self._trace is not None and self._snapshots and request.cache_context is not None:
            self._trace_snapshot(request, found)
        sequence_id = self._new_sequence_id()
        output: RequestOutput | TokenRelay
        if request.edge_output and not self._keep_reply_text:
            output = TokenRelay(eos_token_ids=self._eos_token_ids, prompt_tokens=len(request.prompt_tokens),
                                submitted_at=now)
        else:
            output = RequestOutput(tokenizer=self._tokenizer, sampling=request.sampling,
                                   eos_token_ids=self._eos_token_ids, prompt_tokens=len(request.prompt_tokens),
                                   submitted_at=now, keep_text=self._keep_reply_text,
                                   parsing=self._reply_format.parsing(request.chat, request.prompt_tokens),
                                   report_progress=request.chat is not None and request.chat.timings_per_token)
        context = request.cache_context
        running = self._running[sequence_id] = _Running(
            request=request, sequence_id=sequence_id, output=output,
            trie=None if context is None else trie_key(context),
            session=None if context is None else session_id(context))
        self._sequence_of[request.request_id] = sequence_id
        self._admitted.append(self._pending(running, found))

    def _pending(self, running: _Running, found: LookupResult | None) -> Pending:
        """A running request's start from what the lookup found (or what its disk read gave)."""
        request = running.request
        prompt = request.prompt_tokens
        matched, adopted, restore, disk_read = 0, None, None, None
        vision = request.vision
        if isinstance(found, OnDisk) and vision is not None and found.read.num_tokens < vision.end:
            # Image rows come only from the vision tower (below): not worth reading; memory's answer counts.
            found = found.memory
            reused = found.length if isinstance(found, Hit) else 0
            self._effects.append(CacheLookedUp(hit=reused > 0, tokens_reused=reused, tokens_queried=len(prompt)))
        if isinstance(found, OnDisk):
            matched, disk_read = found.read.num_tokens, found.read
        elif isinstance(found, Hit):
            if self._snapshots:
                matched, restore = found.length, found.payload
            elif found.payload.can_adopt(found.length):
                matched, adopted = found.length, found.payload
        if vision is not None and matched < vision.end:
            # Image rows come only from the vision tower: a prefix that stops short of them is not adopted.
            matched, adopted, restore = 0, None, None
        snapshots = (self._snapshot_points(request, matched)
                     if self._snapshots and self._cache.boundary_snapshots and vision is None else ())
        running.output.cached_tokens = matched
        return Pending(
            sequence_id=running.sequence_id,
            prompt_tokens=prompt[matched:],
            cached_tokens=prompt[:matched],
            adopted=adopted,
            restore=restore,
            disk_read=disk_read,
            snapshots=snapshots,
            sampling=request.sampling,
            max_tokens=request.max_tokens,
            donate_on_finish=request.cache_context is not None and self._cache.enabled,
            donate_prompt=request.cache_context is not None and (
                self._cache.prompt_donation or self._retains(request) or self._keeps_image_prompt(request)),
            vision=vision if matched == 0 else None,
            image_end=vision.end if vision is not None and matched else 0,
        )

    def _snapshot_points(self, request: NewRequest, matched: int) -> tuple[SnapshotPoint, ...]:
        return snapshot_points(
            prompt_len=len(request.prompt_tokens), matched=matched, history_boundary=request.history_boundary,
            shared_prefix=request.shared_prefix, checkpoint_spacing=self._cache.checkpoint_spacing,
            max_chunk_checkpoints=self._cache.max_chunk_checkpoints, sliding_window=self._cache.sliding_window)

    def _retains(self, request: NewRequest) -> bool:
        """A retaining request's prompt goes to the prefix store at the end of its prefill, whatever follows."""
        return request.retain_seconds > 0 and self._cache.prefix

    def _start_warmup(self, job: WarmSession, found: LookupResult) -> None:
        tokens = job.tokens
        matched, payload = (found.length, found.payload) if isinstance(found, Hit) else (0, None)
        if len(tokens) - matched < 1:
            self._warm_ups.covered()
            return
        sequence_id = self._new_sequence_id()
        self._warm_ups.start(sequence_id, job)
        if self._trace is not None:
            self._trace(f"warm-up session={job.context.session_key} extends snapshot {matched} -> {len(tokens)} tokens")
        self._admitted.append(Pending(
            sequence_id=sequence_id, prompt_tokens=tokens[matched:], cached_tokens=tokens[:matched],
            restore=payload, snapshots=(SnapshotPoint(after=len(tokens) - matched),), warm=True,
            sampling=SamplingParams(temperature=0.0), max_tokens=1,
        ))

    def _trace_snapshot(self, request: NewRequest, found: LookupResult | None) -> None:
        assert self._trace is not None
        assert request.cache_context is not None
        session = request.cache_context.session_key
        if isinstance(found, OnDisk):
            self._trace(f"request {request.request_id} session={session} reads its {found.read.num_tokens}-token "
                        f"snapshot from disk (prompt {len(request.prompt_tokens)})")
        elif isinstance(found, Hit):
            self._trace(f"request {request.request_id} session={session} restores its {found.length}-token "
                        f"snapshot (prompt {len(request.prompt_tokens)})")
        elif isinstance(found, Miss) and found.refusal is not None:
            self._trace(f"request {request.request_id} session={session} refused the stored snapshot: "
                        f"{found.refusal}")
        else:
            self._trace(f"request {request.request_id} session={session} has no snapshot")

    # --- the step -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step. Call once ``next_lookup`` returns None."""
        placement = self._placement
        admitted = [self._trim_prompt_donation(pending) for pending in self._admitted]
        candidates, self._admitted, self._deferred = [*self._deferred, *admitted], [], []
        starts: list[Start] = []
        budget = placement.budget()
        directs: dict[int, Pending] = {}
        for pending in candidates:
            if pending.restore is not None or pending.disk_read is not None:
                self._restoring[pending.sequence_id] = pending
            if placement.starts_directly(pending):
                start = placement.direct(pending)
                if not budget.take(start):
                    self._deferred.append(pending)
                    continue
                starts.append(start)
                directs[start.sequence_id] = pending
            elif placement.prefills_alone(pending):
                alone = placement.alone(pending)
                self._alone.append(alone)
                starts.append(StartAlone(sequence_id=pending.sequence_id, tokens=alone.tokens,
                                         adopted=pending.adopted if alone.done else None, kept=alone.done,
                                         adapter_scales=pending.sampling.adapter_scales,
                                         disk_read=pending.disk_read))
            else:
                starts.append(self._insert(pending))
        starts = self._rows_of_shared_passes(starts, directs)
        alone_chunk, alone_rest = None, None
        if self._alone:
            prefill = self._alone[0]
            end, last = placement.alone_chunk_end(prefill)
            alone_chunk = AloneChunk(sequence_id=prefill.pending.sequence_id, start=prefill.done, end=end, last=last)
            prefill.done = end
            if last:
                self._alone.pop(0)
                rest = placement.alone_rest(prefill, end)
                if budget.take_rest(len(rest.prompt_tokens)):
                    alone_rest = placement.direct(rest)
                else:
                    self._deferred.append(rest)
        run_batch = False
        if self._in_batch or budget.has_direct or alone_rest is not None:
            # While started prompts wait, first tokens go ahead of the batch's decode
            # and prefill chunk, for a bounded number of steps in a row; never ahead
            # of a first token the batch itself owes.
            hold = bool(self._deferred) and self._batch_holds < MAX_BATCH_HOLDS and not self._awaiting_first
            self._batch_holds = self._batch_holds + 1 if hold else 0
            run_batch = bool(self._in_batch) and not hold
        removals, self._removals = tuple(self._removals), []
        if self._warm_ups.is_running() and self._running:
            self._warm_ups.num_steps_with_foreground += 1
        writes = self.take_disk_writes()
        return StepPlan(removals=removals, starts=tuple(starts), alone_chunk=alone_chunk, alone_rest=alone_rest,
                        run_batch=run_batch, disk_writes=writes)

    def _rows_of_shared_passes(self, starts: list[Start], directs: dict[int, Pending]) -> list[Start]:
        """``starts`` less the direct starts of each shared pass past ``Placement.rows_now``: those wait a step,
        ahead of the starts that are over the budget (they came first)."""
        passes: dict[int, list[int]] = {}
        for start in starts:
            if isinstance(start, StartDirect) and shares_a_pass(start):
                passes.setdefault(start.kept, []).append(start.sequence_id)
        later = {sequence_id for members in passes.values()
                 for sequence_id in members[self._placement.rows_now(len(members)):]}
        if not later:
            return starts
        self._deferred[:0] = [pending for sequence_id, pending in directs.items() if sequence_id in later]
        return [start for start in starts if start.sequence_id not in later]

    def _insert(self, pending: Pending) -> InsertBatch:
        self._in_batch.add(pending.sequence_id)
        self._batch_prefilling.add(pending.sequence_id)
        return self._placement.insert(pending)

    def _trim_prompt_donation(self, pending: Pending) -> Pending:
        """Drop a prompt donation no request can use before the final one.

        A prompt of one prefill chunk is done within the step that admits it,
        so only requests that parked on it while this step was built can use
        its KV early; without them the copy would only delay the first token.
        A retaining request keeps it: its prompt must be stored even if the
        reply is cancelled or fails.
        """
        if (not pending.donate_prompt or len(pending.prompt_tokens) > self.capabilities.prefill_step_size
                or pending.sequence_id in self._parked):
            return pending
        running = self._running.get(pending.sequence_id)
        if running is not None and (self._retains(running.request) or self._keeps_image_prompt(running.request)):
            return pending
        return attrs.evolve(pending, donate_prompt=False)

    def _keeps_image_prompt(self, request: NewRequest) -> bool:
        """An image prompt is stored at the end of its prefill as well as with its reply.

        It adopts whole entries only, so a next turn whose re-rendered reply
        parts from the stored one could use none of the final entry; the
        prompt's own entry (an alias once the reply supersedes it) still covers
        the images and the history before the reply.
        """
        return request.vision is not None and self._cache.prefix

    # --- what came of it ------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult, clients: Clients, now: float) -> None:
        if plan.only_writes:
            return  # the device only queued writes: no step ran
        self._num_steps += 1
        if result.decode_batch_size:
            self._decode_batch_sizes[result.decode_batch_size] += 1
            if result.prefilling:
                self._num_interleaved_steps += 1
        if result.speculation is not None:
            work = result.speculation
            verify, proposed, accepted = self._speculation
            self._speculation = (verify + work.verify_steps, proposed + work.proposed_tokens,
                                 accepted + work.accepted_tokens)
        if result.error is None:
            self._track_device(plan, result)
        # Prompt KV first: a client that turns out to be gone at its first token still leaves its prompt.
        prompt_items = [item for item in result.detached if not item.final and not item.snapshot]
        for item in prompt_items:
            self._donate(item)
        if result.grammar is not None and result.grammar.failures:
            # Before the tokens: the device ended these rows with EOS, which must not read as a reply's end.
            self._fail_grammar_rows(result.grammar.failures, clients, now)
        for token in result.sampled:
            running = self._running.get(token.sequence_id)
            if running is not None and not running.finished:
                self._on_token(running, token, clients, now)
        for item in result.detached:
            if item.final or item.snapshot:
                self._donate(item)
        # A donation comes with the step that removes or ends its sequence, or not at all.
        for sequence_id in (*(removal.sequence_id for removal in plan.removals),
                            *(token.sequence_id for token in result.sampled if token.finish_reason is not None)):
            self._pending_donations.pop(sequence_id, None)
        for sequence_id in result.warmed:
            self._warm_ups.finished(sequence_id)
        for done in result.disk_reads:
            self._disk_read_done(plan, done)
        self._place_failed_restores(plan, result)
        for sequence_id in result.prompts_done:
            running = self._running.get(sequence_id)
            if running is not None:
                running.prompt_done = True
            # After the donation above: the parked requests' lookups will find it.
            self._release_parked(sequence_id)
        if result.error is not None:
            self._fail_step(result, clients)

    def _disk_read_done(self, plan: StepPlan, done: DiskReadDone) -> None:
        """A start's disk read: its lookup counted, what it gave donated to memory, and a short one placed again.

        A read that gave less than the start was placed for (a piece refused or gone, a read cut short
        where prefilling is faster) did not run: the start is placed again, in the next step, on what
        the read gave, else on memory's match, else cold.
        """
        read = next((start.disk_read for start in plan.starts if start.sequence_id == done.sequence_id), None)
        running = self._running.get(done.sequence_id)
        if read is None or running is None:
            if done.payload is not None:
                self._release.append(done.payload)  # freed on the device thread, with the next step
            return
        request = running.request
        found: Hit | Miss = Miss()
        if done.payload is not None:
            found = Hit(length=done.num_tokens, payload=done.payload)
        elif read.memory is not None and read.memory_tokens:
            found = Hit(length=read.memory_tokens, payload=read.memory)
        reused = found.length if isinstance(found, Hit) else 0
        self._effects.append(CacheLookedUp(hit=reused > 0, tokens_reused=reused,
                                           tokens_queried=len(request.prompt_tokens)))
        context = request.cache_context
        if done.payload is not None and context is None:
            self._release.append(done.payload)
        elif done.payload is not None and context is not None:
            # Promoted into memory: the store owns it from now on (and frees it on the device thread).
            tokens = request.prompt_tokens[:done.num_tokens]
            if read.snapshot:
                self._effects.append(DonateSnapshot(
                    context=context, tokens=tokens, payload=done.payload, nbytes=done.payload.nbytes,
                    cuttable=bool(getattr(done.payload, "cuttable", False))))
            else:
                # A retained prompt read back within its ttl is pinned again (DiskTier.record_retention).
                self._effects.append(DonateSequence(
                    context=context, tokens=tokens, payload=done.payload, nbytes=done.payload.nbytes,
                    retain_seconds=read.retain_seconds if done.num_tokens >= read.num_tokens else 0.0))
        if done.started or running.finished:
            return
        self._restoring.pop(done.sequence_id, None)
        self._forget_on_device(done.sequence_id)
        self._alone = [alone for alone in self._alone if alone.pending.sequence_id != done.sequence_id]
        self._deferred = [other for other in self._deferred if other.sequence_id != done.sequence_id]
        self._deferred.insert(0, self._pending(running, found))

    def _place_failed_restores(self, plan: StepPlan, result: StepResult) -> None:
        """A snapshot the device could not restore: the start did not run, and is placed again from no state."""
        reasons = dict(result.restore_failures)
        for start in plan.starts:
            pending = self._restoring.pop(start.sequence_id, None)
            if start.sequence_id not in reasons:
                continue
            self._effects.append(SnapshotRestoreFailed(reason=reasons[start.sequence_id]))
            self._forget_on_device(start.sequence_id)
            running = self._running.get(start.sequence_id)
            warming = self._warm_ups.running(start.sequence_id) is not None
            live = (running is not None and not running.finished) or warming
            if pending is None or not live:
                continue
            if running is not None:
                running.output.cached_tokens = 0
                snapshots = (self._snapshot_points(running.request, 0)
                             if self._cache.boundary_snapshots and running.request.vision is None else ())
            else:  # a warm-up: its points count from its prompt, which now starts at the first token
                snapshots = tuple(attrs.evolve(point, after=point.after + len(pending.cached_tokens))
                                  for point in pending.snapshots)
            self._deferred.insert(0, attrs.evolve(
                pending, prompt_tokens=pending.cached_tokens + pending.prompt_tokens, cached_tokens=(),
                restore=None, adopted=None, snapshots=snapshots))

    def _track_device(self, plan: StepPlan, result: StepResult) -> None:
        """Which sequences the device's batch holds now, and which owe a first token."""
        finished = {token.sequence_id for token in result.sampled if token.finish_reason is not None}
        for start in plan.direct_starts:
            if start.sequence_id not in finished:
                self._in_batch.add(start.sequence_id)  # it decodes on in the batch
        for sequence_id in result.prompts_done:
            if sequence_id in self._batch_prefilling:
                self._batch_prefilling.discard(sequence_id)
                self._awaiting_first.add(sequence_id)
        for token in result.sampled:
            self._awaiting_first.discard(token.sequence_id)
        for sequence_id in (*finished, *result.warmed):
            self._forget_on_device(sequence_id)

    def _forget_on_device(self, sequence_id: int) -> None:
        self._in_batch.discard(sequence_id)
        self._batch_prefilling.discard(sequence_id)
        self._awaiting_first.discard(sequence_id)

    def _donate_snapshot(self, item: DetachedSequence) -> None:
        warm = self._warm_ups.running(item.sequence_id)
        running = self._running.get(item.sequence_id)
        context = warm.context if warm is not None else (
            running.request.cache_context if running is not None else None)
        if context is not None:
            self._effects.append(DonateSnapshot(
                context=context, tokens=item.tokens, payload=item.payload, nbytes=item.nbytes,
                checkpoint=item.checkpoint, cuttable=bool(getattr(item.payload, "cuttable", False))))

    def _donate(self, item: DetachedSequence) -> None:
        if item.snapshot:
            self._donate_snapshot(item)
            return
        context: CacheContext | None = None
        tokens = item.tokens
        prompt_len, retain_seconds = len(tokens), 0.0
        if item.final:
            if item.sequence_id in self._pending_donations:
                context, prompt_len, retain_seconds = self._pending_donations.pop(item.sequence_id)
        else:
            running = self._running.get(item.sequence_id)
            if running is not None:
                context, retain_seconds = running.request.cache_context, running.request.retain_seconds
                vision = running.request.vision
                if vision is not None and vision.entry_end is not None:
                    # An image prompt's entry ends with its last message (docs/prompt-cache.md, "Images").
                    tokens = tokens[:vision.entry_end]
                    prompt_len = len(tokens)
        if context is None:
            return
        self._effects.append(DonateSequence(context=context, tokens=tokens, payload=item.payload,
                                            nbytes=item.nbytes, prompt_len=prompt_len,
                                            retain_seconds=retain_seconds))

    def _fail_step(self, result: StepResult, clients: Clients) -> None:
        if result.out_of_memory:
            # Queued before any later lookup, so the store sheds before the next admission.
            self._effects.append(ShedCache())
        # The device dropped everything it held, and starts waiting on it are lost with it.
        failed = set(result.failed_sequences) | {pending.sequence_id for pending in self._deferred}
        self._deferred = []
        self._alone = []
        self._in_batch.clear()
        self._batch_prefilling.clear()
        self._awaiting_first.clear()
        self._batch_holds = 0
        for sequence_id in sorted(failed):
            self._warm_ups.lost(sequence_id)
            running = self._running.get(sequence_id)
            if running is None or running.finished:
                continue
            self._num_failed += 1
            error: MlxcelError = GenerationFailed(f"the model failed while generating: {result.error}")
            if result.out_of_memory:
                error = ServerBusy("the device ran out of memory for this request; retry shortly")
            # A client that is gone misses nothing.
            clients.fail(running.request.request_id, error)
            self._forget(running, clients)

    def _fail_grammar_rows(self, failures: tuple[GrammarFailure, ...], clients: Clients, now: float) -> None:
        """Requests whose grammar gave up on the device (a late mask, a llguidance limit): a 400 naming the field."""
        for failure in failures:
            running = self._running.get(failure.sequence_id)
            if running is None or running.finished:
                continue
            request = running.request
            # No field named: the router's grammar of the request's tools.
            param = request.sampling.grammar_param or "tools"
            logger.warning("request %s ends: %s", request.request_id, failure.reason)
            self._num_failed += 1
            code = "grammar_too_slow" if failure.timed_out else "grammar_failed"
            clients.fail(request.request_id, InvalidRequest(f"{param} cannot be enforced: {failure.reason}",
                                                            param=param, code=code))
            self._finish(running, clients, now, donate=False, reason=None)

    def _on_token(self, running: _Running, token: SampledToken, clients: Clients, now: float) -> None:
        if type(running.output) is TokenRelay:
            running.output.count(token.token, token.finish_reason, now)
            self._send(running, token, clients, now, on_device=token.finish_reason is None)
            if token.finish_reason is not None and not running.finished:
                self._finish(running, clients, now, donate=True, reason=token.finish_reason, on_device=False)
            return
        assert isinstance(running.output, RequestOutput)
        out = running.output.add(token.token, token.logprob, token.top_logprobs, token.finish_reason, now)
        if out.delta is not None:
            # A sequence the device finished with this token is no longer there to remove.
            self._send(running, out.delta, clients, now, on_device=token.finish_reason is None)
            if running.finished:
                return  # the client went away: cancelled, not completed
        if out.finish_reason is not None:
            # A stop string ends the reply while the device still holds the sequence.
            self._finish(running, clients, now, donate=True, reason=out.finish_reason,
                         on_device=out.stopped_by_text)

    def _send(self, running: _Running, delta: Delta | SampledToken, clients: Clients, now: float, *,
              on_device: bool = True) -> None:
        if not clients.send(running.request.request_id, delta) and not running.finished:
            # The client is gone or too slow: free its sequence.
            self._num_cancelled += 1
            self._finish(running, clients, now, donate=False, reason=None, on_device=on_device)

    def _finish(
        self, running: _Running, clients: Clients, now: float, *, donate: bool, reason: str | None,
        on_device: bool = True,
    ) -> None:
        """End a request. ``reason`` None means cancelled: no final event, no donation.

        A reply counts as a healthy completion only if its final event reaches
        the client; one whose client has gone is cancelled instead.
        """
        running.finished = True
        context = running.request.cache_context
        final = running.output.final(reason, now) if reason is not None else None
        healthy = final is not None and clients.send(running.request.request_id, final)
        if reason is not None and not healthy:
            self._num_cancelled += 1
        donate = donate and healthy and context is not None
        if on_device:
            self._remove(running.sequence_id, donate=donate)
        if donate:
            assert context is not None
            self._pending_donations[running.sequence_id] = (
                context, len(running.request.prompt_tokens), running.request.retain_seconds)
        if healthy:
            assert final is not None
            assert final.usage is not None
            assert reason is not None
            usage, output = final.usage, running.output
            self._num_completed += 1
            if type(output) is RequestOutput:
                # A relayed reply's edge reports it, with the reply's own counts (Engine.record_finished).
                self._effects.append(RequestFinished(
                    finish_reason=final.finish_reason or reason, prompt_tokens=usage.prompt_tokens,
                    cached_tokens=usage.cached_tokens,
                    completion_tokens=usage.completion_tokens,
                    seconds_to_first_token=(None if output.first_token_at is None
                                            else output.first_token_at - output.submitted_at),
                ))
            if context is not None and self._snapshots:
                # Only snapshot families have a next turn to warm.
                self._effects.append(ReplyFinished(
                    context=context, chat=running.request.chat, reply_text=output.text,
                    prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                ))
        self._forget(running, clients)

    def _remove(self, sequence_id: int, *, donate: bool) -> None:
        """Take a sequence off the device; one never sent there is just dropped."""
        self._admitted = [p for p in self._admitted if p.sequence_id != sequence_id]
        self._deferred = [p for p in self._deferred if p.sequence_id != sequence_id]
        self._alone = [a for a in self._alone if a.pending.sequence_id != sequence_id]
        self._restoring.pop(sequence_id, None)  # a deferred restore cancelled before it ran
        self._forget_on_device(sequence_id)
        self._removals.append(Removal(sequence_id=sequence_id, donate=donate))

    def _forget(self, running: _Running, clients: Clients) -> None:
        running.finished = True
        self._release_parked(running.sequence_id)
        clients.close(running.request.request_id)
        self._running.pop(running.sequence_id, None)
        self._sequence_of.pop(running.request.request_id, None)

    def _release_parked(self, sequence_id: int) -> None:
        parked = self._parked.pop(sequence_id, None)
        if parked:
            self._num_shared_prefills += len(parked)
            # Ahead of later arrivals: they were admitted-in-waiting already.
            self._waiting.extendleft(reversed(parked))

    def _idle(self) -> bool:
        return not (self._waiting or self._running or self._parked)

    def _new_sequence_id(self) -> int:
        sequence_id = self._next_sequence_id
        self._next_sequence_id += 1
        return sequence_id

    # --- statistics -----------------------------------------------------------------------

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_steps=self._num_steps,
            num_completed=self._num_completed,
            num_cancelled=self._num_cancelled,
            num_failed=self._num_failed,
            max_decode_batch_size=max(self._decode_batch_sizes, default=0),
            decode_batch_sizes=dict(self._decode_batch_sizes),
            num_interleaved_steps=self._num_interleaved_steps,
            num_parked=sum(len(parked) for parked in self._parked.values()),
            num_shared_prefills=self._num_shared_prefills,
            num_warm_started=self._warm_ups.num_started,
            num_warm_completed=self._warm_ups.num_completed,
            num_warm_covered=self._warm_ups.num_covered,
            num_warm_preempted=self._warm_ups.num_preempted,
            num_warm_steps_with_foreground=self._warm_ups.num_steps_with_foreground,
            num_verify_steps=self._speculation[0],
            num_proposed_tokens=self._speculation[1],
            num_accepted_tokens=self._speculation[2],
            running_request_ids=tuple(r.request.request_id for r in self._running.values()),
        )
