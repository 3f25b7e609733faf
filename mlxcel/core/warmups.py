"""The warm-up queue: background extensions of session snapshots, waiting for an idle device.

The core decides when a warm-up runs (only while idle) and when it gives way
(at once, to any other foreground work); this module keeps the jobs: pending
ones, newest per conversation, the one whose snapshot lookup is out, and
those running on the device, with their counts. Pure: no Trio, no MLX.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import attrs

from mlxcel.cache.key import CacheContext, session_id

# Warm-ups waiting for an idle device, newest per session; older ones are dropped.
MAX_PENDING_WARMUPS = 64


@attrs.frozen(kw_only=True)
class WarmSession:
    """Extend the session's snapshot to cover ``tokens`` (the next turn's history), when idle."""

    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)


class WarmUps:
    def __init__(self) -> None:
        # Oldest first, each under the number it was queued as.
        self._pending: collections.OrderedDict[int, WarmSession] = collections.OrderedDict()
        # The job whose snapshot lookup is out, and the jobs on the device by sequence id.
        self._looking_up: WarmSession | None = None
        self._running: dict[int, WarmSession] = {}
        self.num_queued = 0
        self.num_started = 0
        self.num_completed = 0
        # Jobs whose stored snapshot already covered their tokens: nothing ran.
        self.num_covered = 0
        self.num_preempted = 0
        # Steps in which a warm-up ran beside foreground work (it waited for the next turn's request).
        self.num_steps_with_foreground = 0

    def queue(self, job: WarmSession) -> None:
        """Queue ``job``; it replaces a pending one of the same conversation (whose tokens it extends).

        The same conversation is the same store session (``session_id``:
        model, adapters, tenant, session key) on the same path: a warm-up
        under another adapter configuration is another session's and stays.
        """
        for number, pending in list(self._pending.items()):
            if self._extends(job, pending):
                del self._pending[number]
        self.num_queued += 1
        self._pending[self.num_queued] = job
        self._drop_oldest()

    def pending(self) -> tuple[WarmSession, ...]:
        """The jobs waiting, oldest first."""
        return tuple(self._pending.values())

    def has_pending(self) -> bool:
        return bool(self._pending)

    def next_lookup(self) -> WarmSession | None:
        """The oldest pending job, whose snapshot lookup goes out now; None while one is out or none waits."""
        if self._looking_up is not None or not self._pending:
            return None
        _number, self._looking_up = self._pending.popitem(last=False)
        return self._looking_up

    def looked_up(self) -> WarmSession:
        """The job whose lookup has been answered."""
        job, self._looking_up = self._looking_up, None
        assert job is not None
        return job

    def start(self, sequence_id: int, job: WarmSession) -> None:
        self._running[sequence_id] = job
        self.num_started += 1

    def is_running(self) -> bool:
        return bool(self._running)

    def running(self, sequence_id: int) -> WarmSession | None:
        return self._running.get(sequence_id)

    def __iter__(self) -> Iterator[WarmSession]:
        """The running jobs."""
        return iter(self._running.values())

    def covered(self) -> None:
        """The job's lookup found its tokens stored already: it ends without running."""
        self.num_covered += 1

    def finished(self, sequence_id: int) -> None:
        """The device took the job's snapshot."""
        if self._running.pop(sequence_id, None) is not None:
            self.num_completed += 1

    def preempt(self) -> tuple[int, ...]:
        """Give way to foreground work: every running job stops, storing nothing; their sequence ids.

        Each goes back to the front of the queue, to run again at the next idle
        moment, unless a newer job of its conversation (whose tokens extend it)
        waits already: a dropped warm-up otherwise leaves its conversation's
        next turn to prefill the reply again.
        """
        preempted = tuple(self._running)
        self.num_preempted += len(preempted)
        for job in reversed(tuple(self._running.values())):
            if not any(self._extends(pending, job) for pending in self._pending.values()):
                self.num_queued += 1
                self._pending[self.num_queued] = job
                self._pending.move_to_end(self.num_queued, last=False)
        self._drop_oldest()
        self._running.clear()
        return preempted

    def _drop_oldest(self) -> None:
        while len(self._pending) > MAX_PENDING_WARMUPS:
            self._pending.popitem(last=False)

    @staticmethod
    def _extends(newer: WarmSession, older: WarmSession) -> bool:
        return (session_id(newer.context) == session_id(older.context)
                and newer.tokens[: len(older.tokens)] == older.tokens)

    def lost(self, sequence_id: int) -> None:
        """The device dropped the job's sequence (a failed step)."""
        self._running.pop(sequence_id, None)
