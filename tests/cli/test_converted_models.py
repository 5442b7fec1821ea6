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


def test_info_lists_converter_operators_and_the_files_outputs(tmp_path):
    """The ai.onnx.ml operators under their own heading, each saying what happens to it, not
    among onnxruntime's deployed forms; the outputs as the file has them, then as trained."""
    X, y = _data()
    model = skl2onnx.to_onnx(LogisticRegression().fit(X, y), X[:1], target_opset=15)
    onnx.save(model, tmp_path / "lr.onnx")
    out = run_onnxgrad("info", "lr.onnx", cwd=tmp_path).stdout
    lines = out.splitlines()
    assert "deployed operators" not in out
    assert lines[1] == "  ir_version 8, opsets ai.onnx 15, ai.onnx.ml 1, producer skl2onnx"
    files = lines[lines.index("outputs (2):") + 1 : lines.index("outputs (2):") + 3]
    assert [line.split()[0] for line in files] == ["output_label", "output_probability"]
    assert files[1].split()[1] == "seq(map(int64,"
    trained = lines.index(next(line for line in lines if line.startswith("outputs for training")))
    assert lines[trained + 2].split()[:2] == ["probabilities", "float32"]
    heading = lines.index(next(line for line in lines if line.startswith("converter operators")))
    described = dict(line.strip().split(": ", 1) for line in lines[heading + 1 : heading + 3])
    assert set(described) == {"ai.onnx.ml::LinearClassifier x1", "ai.onnx.ml::ZipMap x1"}
    assert all(text for text in described.values())
    assert "trained model keeps the ZipMap" in described["ai.onnx.ml::ZipMap x1"]


def test_info_names_each_opset_domain_once():
    from onnx import helper

    from onnxgrad.cli import _opsets_text

    model = helper.make_model(
        helper.make_graph([], "g", [], []),
        opset_imports=[helper.make_opsetid("", 15), helper.make_opsetid("ai.onnx", 15)],
    )
    assert _opsets_text(model) == "ai.onnx 15"
    model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 2))
    assert _opsets_text(model) == "ai.onnx 15, ai.onnx.ml 2"


def test_a_tree_ensemble_is_not_differentiable(tmp_path):
    X, y = _data()
    forest = RandomForestRegressor(3, max_depth=2, random_state=0).fit(X, y)
    onnx.save(skl2onnx.to_onnx(forest, X[:1], target_opset=15), tmp_path / "rf.onnx")
    result = run_onnxgrad("derivative", "rf.onnx", "-o", "g.onnx", cwd=tmp_path)
    assert result.returncode != 0
    assert "not differentiable: 'TreeEnsembleRegressor'" in result.stderr
    assert not (tmp_path / "g.onnx").exists()
