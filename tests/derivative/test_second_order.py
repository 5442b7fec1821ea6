"""Native gradient graphs differentiate again: a Hessian-vector product equals finite
differences of the gradient."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative
from tests.models import seed004_model, tanh_mlp_loss_model

WEIGHTS = ["W1", "b1", "W2", "b2"]


def _data(rng):
    return {"X": rng.standard_normal((6, 3)), "label": rng.standard_normal((6, 1))}


def _gradient(grad_model, feeds, weights):
    outputs = ReferenceEvaluator(grad_model).run(None, {**feeds, **weights})
    names = [o.name for o in grad_model.graph.output]
    return dict(zip(names, outputs))


def test_hessian_vector_product_matches_finite_differences():
    rng = np.random.default_rng(3)
    model, weights = tanh_mlp_loss_model()
    grad_model = onnx_derivative(model, weights=WEIGHTS, inputs=[], options=DerivativeOptions.Loss)
    hvp_model = onnx_derivative(grad_model, weights=[], inputs=WEIGHTS)
    assert {n.domain for n in hvp_model.graph.node} == {""}

    data = _data(rng)
    direction = {w: rng.standard_normal(v.shape) for w, v in weights.items()}
    seeds = {f"{w}_grad_grad": direction[w] for w in WEIGHTS}
    seeds["loss_grad"] = np.zeros((), dtype=np.float64)
    feeds = {**data, **weights, **seeds}
    hvp = dict(
        zip(
            [o.name for o in hvp_model.graph.output],
            ReferenceEvaluator(hvp_model).run(None, feeds),
        )
    )

    eps = 1e-5
    plus = {w: v + eps * direction[w] for w, v in weights.items()}
    minus = {w: v - eps * direction[w] for w, v in weights.items()}
    g_plus, g_minus = _gradient(grad_model, data, plus), _gradient(grad_model, data, minus)
    for w in WEIGHTS:
        expected = (g_plus[f"{w}_grad"] - g_minus[f"{w}_grad"]) / (2 * eps)
        np.testing.assert_allclose(hvp[f"{w}_grad"], expected, rtol=1e-6, atol=1e-7)

    session = onnxruntime.InferenceSession(
        hvp_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    for name, value in zip([o.name for o in hvp_model.graph.output], session.run(None, feeds)):
        np.testing.assert_allclose(value, hvp[name], rtol=1e-9, atol=1e-10)


def test_gradient_of_gradient_names_do_not_clash():
    model, _ = tanh_mlp_loss_model()
    grad_model = onnx_derivative(model, weights=WEIGHTS, inputs=[], options=DerivativeOptions.Loss)
    hvp_model = onnx_derivative(grad_model, weights=[], inputs=["W1"])
    assert [o.name for o in hvp_model.graph.output] == ["W1_grad"]
    inputs = [i.name for i in hvp_model.graph.input]
    assert inputs[-5:] == [
        "W1_grad_grad",
        "b1_grad_grad",
        "W2_grad_grad",
        "b2_grad_grad",
        "loss_grad",
    ]


@pytest.mark.parametrize("options", [DerivativeOptions.FillGrad, DerivativeOptions.Zero])
def test_second_derivative_has_unique_node_names_and_loads(options):
    first = onnx_derivative(seed004_model(), weights=[], options=DerivativeOptions.FillGrad)
    second = onnx_derivative(first, weights=[], inputs=["x"], options=options)
    names = [n.name for n in second.graph.node if n.name]
    assert len(names) == len(set(names))
    onnxruntime.InferenceSession(second.SerializeToString(), providers=["CPUExecutionProvider"])
