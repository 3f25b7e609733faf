"""The warm-up queue alone: pending jobs per store session, the lookup out, the running ones."""

from __future__ import annotations

import attrs

from mlxcel.cache.key import CacheContext
from mlxcel.core import warmups
from mlxcel.core.warmups import WarmSession, WarmUps

CONTEXT = CacheContext(model_id="m", template_sig="sig", session_key="s")


def test_a_next_turn_replaces_its_pending_warm_up_but_not_another_sessions() -> None:
    queue = WarmUps()
    queue.queue(WarmSession(context=CONTEXT, tokens=(1, 2)))
    for change in ({"lora_id": "a"}, {"cache_salt": "t"}, {"session_key": "o"}):
        queue.queue(WarmSession(context=attrs.evolve(CONTEXT, **change), tokens=(1, 2, 3)))
    queue.queue(WarmSession(context=CONTEXT, tokens=(1, 2, 3)))
    assert [(job.context, job.tokens) for job in queue.pending()][-1] == (CONTEXT, (1, 2, 3))
    assert len(queue.pending()) == 4
    assert queue.num_queued == 5


def test_the_queue_keeps_the_newest_jobs_and_hands_out_one_lookup_at_a_time() -> None:
    queue = WarmUps()
    for index in range(warmups.MAX_PENDING_WARMUPS + 2):
        queue.queue(WarmSession(context=attrs.evolve(CONTEXT, session_key=str(index)), tokens=(index,)))
    assert len(queue.pending()) == warmups.MAX_PENDING_WARMUPS
    first = queue.next_lookup()
    assert first is not None
    assert first.tokens == (2,)  # the two oldest were dropped
    assert queue.next_lookup() is None  # one lookup out at a time
    assert queue.looked_up() is first
    queue.start(7, first)
    assert queue.running(7) is first
    assert queue.preempt() == (7,)
    assert (queue.is_running(), queue.num_started, queue.num_preempted) == (False, 1, 1)


def test_a_preempted_job_waits_again_at_the_front_unless_a_newer_turn_replaced_it() -> None:
    queue = WarmUps()
    other = WarmSession(context=attrs.evolve(CONTEXT, session_key="o"), tokens=(9,))
    job = WarmSession(context=CONTEXT, tokens=(1, 2))
    queue.queue(job)
    assert queue.next_lookup() is job
    queue.looked_up()
    queue.start(3, job)
    queue.queue(other)
    queue.preempt()
    assert queue.pending() == (job, other)
    # A newer turn of the same conversation waits already: the dropped job is not queued again.
    queue.start(4, queue.next_lookup())
    queue.looked_up()
    newer = WarmSession(context=CONTEXT, tokens=(1, 2, 3, 4))
    queue.queue(newer)
    queue.preempt()
    assert queue.pending() == (other, newer)
    assert queue.num_preempted == 2
