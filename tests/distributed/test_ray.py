"""examples/ray_train.py: 2 Ray workers equal one process with the global batch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.distributed.cases import BATCH, RANKS, mlp_regression

pytest.importorskip(
    "ray", reason="Ray is not installed (a 79 MB wheel, not a dependency of onnxgrad)"
)
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_train.py"


def test_ray_workers_equal_one_process_with_the_global_batch(tmp_path):
    spec = importlib.util.spec_from_file_location("ray_train", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, X, y = mlp_regression()
    onnx.save(model, tmp_path / "mlp.onnx")
    np.savez(tmp_path / "data.npz", X=X, y=y)
    example.train(
        str(tmp_path / "mlp.onnx"),
        str(tmp_path / "data.npz"),
        str(tmp_path / "trained.onnx"),
        workers=RANKS,
        epochs=2,
        batch_size=BATCH,
        seed=4,
    )
    from onnxgrad import OrtGradientForwardBackwardOptimizer

    single = OrtGradientForwardBackwardOptimizer(
        model, max_iter=2, batch_size=BATCH * RANKS, learning_rate=0.01, random_state=4
    ).fit(X, y)
    trained = onnx.load(tmp_path / "trained.onnx")
    for init in trained.graph.initializer:
        expected = single.get_state().get(init.name)
        if expected is not None:
            np.testing.assert_allclose(
                onnx.numpy_helper.to_array(init), expected, rtol=1e-5, atol=1e-7
            )
    assert sys.modules.get("ray") is not None
