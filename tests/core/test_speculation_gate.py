"""The speculation gate: verify steps only while they emit more tokens per second than plain steps."""

from __future__ import annotations

from mlxcel.core.speculation_gate import EXPLORE_EVERY, WARM_STEPS, SpeculationGate


def measured(gate: SpeculationGate, rows: int, *, plain_rate: float, verify_rate: float) -> None:
    for _ in range(WARM_STEPS):
        assert gate.should_verify(rows)  # verify steps are measured first
        gate.record(rows, verified=True, tokens=int(verify_rate), seconds=1.0)
    for _ in range(WARM_STEPS):
        assert not gate.should_verify(rows)  # then plain ones, even while every step has proposals
        gate.record(rows, verified=False, tokens=int(plain_rate), seconds=1.0)


def test_verifying_goes_on_while_it_is_faster() -> None:
    gate = SpeculationGate()
    measured(gate, 1, plain_rate=100, verify_rate=180)
    assert all(gate.should_verify(1) for _ in range(3 * EXPLORE_EVERY))


def test_a_slower_verify_step_stops_verifying_but_one_step_in_explore_every_still_measures() -> None:
    gate = SpeculationGate()
    measured(gate, 8, plain_rate=100, verify_rate=55)
    choices = [gate.should_verify(8) for _ in range(2 * EXPLORE_EVERY)]
    assert choices.count(True) == 2
    assert choices[EXPLORE_EVERY - 1]
    assert choices[2 * EXPLORE_EVERY - 1]


def test_a_workload_that_starts_repeating_opens_the_gate_again() -> None:
    gate = SpeculationGate()
    measured(gate, 4, plain_rate=100, verify_rate=50)
    assert not gate.should_verify(4)
    for _ in range(6):  # the exploring steps now emit far more: the verify rate overtakes the plain one
        gate.record(4, verified=True, tokens=400, seconds=1.0)
    assert gate.should_verify(4)


def test_batch_sizes_are_measured_apart_in_powers_of_two() -> None:
    gate = SpeculationGate()
    measured(gate, 8, plain_rate=100, verify_rate=50)
    assert not gate.should_verify(7)  # 5..8 rows: one bucket
    assert gate.should_verify(1)  # one row: not measured yet, so it verifies
    gate.record(1, verified=True, tokens=0, seconds=1.0)  # nothing emitted: not a measurement
    gate.record(1, verified=True, tokens=5, seconds=0.0)
    assert gate.should_verify(1)
