"""Rows of one batched start pass join the decode batch as they lie in its buffer, their filler masked.

The llama fixture (float32) through the executor and a scheduling core of
bucketed capabilities (a GPU's shapes): three requests decode, then a wave of
cold prompts of different lengths starts in one shared pass (filler rows and
positions included; one of them ends at its first token) and joins the running
batch (the first three started in a pass of their own, into the empty
batch). Every reply's tokens and logprobs must be what mlx-lm's merge of the
rows (a copy of each row into a left-padded buffer) gives.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from mlxcel.core.plan import Capabilities
from mlxcel.core.scheduler import NewRequest, SchedulerCore
from mlxcel.fixtures import fixture_path
from mlxcel.model import batch_join, gapped_cache
from mlxcel.model.executor import DeviceSettings, StepExecutor
from mlxcel.model.loader import LoadedModel, load_model
from mlxcel.types import SamplingParams
from tests.support import Recorder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(fixture_path("llama"))


def replies(loaded: LoadedModel) -> dict[str, list[tuple[tuple[int, ...], tuple[float, ...]]]]:
    """Each request's deltas as (token ids, logprobs), greedy.

    The core runs a power of two of a wave's rows at a time (Placement.rows_now); here every row of a
    wave goes in one pass, so the device pads them with filler rows, as it does where a pass's width splits
    a group into row counts of other sizes.
    """
    settings = DeviceSettings(model_path=fixture_path("llama"), prefill_step_size=512, context_size=4096,
                              max_batch_size=16)
    executor = StepExecutor(loaded.model, loaded.eos_token_ids, settings, loaded.family.model_type,
                            tokenizer=loaded.tokenizer)
    executor.bucket_starts = True
    core = SchedulerCore(Capabilities(prefill_step_size=512, context_size=4096, max_batch_size=16,
                                      bucket_starts=True),
                         tokenizer=loaded.tokenizer, eos_token_ids=frozenset())
    core._placement.rows_now = lambda count: count  # type: ignore[method-assign]
    clients = Recorder()
    sampling = SamplingParams(temperature=0.0, logprobs=True)

    def add(name: str, length: int, max_tokens: int) -> None:
        prompt = tuple(200 + (31 * len(name) + 7 * step) % 900 for step in range(length))
        core.add(NewRequest(request_id=name, prompt_tokens=prompt, max_tokens=max_tokens, sampling=sampling,
                            cache_context=None), clients)

    def step() -> None:
        assert core.next_lookup(0.0) is None
        plan = core.schedule()
        core.update(plan, executor.run_step(plan), clients, 0.0)

    for index in range(3):
        add(f"early{index}", 9 + 4 * index, 12)
    for _ in range(3):
        step()
    # Five rows of 3-29 tokens: one pass of 8 rows (3 filler) of 32 positions; `wave1` ends at its first token.
    for index, length in enumerate((29, 3, 17, 11, 22)):
        add(f"wave{index}", length, 1 if index == 1 else 9)
    for _ in range(40):
        if not core.has_work():
            break
        step()
    assert not core.has_work()
    return {name: [(delta.token_ids, tuple(item.logprob for item in delta.logprobs)) for delta in deltas]
            for name, deltas in clients.deltas.items()}


def test_a_passes_rows_join_in_place_and_decode_as_merged_rows_do(loaded: LoadedModel, monkeypatch: Any) -> None:
    used: list[int] = []
    adopt = gapped_cache.from_shared_pass

    def counting(caches: Any, rows: list[int], lengths: list[int]) -> Any:
        used.append(len(rows))
        return adopt(caches, rows, lengths)

    monkeypatch.setattr(gapped_cache, "from_shared_pass", counting)
    in_place = replies(loaded)
    # The first three into the empty batch, then the wave's rows but the one that ended at its first token.
    assert used == [3, 4]

    original = batch_join.join_decoding
    monkeypatch.setattr(batch_join, "join_decoding", lambda generator, joiners: original(
        generator, [attrs.evolve(joiner, shared=None) for joiner in joiners]))
    merged = replies(loaded)
    assert used == [3, 4]  # not taken again: mlx-lm's merge

    assert in_place.keys() == merged.keys()
    for name, deltas in merged.items():
        tokens = [ids for ids, _ in deltas]
        assert [ids for ids, _ in in_place[name]] == tokens, name
        for (_, ours), (_, theirs) in zip(in_place[name], deltas, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-5), name
    assert sum(len(ids) for ids, _ in merged["wave0"]) == 9
