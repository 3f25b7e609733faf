"""The real SmolLM2 (float32 fixture) on an edit workload: greedy replies identical with and without speculation.

The device's executor under a scheduling core on this thread, as
benchmarks/speculative.py runs it (there on the full 2k-token file): two
streams copy a short file back with one name changed, and must produce the
same tokens and logprobs with ``--speculative ngram`` as without, having
accepted proposals.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mlxcel.core.plan import Capabilities
from mlxcel.core.scheduler import NewRequest, SchedulerCore
from mlxcel.fixtures import fixture_path
from mlxcel.model.draft import load_draft
from mlxcel.model.executor import DeviceSettings, StepExecutor
from mlxcel.model.loader import ModelLoadError, load_model
from mlxcel.types import Delta, SamplingParams
from tests.support import Recorder

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def gate_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step with proposals verifies: these tests are about what a verify step gives, not about when
    the gate (mlxcel/core/speculation_gate.py, measured wall times) lets one run."""
    from mlxcel.core.speculation_gate import SpeculationGate

    monkeypatch.setattr(SpeculationGate, "should_verify", lambda gate, batch_size: True)


FILE = """def total_price(items, tax):
    total = 0
    for item in items:
        total = total + item.price * item.count
    return total * (1 + tax)


def total_weight(items):
    total = 0
    for item in items:
        total = total + item.weight
    return total
"""


def run(loaded: Any, prompts: list[tuple[int, ...]], speculative: str,
        draft: Any = None) -> tuple[dict[str, list[Delta]], Any]:
    path = fixture_path("smollm2-f32")
    settings = DeviceSettings(model_path=path, context_size=4096, prefill_step_size=256,
                              speculative=speculative, speculative_tokens=4)
    executor = StepExecutor(loaded.model, loaded.eos_token_ids, settings, loaded.family.model_type,
                            tokenizer=loaded.tokenizer, draft=draft)
    core = SchedulerCore(Capabilities(prefill_step_size=256, context_size=4096), tokenizer=loaded.tokenizer,
                         eos_token_ids=frozenset(loaded.eos_token_ids))
    clients = Recorder()
    for index, prompt in enumerate(prompts):
        core.add(NewRequest(request_id=f"r{index}", prompt_tokens=prompt, max_tokens=80,
                            sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
                            cache_context=None), clients)
    for _ in range(400):
        if not core.has_work():
            break
        assert core.next_lookup(0.0) is None
        plan = core.schedule()
        core.update(plan, executor.run_step(plan), clients, 0.0)
    assert not core.has_work()
    return clients.deltas, executor.speculation_stats


def edit_prompts(loaded: Any) -> list[tuple[int, ...]]:
    prompts = []
    for name in ("amount", "result"):
        text = (f"Here is a Python file.\n\n```python\n{FILE}```\n\nRewrite the whole file, unchanged except that "
                f"the variable `total` is renamed to `{name}`. Reply with the file only.")
        chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        prompts.append(tuple(loaded.tokenizer.encode(chat, add_special_tokens=False)))
    return prompts


def assert_same_replies(spoken: dict[str, list[Delta]], plain: dict[str, list[Delta]]) -> None:
    assert spoken.keys() == plain.keys()
    for request_id, deltas in plain.items():
        assert [t for d in spoken[request_id] for t in d.token_ids] == [t for d in deltas for t in d.token_ids]
        assert "".join(d.text for d in spoken[request_id]) == "".join(d.text for d in deltas)
        assert spoken[request_id][-1].finish_reason == deltas[-1].finish_reason
        ours = np.array([lp.logprob for d in spoken[request_id] for lp in d.logprobs])
        theirs = np.array([lp.logprob for d in deltas for lp in d.logprobs])
        np.testing.assert_allclose(ours, theirs, atol=2e-4)


def test_an_edit_is_identical_with_speculation() -> None:
    loaded = load_model(fixture_path("smollm2-f32"))
    prompts = edit_prompts(loaded)
    plain, _ = run(loaded, prompts, "off")
    spoken, stats = run(loaded, prompts, "ngram")
    assert stats.accepted_tokens > 20
    assert_same_replies(spoken, plain)


def test_an_edit_is_identical_with_the_model_as_its_own_draft() -> None:
    loaded = load_model(fixture_path("smollm2-f32"))
    prompts = edit_prompts(loaded)
    plain, _ = run(loaded, prompts, "off")
    draft = load_draft(fixture_path("smollm2-f32"), loaded.tokenizer, prefill_step_size=256)
    spoken, stats = run(loaded, prompts, "draft", draft)
    # Its own draft agrees with it but for near-ties that batched and unbatched arithmetic split.
    assert stats.accepted_tokens > 0.9 * stats.proposed_tokens > 50
    assert_same_replies(spoken, plain)


def test_the_device_refuses_a_draft_of_another_vocabulary(tmp_path) -> None:
    from tests.test_cli import other_vocabulary_folder

    target = load_model(fixture_path("llama"))
    other = other_vocabulary_folder(fixture_path("llama"), tmp_path / "other")
    (other / "model.safetensors").symlink_to(fixture_path("llama") / "model.safetensors")
    with pytest.raises(ModelLoadError, match="vocabulary differs"):
        load_draft(other, target.tokenizer, prefill_step_size=64)
    with pytest.raises(ValueError, match="needs a draft model"):
        StepExecutor(target.model, target.eos_token_ids,
                     DeviceSettings(model_path=fixture_path("llama"), prefill_step_size=64, speculative="draft"),
                     tokenizer=target.tokenizer)
