"""Whether a decode step should verify proposals, from the rates measured so far: pure, no MLX.

A verify step feeds every row of the batch ``1 + k`` positions. Where a pass
costs about the same whatever its width (a GPU reading the weights once, or
one row on a CPU) a few accepted tokens pay for it; where it costs about its
width (a batch of rows on a CPU, compute-bound) it can lose: on the 2-core
CPU at 8 rows n-gram speculation ran at 0.54-0.56x of plain decoding. So the
batch measures both kinds of step, per batch size (rounded up to a power of
two), as tokens per second of wall time (``SpeculativeBatch._measure`` in
mlxcel/model/speculation.py times each kind of pass), and verifies
only while that rate beats the plain one. While it does not, one step in
``EXPLORE_EVERY`` still verifies, so a change of workload (a row starts
copying its prompt) is noticed; the loss that costs is bounded by that share.
"""

from __future__ import annotations

import attrs

# Weight of a new measurement in a rate's moving average.
RATE_WEIGHT = 0.25
# While verifying loses, one step in this many verifies anyway (to measure again).
EXPLORE_EVERY = 16
# Measurements of each kind a batch size needs before the rates decide.
WARM_STEPS = 2


@attrs.define
class _Rates:
    plain: float | None = None
    verify: float | None = None
    plain_steps: int = 0
    verify_steps: int = 0
    skipped: int = 0


def _bucket(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


@attrs.define
class SpeculationGate:
    """Tokens per second of plain and verify steps by batch size, and the choice they make."""

    _rates: dict[int, _Rates] = attrs.Factory(dict)

    def record(self, batch_size: int, *, verified: bool, tokens: int, seconds: float) -> None:
        """A step of ``batch_size`` rows emitted ``tokens`` in ``seconds`` (until the next step began)."""
        if seconds <= 0 or tokens <= 0:
            return
        rates = self._rates.setdefault(_bucket(batch_size), _Rates())
        rate = tokens / seconds
        if verified:
            rates.verify = rate if rates.verify is None else (1 - RATE_WEIGHT) * rates.verify + RATE_WEIGHT * rate
            rates.verify_steps += 1
        else:
            rates.plain = rate if rates.plain is None else (1 - RATE_WEIGHT) * rates.plain + RATE_WEIGHT * rate
            rates.plain_steps += 1

    def should_verify(self, batch_size: int) -> bool:
        """Verify this step's proposals? First a few verify steps, then a few plain ones (a batch that always
        has proposals would otherwise never measure plain decoding), then while verifying is the faster."""
        rates = self._rates.setdefault(_bucket(batch_size), _Rates())
        if rates.verify_steps < WARM_STEPS:
            return True
        if rates.plain_steps < WARM_STEPS:
            return False
        plain, verify = rates.plain or 0.0, rates.verify or 0.0  # both measured by now
        if verify >= plain:
            return True
        rates.skipped += 1
        if rates.skipped >= EXPLORE_EVERY:
            rates.skipped = 0
            return True
        return False
