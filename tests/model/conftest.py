"""Model-test fixtures: cached random-weight model folders, loaded once.

The suite-wide tests/conftest.py sets HF_HUB_OFFLINE and binds MLX to
OpenBLAS before MLX is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mlxcel.fixtures import FAMILIES, fixture_path
from mlxcel.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def fixture_folder() -> Callable[[str], Path]:
    """``fixture_folder(family)``: the cached folder of a fixture family."""
    return fixture_path


@pytest.fixture(scope="session")
def loaded_model() -> Callable[[str], LoadedModel]:
    """``loaded_model(family)``: each family loaded once per session."""
    loaded: dict[str, LoadedModel] = {}

    def get(family: str) -> LoadedModel:
        if family not in loaded:
            loaded[family] = load_model(fixture_path(family))
        return loaded[family]

    return get


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param
