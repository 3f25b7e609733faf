"""The fast lane (``./scripts/test --fast``) stays model-free: tests/conftest.py refuses a model to unmarked tests."""

from __future__ import annotations

import pytest

from mlxcel.model import loader


def test_a_test_without_the_slow_mark_cannot_load_a_model(tmp_path) -> None:
    with pytest.raises(RuntimeError, match=r"test_fast_lane\.py::.* loads a model .*mark it .*@pytest\.mark\.slow"):
        loader.load_model(tmp_path)


@pytest.mark.slow
def test_a_slow_test_loads_models_as_usual(tmp_path) -> None:
    # The real loader: an empty folder is a ModelLoadError, not the guard's RuntimeError.
    with pytest.raises(loader.ModelLoadError):
        loader.load_model(tmp_path)
