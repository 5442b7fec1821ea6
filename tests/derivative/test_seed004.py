"""Seed 004 ("Gradient : retropropagation"): the notebook's gradient graphs and table.

z = -1 - 2x + 3y + x^2/2 - y^2/3 (:func:`tests.models.seed004_model`), a square loss
added with ``add_loss_output``, differentiated with ``FillGrad | KeepOutputs``.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxgrad.derivative import DerivativeOptions, onnx_derivative
from onnxgrad.graph import add_loss_output, select_model_inputs_outputs
from tests.derivative.fd import onnx_numerical_vjp, run_onnxruntime
from tests.models import seed004_function, seed004_model

X = np.array([[0, 0], [1, 0], [0, 1], [1, 1], [2, 2]], dtype=np.float32)
WEIGHTS = {
    "init": np.array([[2, 3]], dtype=np.float32),
    "init_1": np.array([[0.5, 0.33333]], dtype=np.float32),
    "init_b10": np.array([1], dtype=np.float32),
}
#: The table printed by the notebook (onnxruntime-training, float32).
NOTEBOOK = {
    "init_1_grad": np.array([[109.333244, 102.666565]], dtype=np.float32),
    "init_b10_grad": np.array([76.6666], dtype=np.float32),
    "init_grad": np.array([[193.33316, 186.66649]], dtype=np.float32),
    "label_grad": np.array(
        [[-4.0], [-12.0], [-5.33332], [-13.333321], [-41.99996]], dtype=np.float32
    ),
    "loss": np.array([[532.5546]], dtype=np.float32),
    "x_grad": np.array(
        [
            [2.0, 1.33332],
            [54.0, 3.99996],
            [2.66666, 33.777676],
            [59.999943, 84.44432],
            [356.99966, 517.9994],
        ],
        dtype=np.float32,
    ),
}


def _io(model: onnx.ModelProto) -> tuple[list, list]:
    def describe(infos):
        return [
            (i.name, [d.dim_value or None for d in i.type.tensor_type.shape.dim]) for i in infos
        ]

    return describe(model.graph.input), describe(model.graph.output)


@pytest.fixture(scope="module")
def loss_only() -> onnx.ModelProto:
    return select_model_inputs_outputs(
        add_loss_output(seed004_model(), reduction="sum"), outputs=["loss"]
    )


@pytest.fixture(scope="module")
def feeds() -> dict[str, np.ndarray]:
    label = seed004_function(X).astype(np.float32)
    return {"x": X, "label": label, **WEIGHTS}


@pytest.mark.ort_training
def test_first_derivative_interface():
    grad = onnx_derivative(seed004_model(), backend="ort")
    inputs, outputs = _io(grad)
    assert inputs == [
        ("x", [None, 2]),
        ("init", [1, 2]),
        ("init_1", [1, 2]),
        ("init_b10", [1]),
        ("y_grad", [None, 1]),
    ]
    assert outputs == [
        ("x_grad", [None, 2]),
        ("init_grad", [1, 2]),
        ("init_1_grad", [1, 2]),
        ("init_b10_grad", [1]),
    ]
    assert {i.name for i in grad.graph.initializer} <= {"init_2", "init_3", "init_5", "splits"}


@pytest.mark.ort_training
def test_first_derivative_values_match_finite_differences():
    grad = onnx_derivative(seed004_model(), backend="ort")
    rng = np.random.default_rng(4)
    y_grad = rng.standard_normal((5, 1)).astype(np.float32)
    got = run_onnxruntime(grad, {"x": X, "y_grad": y_grad, **WEIGHTS})
    expected = onnx_numerical_vjp(
        seed004_model(), {"x": X, **WEIGHTS}, ["x", *WEIGHTS], seeds=[y_grad]
    )
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-4, atol=1e-4)


@pytest.mark.ort_training
def test_loss_gradient_interface(loss_only):
    grad = onnx_derivative(
        loss_only,
        options=DerivativeOptions.FillGrad | DerivativeOptions.KeepOutputs,
        backend="ort",
    )
    inputs, outputs = _io(grad)
    assert [name for name, _ in inputs] == ["x", "label", "init", "init_1", "init_b10"]
    assert [name for name, _ in outputs] == [
        "x_grad",
        "label_grad",
        "init_grad",
        "init_1_grad",
        "init_b10_grad",
        "loss",
    ]


@pytest.mark.ort_training
def test_loss_gradient_reproduces_the_notebook_table(loss_only, feeds):
    grad = onnx_derivative(
        loss_only,
        options=DerivativeOptions.FillGrad | DerivativeOptions.KeepOutputs,
        backend="ort",
    )
    _assert_notebook_table(grad, feeds)


def _assert_notebook_table(grad: onnx.ModelProto, feeds: dict) -> None:
    got = run_onnxruntime(grad, feeds)
    for name, expected in NOTEBOOK.items():
        np.testing.assert_allclose(
            got[name].reshape(expected.shape), expected, rtol=1e-5, err_msg=name
        )


@pytest.mark.ort_training
def test_loss_gradient_matches_finite_differences(loss_only, feeds):
    grad = onnx_derivative(loss_only, options=DerivativeOptions.Loss, label="label", backend="ort")
    got = run_onnxruntime(grad, feeds)
    expected = onnx_numerical_vjp(loss_only, feeds, ["x", *WEIGHTS])
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-4, err_msg=name)
    assert "label_grad" not in got


@pytest.mark.ort_training
def test_native_backend_reproduces_the_notebook_table(loss_only, feeds):
    grad = onnx_derivative(
        loss_only, options=DerivativeOptions.FillGrad | DerivativeOptions.KeepOutputs
    )
    assert _io(grad) == _io(
        onnx_derivative(
            loss_only,
            options=DerivativeOptions.FillGrad | DerivativeOptions.KeepOutputs,
            backend="ort",
        )
    )
    _assert_notebook_table(grad, feeds)
