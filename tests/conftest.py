"""Shared fixtures: small models built here and real converter output.

Tests that need onnxruntime-training's gradient builder (``backend="ort"``) carry the
``ort_training`` marker: they skip, with the reason, in an environment whose onnxruntime is
an inference-only flavour (the current ``onnxruntime`` on Python 3.12+, for one), as do the
``"ort"`` cases of tests parametrized over ``backend``.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad._runtime import flavour_description, has_training_builder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_training_builder():
        return
    skip = pytest.mark.skip(
        reason=f"backend='ort' needs onnxruntime-training; this environment has "
        f"{flavour_description()}"
    )
    for item in items:
        if "ort_training" in item.keywords or _parametrized_with_ort_backend(item):
            item.add_marker(skip)


def _parametrized_with_ort_backend(item: pytest.Item) -> bool:
    """A test parametrized over ``backend``, in its ``"ort"`` case."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("backend") == "ort"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
