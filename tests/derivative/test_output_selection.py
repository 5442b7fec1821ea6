"""``onnx_derivative(..., outputs=[...])`` and ``onnxgrad derivative --outputs``: the outputs
to differentiate, checked against float64 finite differences (the others count as constants);
integer outputs never get a ``<output>_grad`` input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from skl2onnx import to_onnx
from sklearn.datasets import make_classification
from sklearn.linear_model import LogisticRegression

from onnxgrad import add_loss_output, onnx_derivative
from onnxgrad.derivative import DerivativeOptions
from tests.cli.helpers import run_in_process
from tests.derivative.fd import onnx_numerical_vjp, run_onnxruntime
from tests.models import seed004_model

BACKENDS = ["onnx", pytest.param("ort", marks=pytest.mark.ort_training)]


def two_outputs() -> onnx.ModelProto:
    """``a = tanh(x W)``, ``b = x * x`` and the int64 ``k = ArgMax(a)``."""
    W = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Tanh", ["xw"], ["a"]),
            helper.make_node("Mul", ["x", "x"], ["b"]),
            helper.make_node("ArgMax", ["a"], ["k"], axis=1),
        ],
        "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, 2]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [None, 1]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [None, 2]),
        ],
        [numpy_helper.from_array(W, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def names(infos) -> list[str]:
    return [i.name for i in infos]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_integer_output_gets_no_gradient_input(backend):
    grad = onnx_derivative(two_outputs(), backend=backend)
    assert names(grad.graph.input) == ["x", "W", "a_grad", "b_grad"]
    kept = onnx_derivative(two_outputs(), options=DerivativeOptions.KeepOutputs, backend=backend)
    assert names(kept.graph.input) == ["x", "W", "a_grad", "b_grad"]
    assert names(kept.graph.output) == ["x_grad", "W_grad", "a", "k", "b"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chosen", [["a"], ["b"], ["b", "a"]])
def test_only_the_chosen_outputs_are_differentiated(rng, backend, chosen):
    model = two_outputs()
    grad = onnx_derivative(
        model, outputs=chosen, options=DerivativeOptions.KeepOutputs, backend=backend
    )
    assert names(grad.graph.input) == ["x", "W", *(f"{o}_grad" for o in ("a", "b") if o in chosen)]
    assert names(grad.graph.output) == ["x_grad", "W_grad", "a", "k", "b"]
    x = rng.standard_normal((3, 2)).astype(np.float32)
    seeds = {f"{o}_grad": rng.standard_normal((3, 2)).astype(np.float32) for o in chosen}
    W = numpy_helper.to_array(model.graph.initializer[0])
    got = run_onnxruntime(grad, {"x": x, "W": W, **seeds})
    expected = onnx_numerical_vjp(
        model,
        {"x": x, "W": W},
        ["x", "W"],
        seeds=[seeds.get(f"{o.name}_grad", np.zeros((3, 2))) for o in model.graph.output],
    )
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fill_grad_seeds_ones_for_the_chosen_output_only(rng, backend):
    model = two_outputs()
    grad = onnx_derivative(
        model, weights=[], outputs=["b"], options=DerivativeOptions.FillGrad, backend=backend
    )
    x = rng.standard_normal((4, 2)).astype(np.float32)
    np.testing.assert_allclose(run_onnxruntime(grad, {"x": x})["x_grad"], 2 * x, rtol=1e-6)


def test_saliency_of_one_class_of_a_converted_classifier():
    """The gradient of ``p_1`` of a skl2onnx LogisticRegression (ZipMap, int64 label output)
    with respect to X equals central differences of scikit-learn's own predict_proba."""
    X, y = make_classification(40, 4, n_informative=3, n_redundant=0, random_state=0)
    clf = LogisticRegression().fit(X, y)
    onx = to_onnx(clf, X[:1].astype(np.float32))
    grad = onnx_derivative(onx, weights=[], outputs=["probabilities"])
    assert names(grad.graph.input) == ["X", "probabilities_grad"]
    seed = np.tile(np.array([[0, 1]], np.float32), (len(X), 1))
    got = run_onnxruntime(grad, {"X": X.astype(np.float32), "probabilities_grad": seed})
    eps = 1e-6
    expected = np.stack(
        [
            (clf.predict_proba(X + eps * e)[:, 1] - clf.predict_proba(X - eps * e)[:, 1])
            / (2 * eps)
            for e in np.eye(X.shape[1])
        ],
        axis=1,
    )
    assert np.abs(expected).max() > 1e-2
    np.testing.assert_allclose(got["X_grad"], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"outputs": ["nope"]}, r"unknown outputs \['nope'\]"),
        ({"outputs": ["k"]}, r"outputs \['k'\] are not float tensors"),
        ({"outputs": []}, "nothing to differentiate"),
        ({"outputs": "a"}, None),
    ],
)
def test_bad_outputs(kwargs, match):
    error = TypeError if match is None else ValueError
    with pytest.raises(error, match=match or "not the string 'a'"):
        onnx_derivative(two_outputs(), **kwargs)


def test_loss_is_the_one_output_differentiated():
    model = add_loss_output(seed004_model())
    with pytest.raises(ValueError, match="the loss 'loss' is the one output differentiated"):
        onnx_derivative(model, outputs=["y"], options=DerivativeOptions.Loss)
    grad = onnx_derivative(model, outputs=["loss"], options=DerivativeOptions.Loss)
    assert names(grad.graph.output)[-1] == "loss"


def test_command_outputs(tmp_path, rng):
    onnx.save(two_outputs(), tmp_path / "m.onnx")
    result = run_in_process(
        "derivative", "m.onnx", "-o", "g.onnx", "--weights", "--outputs", "b", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    grad = onnx.load(tmp_path / "g.onnx")
    assert names(grad.graph.input) == ["x", "b_grad"]
    x, g = rng.standard_normal((2, 3, 2)).astype(np.float32)
    np.testing.assert_allclose(
        run_onnxruntime(grad, {"x": x, "b_grad": g})["x_grad"], 2 * x * g, rtol=1e-6
    )
