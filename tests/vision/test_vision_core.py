"""The scheduling core with images: a prompt with images starts cold and whole unless a prefix covers them."""

from __future__ import annotations

import attrs
import pytest

from mlxcel.cache.key import CacheContext, multimodal_digest
from mlxcel.core import placement
from mlxcel.core.plan import StartAlone, StartDirect
from mlxcel.core.scheduler import Hit, NewRequest
from tests.core.test_scheduler_core import GREEDY, Harness, _Payload

CONTEXT = CacheContext(model_id="m", template_sig="sig", session_key="s", mm_digest=multimodal_digest([b"png"]))


@attrs.frozen
class Images:
    """What the core reads of mlxcel.vision.processing.VisionInputs."""

    end: int
    entry_end: int | None = None


def start_with(prompt_length: int, image_end: int, hit: int | None, **capabilities) -> StartDirect:
    harness = Harness(**capabilities)
    prompt = tuple(range(prompt_length))
    if hit is not None:
        harness.found[repr(prompt)] = Hit(length=hit, payload=_Payload(length=hit))
    harness.core.add(NewRequest(request_id="r", prompt_tokens=prompt, sampling=GREEDY, max_tokens=4,
                                cache_context=CONTEXT, vision=Images(end=image_end)), harness.clients)
    (start,) = harness.step().starts
    assert isinstance(start, StartDirect)
    return start


def test_a_prefix_short_of_the_images_is_declined_and_the_prompt_runs_whole() -> None:
    start = start_with(40, image_end=30, hit=20)
    assert (start.cached_tokens, len(start.prompt_tokens), start.adopted) == ((), 40, None)
    assert start.vision == Images(end=30)


def test_a_prefix_past_the_images_is_adopted_and_only_text_runs() -> None:
    start = start_with(40, image_end=30, hit=34)
    assert (len(start.cached_tokens), len(start.prompt_tokens), start.kept) == (34, 6, 34)
    assert start.vision is None


def test_a_long_prompt_with_images_still_starts_directly() -> None:
    # Longer than the 16-token chunk: a text prompt would prefill in the batch.
    start = start_with(100, image_end=60, hit=None)
    assert len(start.prompt_tokens) == 100
    assert start.vision is not None


def test_a_bucketed_start_never_cuts_back_into_the_images(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "START_PREFIX_ALIGN", 8)
    # 34 cached tokens would be cut to 32, under the image end at 33: the whole prefix is kept instead.
    start = start_with(40, image_end=33, hit=34, bucket_starts=True)
    assert (len(start.cached_tokens), start.kept, start.vision) == (34, 34, None)
    # An end at 32 survives the cut: the aligned start, as for text.
    assert start_with(40, image_end=32, hit=34, bucket_starts=True).kept == 32


def test_a_long_hit_prefilled_alone_keeps_the_image_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "START_PREFIX_ALIGN", 8)
    harness = Harness(bucket_starts=True)
    prompt = tuple(range(80))
    harness.found[repr(prompt)] = Hit(length=34, payload=_Payload(length=34))
    harness.core.add(NewRequest(request_id="r", prompt_tokens=prompt, sampling=GREEDY, max_tokens=4,
                                cache_context=CONTEXT, vision=Images(end=33)), harness.clients)
    (start,) = harness.step().starts
    assert isinstance(start, StartAlone)
    assert (start.kept, start.adopted is not None) == (34, True)


def test_an_image_prompt_is_donated_up_to_its_entry_end_and_the_reply_whole() -> None:
    """The prompt's entry ends where the router said (before the generation prompt)."""
    from mlxcel.core.effects import DonateSequence
    from mlxcel.core.plan import DetachedSequence, StepPlan, StepResult

    harness = Harness()
    prompt = tuple(range(40))
    harness.core.add(NewRequest(request_id="r", prompt_tokens=prompt, sampling=GREEDY, max_tokens=8,
                                cache_context=CONTEXT, vision=Images(end=30, entry_end=37)), harness.clients)
    (start,) = harness.step().starts
    assert start.donate_prompt is True
    harness.core.take_effects()
    prompt_kv = DetachedSequence(sequence_id=start.sequence_id, tokens=prompt, payload="kv", nbytes=64, final=False)
    harness.core.update(StepPlan(), StepResult(step_number=2, detached=(prompt_kv,)), harness.clients, 0.0)
    (donation,) = [effect for effect in harness.core.take_effects() if isinstance(effect, DonateSequence)]
    # The payload keeps all 40 rows (nothing is copied); the entry names 37 tokens of them.
    assert (donation.tokens, donation.prompt_len, donation.payload) == (prompt[:37], 37, "kv")
    # Without an entry end (the router found none past the images), the whole prompt as before.
    harness.core.add(NewRequest(request_id="q", prompt_tokens=prompt, sampling=GREEDY, max_tokens=8,
                                cache_context=attrs.evolve(CONTEXT, session_key="t"), vision=Images(end=30)),
                     harness.clients)
    (other,) = harness.step().starts
    harness.core.take_effects()
    prompt_kv = attrs.evolve(prompt_kv, sequence_id=other.sequence_id)
    harness.core.update(StepPlan(), StepResult(step_number=4, detached=(prompt_kv,)), harness.clients, 0.0)
    (whole,) = [effect for effect in harness.core.take_effects() if isinstance(effect, DonateSequence)]
    assert (whole.tokens, whole.prompt_len) == (prompt, 40)
