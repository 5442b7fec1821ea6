"""Gradients of scikit-learn models converted by skl2onnx, with ``backend="ort"``.

References: central finite differences of the ONNX model in float64, and torch.autograd
on the same function rebuilt in PyTorch from the estimator's fitted coefficients.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

from onnxgrad.derivative import DerivativeOptions, onnx_derivative
from onnxgrad.graph import add_loss_output
from tests.derivative.fd import initializer_values, onnx_numerical_vjp, run_onnxruntime

skl2onnx = pytest.importorskip("skl2onnx")
from sklearn.exceptions import ConvergenceWarning  # noqa: E402
from sklearn.linear_model import LinearRegression  # noqa: E402
from sklearn.neural_network import MLPClassifier, MLPRegressor  # noqa: E402

pytestmark = pytest.mark.ort_training

OPSET = 17
MLP_WEIGHTS = ["coefficient", "intercepts", "coefficient1", "intercepts1"]
RTOL, ATOL = 1e-4, 1e-4


def _data(classes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    X = rng.standard_normal((30, 3)).astype(np.float32)
    score = X @ np.array([1.0, -2.0, 0.5]) + 0.2 * rng.standard_normal(30)
    if classes is None:
        return X, score
    return X, np.searchsorted(np.quantile(score, np.linspace(0, 1, classes + 1)[1:-1]), score)


def _convert(estimator, X, y, **kwargs) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        estimator.fit(X, y)
    return skl2onnx.to_onnx(estimator, X[:1], target_opset=OPSET, **kwargs)


def _check(got: dict, expected: dict, shapes: dict | None = None) -> None:
    for name, value in expected.items():
        value = np.asarray(value)
        if shapes is not None:
            value = value.reshape(shapes[name])
        np.testing.assert_allclose(
            got[f"{name}_grad"], value, rtol=RTOL, atol=ATOL, err_msg=f"{name}_grad"
        )


def _shapes(model: onnx.ModelProto, names) -> dict[str, tuple[int, ...]]:
    return {name: value.shape for name, value in initializer_values(model, names).items()}


def _agree_with_native(model: onnx.ModelProto, feeds: dict, ort_result: dict, **kwargs) -> None:
    """The native backend returns the same values."""
    native = onnx_derivative(model, backend="onnx", **kwargs)
    got = run_onnxruntime(native, feeds)
    assert list(got) == list(ort_result)
    for name, value in ort_result.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.fixture(scope="module")
def linear() -> tuple[LinearRegression, onnx.ModelProto, np.ndarray]:
    X, y = _data()
    model = LinearRegression()
    return model, _convert(model, X, y, black_op={"LinearRegressor"}), X


def test_linear_regression_standard_ops(linear):
    estimator, model, X = linear
    assert {n.domain for n in model.graph.node} == {""}
    grad = onnx_derivative(model, backend="ort")
    weights = initializer_values(model, ["coef", "intercept"])
    assert [o.name for o in grad.graph.output] == ["X_grad", "coef_grad", "intercept_grad"]
    x = X[:6]
    y_grad = np.random.default_rng(0).standard_normal((6, 1)).astype(np.float32)
    feeds = {"X": x, **weights}
    got = run_onnxruntime(grad, {**feeds, "variable_grad": y_grad})
    _check(got, onnx_numerical_vjp(model, feeds, ["X", "coef", "intercept"], seeds=[y_grad]))
    _agree_with_native(model, {**feeds, "variable_grad": y_grad}, got)

    # d/dX <g, X a + b> = g a^T, d/da = X^T g, d/db = sum g.
    coef = estimator.coef_.reshape((-1, 1))
    expected = {"X": y_grad @ coef.T, "coef": x.T @ y_grad, "intercept": y_grad.sum()}
    _check(got, expected, _shapes(model, ["coef", "intercept"]) | {"X": x.shape})


def _torch_mlp(torch, estimator, x, output_activation: str | None):
    """The estimator's forward pass in PyTorch: parameters and output."""
    activations = {
        "relu": torch.relu,
        "tanh": torch.tanh,
        "logistic": torch.sigmoid,
        "identity": lambda t: t,
    }
    params = []
    for coef, intercept in zip(estimator.coefs_, estimator.intercepts_):
        params += [
            torch.tensor(coef, dtype=torch.float64, requires_grad=True),
            torch.tensor(intercept, dtype=torch.float64, requires_grad=True),
        ]
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    hidden = activations[estimator.activation](xt @ params[0] + params[1])
    out = hidden @ params[2] + params[3]
    if output_activation == "softmax":
        out = torch.softmax(out, dim=1)
    elif output_activation == "logistic":
        p = torch.sigmoid(out)
        out = torch.cat([1 - p, p], dim=1)
    return xt, params, out


@pytest.mark.parametrize("activation", ["relu", "tanh", "logistic"])
def test_mlp_regressor(activation):
    X, y = _data()
    estimator = MLPRegressor(
        hidden_layer_sizes=(5,), activation=activation, max_iter=200, random_state=0
    )
    model = _convert(estimator, X, y)
    assert [i.name for i in model.graph.initializer][:4] == MLP_WEIGHTS
    grad = onnx_derivative(model, weights=MLP_WEIGHTS, backend="ort")
    rng = np.random.default_rng(1)
    x = X[:5]
    y_grad = rng.standard_normal((5, 1)).astype(np.float32)
    weights = initializer_values(model, MLP_WEIGHTS)
    feeds = {"X": x, **weights}
    got = run_onnxruntime(grad, {**feeds, "variable_grad": y_grad})
    _check(got, onnx_numerical_vjp(model, feeds, ["X", *MLP_WEIGHTS], seeds=[y_grad]))
    _agree_with_native(model, {**feeds, "variable_grad": y_grad}, got, weights=MLP_WEIGHTS)


@pytest.mark.torch
@pytest.mark.parametrize("activation", ["relu", "tanh", "logistic"])
def test_mlp_regressor_matches_torch(activation):
    torch = pytest.importorskip("torch")
    X, y = _data()
    estimator = MLPRegressor(
        hidden_layer_sizes=(5,), activation=activation, max_iter=200, random_state=0
    )
    model = _convert(estimator, X, y)
    grad = onnx_derivative(model, weights=MLP_WEIGHTS, backend="ort")
    y_grad = np.random.default_rng(2).standard_normal((7, 1)).astype(np.float32)
    x = X[:7]
    got = run_onnxruntime(
        grad, {"X": x, **initializer_values(model, MLP_WEIGHTS), "variable_grad": y_grad}
    )
    xt, params, out = _torch_mlp(torch, estimator, x, None)
    (out * torch.tensor(y_grad, dtype=torch.float64)).sum().backward()
    expected = {"X": xt.grad} | {n: p.grad for n, p in zip(MLP_WEIGHTS, params)}
    _check(got, expected, _shapes(model, MLP_WEIGHTS) | {"X": x.shape})


@pytest.fixture(scope="module", params=[2, 3], ids=["binary", "multiclass"])
def classifier(request):
    X, y = _data(classes=request.param)
    estimator = MLPClassifier(hidden_layer_sizes=(4,), max_iter=300, random_state=0)
    model = _convert(estimator, X, y, options={"zipmap": False})
    score = "log" if request.param == 2 else "cross_entropy"
    with_loss = add_loss_output(model, score_name=score, output_index="probabilities")
    grad = onnx_derivative(
        with_loss,
        options=DerivativeOptions.Loss,
        label="label",
        weights=MLP_WEIGHTS,
        backend="ort",
    )
    x, labels = X[:8], y[:8].astype(np.int64)
    feeds = {"X": x, "label": labels, **initializer_values(model, MLP_WEIGHTS)}
    return estimator, model, with_loss, grad, feeds


def test_mlp_classifier_log_loss_interface(classifier):
    _, _, _, grad, _ = classifier
    assert [i.name for i in grad.graph.input] == ["X", "label", *MLP_WEIGHTS]
    assert [o.name for o in grad.graph.output] == [
        "X_grad",
        *(f"{w}_grad" for w in MLP_WEIGHTS),
        "loss",
    ]
    assert "ai.onnx.ml" not in {o.domain for o in grad.opset_import}


def test_mlp_classifier_log_loss_matches_finite_differences(classifier):
    _, _, with_loss, grad, feeds = classifier
    got = run_onnxruntime(grad, feeds)
    _check(got, onnx_numerical_vjp(with_loss, feeds, ["X", *MLP_WEIGHTS]))
    _agree_with_native(
        with_loss, feeds, got, options=DerivativeOptions.Loss, label="label", weights=MLP_WEIGHTS
    )


@pytest.mark.torch
def test_mlp_classifier_log_loss_matches_torch(classifier):
    torch = pytest.importorskip("torch")
    estimator, model, _, grad, feeds = classifier
    got = run_onnxruntime(grad, feeds)
    output = "logistic" if len(estimator.classes_) == 2 else "softmax"
    xt, params, probabilities = _torch_mlp(torch, estimator, feeds["X"], output)
    np.testing.assert_allclose(
        run_onnxruntime(model, {"X": feeds["X"]})["probabilities"],
        probabilities.detach().numpy(),
        rtol=1e-5,
        atol=1e-6,
    )
    picked = probabilities[torch.arange(len(feeds["label"])), torch.tensor(feeds["label"])]
    loss = -torch.log(picked).sum()  # the default reduction sums over the batch
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    expected = {"X": xt.grad} | {n: p.grad for n, p in zip(MLP_WEIGHTS, params)}
    _check(got, expected, _shapes(model, MLP_WEIGHTS) | {"X": feeds["X"].shape})
