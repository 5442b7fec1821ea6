"""Shared fixtures: small models built here and real converter output.

Tests that need onnxruntime-training's gradient builder (``backend="ort"``) carry the
``ort_training`` marker: they skip, with the reason, in an environment whose onnxruntime is
an inference-only flavour (the current ``onnxruntime`` on Python 3.12+, for one).
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
        if "ort_training" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
