"""``onnxgrad add-loss`` and ``onnxgrad derivative``: the written graphs, run by onnxruntime,
against numpy's closed forms."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.cli.helpers import run_in_process, run_model, run_onnxgrad, save
from tests.models import linear_regression_model, seed004_function, seed004_model

COEF = np.array([1.5, -2.0], dtype=np.float32)
BIAS = np.array([0.25], dtype=np.float32)


@pytest.fixture
def workdir(tmp_path):
    save(seed004_model(), tmp_path / "seed004.onnx")
    save(linear_regression_model(COEF, BIAS), tmp_path / "lr.onnx")
    return tmp_path


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((7, 2)).astype(np.float32)
    y = rng.standard_normal((7, 1)).astype(np.float32)
    return X, y


def test_add_loss_with_penalties(workdir, data):
    X, y = data
    before = (workdir / "seed004.onnx").read_bytes()
    result = run_onnxgrad(
        "add-loss", "seed004.onnx", "-o", "loss.onnx",
        "--penalty", "init=l1:0.1,l2:0.2", "--penalty", "init_b10=0.3", "--reduction", "sum",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (workdir / "seed004.onnx").read_bytes() == before
    model = onnx.load(workdir / "loss.onnx")
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version <= 10
    assert [o.name for o in model.graph.output] == ["loss", "y"]
    outputs = run_model(model, {"x": X, "label": y})
    init = np.array([0.5, -0.33333])
    expected = np.sum((seed004_function(X.astype(np.float64)) - y) ** 2)
    expected += 0.1 * np.abs(init).sum() + 0.2 * (init**2).sum() + 0.3 * 1.0
    np.testing.assert_allclose(outputs["loss"], expected, rtol=1e-5)


def test_add_loss_absolute_error_with_sample_weight(workdir, data):
    X, y = data
    result = run_in_process(
        "add-loss", "lr.onnx", "-o", "l1.onnx", "--score", "l1", "--weight", "w",
        "--label", "target", "--loss-name", "error", "--reduction", "sum",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    model = onnx.load(workdir / "l1.onnx")
    assert [i.name for i in model.graph.input] == ["X", "target", "w"]
    w = np.linspace(0.5, 2.0, len(X)).astype(np.float32)
    outputs = run_model(model, {"X": X, "target": y, "w": w})
    residual = X.astype(np.float64) @ COEF[:, None] + BIAS - y
    np.testing.assert_allclose(outputs["error"], np.sum(w * np.abs(residual[:, 0])), rtol=1e-5)


@pytest.mark.parametrize("backend", ["onnx", "ort"])
def test_derivative_fill_grad_matches_closed_form(workdir, data, backend):
    X, _ = data
    run = run_onnxgrad if backend == "onnx" else run_in_process
    result = run(
        "derivative", "lr.onnx", "-o", "grad.onnx", "--fill-grad", "--keep-outputs",
        "--backend", backend,
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    gradient = onnx.load(workdir / "grad.onnx")
    onnx.checker.check_model(gradient, full_check=True)
    if backend == "onnx":
        assert {n.domain for n in gradient.graph.node} <= {"", "ai.onnx"}
    outputs = run_model(gradient, {"X": X, "coefs": COEF[:, None], "intercept": BIAS})
    # d sum(Y) / dX = 1 coefs^T, / dcoefs = X^T 1, / dintercept = N
    np.testing.assert_allclose(outputs["X_grad"], np.tile(COEF, (len(X), 1)), rtol=1e-6)
    np.testing.assert_allclose(outputs["coefs_grad"], X.sum(axis=0)[:, None], rtol=1e-5)
    np.testing.assert_allclose(outputs["intercept_grad"], [len(X)], rtol=1e-6)
    np.testing.assert_allclose(outputs["Y"], X @ COEF[:, None] + BIAS, rtol=1e-5)


def test_derivative_of_a_loss_with_respect_to_chosen_weights(workdir, data):
    X, y = data
    added = run_in_process("add-loss", "lr.onnx", "-o", "loss.onnx", "--score", "mse", cwd=workdir)
    assert added.returncode == 0, added.stderr
    result = run_in_process(
        "derivative", "loss.onnx", "-o", "grad.onnx", "--loss", "loss", "--label", "label",
        "--weights", "coefs", "--inputs",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    gradient = onnx.load(workdir / "grad.onnx")
    outputs = run_model(gradient, {"X": X, "label": y, "coefs": COEF[:, None]})
    assert set(outputs) == {"coefs_grad", "loss"}
    residual = X.astype(np.float64) @ COEF[:, None] + BIAS - y
    # the default reduction is the sum over the batch
    np.testing.assert_allclose(outputs["coefs_grad"], 2 * X.T @ residual, rtol=1e-4)
    np.testing.assert_allclose(outputs["loss"], np.sum(residual**2), rtol=1e-5)


def test_derivative_with_output_gradient_inputs(workdir, data):
    X, _ = data
    result = run_in_process(
        "derivative", "lr.onnx", "-o", "grad.onnx", "--inputs", "X", "--weights", cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    gradient = onnx.load(workdir / "grad.onnx")
    g = np.arange(len(X), dtype=np.float32)[:, None]
    outputs = run_model(gradient, {"X": X, "Y_grad": g})
    assert list(outputs) == ["X_grad"]
    np.testing.assert_allclose(outputs["X_grad"], g @ COEF[None, :], rtol=1e-6)
