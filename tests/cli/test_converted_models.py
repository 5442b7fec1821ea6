"""The command on a scikit-learn model converted by skl2onnx with its default options."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.cli.helpers import run_onnxgrad

skl2onnx = pytest.importorskip("skl2onnx")
from sklearn.ensemble import RandomForestRegressor  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402


def _data():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((40, 3)).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64)


def test_info_says_the_model_is_lowered(tmp_path):
    X, y = _data()
    onnx.save(skl2onnx.to_onnx(LogisticRegression().fit(X, y), X[:1]), tmp_path / "lr.onnx")
    result = run_onnxgrad("info", "lr.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "lowered for training (onnxgrad.lower_ml_operators)" in result.stdout
    # a binary model: one coefficient column, the scores [-s, s] (one parameter set)
    assert "LinearClassifier_coefficients  float32 (3, 1)" in result.stdout


def test_a_tree_ensemble_is_not_differentiable(tmp_path):
    X, y = _data()
    forest = RandomForestRegressor(3, max_depth=2, random_state=0).fit(X, y)
    onnx.save(skl2onnx.to_onnx(forest, X[:1], target_opset=15), tmp_path / "rf.onnx")
    result = run_onnxgrad("derivative", "rf.onnx", "-o", "g.onnx", cwd=tmp_path)
    assert result.returncode != 0
    assert "not differentiable: 'TreeEnsembleRegressor'" in result.stderr
    assert not (tmp_path / "g.onnx").exists()
