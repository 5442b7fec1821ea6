"""``onnxgrad.compat.onnxcustom``: onnxcustom's defaults and return forms, opt-in."""

from __future__ import annotations

import pickle

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi._pybind_state import OrtValue as C_OrtValue

import onnxgrad
from onnxgrad.compat import onnxcustom as compat
from onnxgrad.training import LearningRateSGDNesterov
from tests.models import linear_regression_model
from tests.training.test_seed_compat import linear_data

COEF = np.array([[0.5, -1.0, 2.0]], np.float32)


def _model():
    return linear_regression_model(COEF, np.array([0.25], np.float32))


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_add_loss_output_declares_and_returns_a_1x1_loss_equal_to_the_scalar():
    X, y = linear_data(12)
    feeds = {"X": X, "label": y.reshape((-1, 1))}
    matrix = compat.add_loss_output(_model())
    scalar = onnxgrad.add_loss_output(_model())
    dims = [d.dim_value for d in matrix.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 1]
    got, _ = _run(matrix, feeds)
    expected = ((X @ COEF.T + 0.25 - y.reshape((-1, 1))) ** 2).sum()
    assert got.shape == (1, 1)
    np.testing.assert_allclose(got[0, 0], expected, rtol=1e-5)
    np.testing.assert_allclose(got[0, 0], _run(scalar, feeds)[0], rtol=1e-6)


def test_estimators_train_a_1x1_loss_as_the_scalar():
    X, y = linear_data(40)
    options = {"max_iter": 5, "batch_size": 10, "learning_rate": 1e-3, "random_state": 0}
    fits = [
        onnxgrad.OrtGradientOptimizer(add_loss(_model()), ["coefs", "intercept"], **options).fit(
            X, y
        )
        for add_loss in (compat.add_loss_output, onnxgrad.add_loss_output)
    ]
    assert len(fits[0].train_losses_) == 5
    np.testing.assert_allclose(fits[0].train_losses_, fits[1].train_losses_, rtol=1e-6)
    for name, value in fits[1].get_state().items():
        np.testing.assert_allclose(fits[0].get_state()[name], value, rtol=1e-6)


def _two_column_loss() -> onnx.ModelProto:
    """loss = sum((X1 - X2)^2) over [N, 2] inputs."""
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["X1", "X2"], ["d"]),
            helper.make_node("Mul", ["d", "d"], ["e"]),
            helper.make_node("ReduceSum", ["e"], ["loss"], keepdims=0),
        ],
        "two_columns",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, 2]) for n in ("X1", "X2")],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_unreduced_loss_keeps_the_terms_of_the_reduction():
    rng = np.random.default_rng(1)
    x1, x2 = (rng.standard_normal((5, 2)).astype(np.float32) for _ in range(2))
    terms = compat.unreduced_onnx_loss(_two_column_loss())
    (got,) = _run(terms, {"X1": x1, "X2": x2})
    np.testing.assert_allclose(got, (x1 - x2) ** 2, rtol=1e-6)
    (rows,) = _run(onnxgrad.unreduced_onnx_loss(_two_column_loss()), {"X1": x1, "X2": x2})
    np.testing.assert_allclose(rows, ((x1 - x2) ** 2).sum(axis=1, keepdims=True), rtol=1e-6)


def test_unreduced_loss_of_a_function_graph_has_no_reduction_and_sums_to_the_loss():
    model = onnxgrad.function_onnx_graph("grad_loss_square_error")
    rng = np.random.default_rng(2)
    x1, x2 = (rng.standard_normal((6, 1)).astype(np.float32) for _ in range(2))
    terms = compat.unreduced_onnx_loss(model)
    assert "ReduceSum" not in {n.op_type for n in terms.graph.node}
    (got,) = _run(terms, {"X1": x1, "X2": x2})
    assert got.shape == (6, 1)
    np.testing.assert_allclose(got, (x1 - x2) ** 2, rtol=1e-6)


def test_onnx_derivative_refuses_integer_options_and_saves_to_path_name(tmp_path):
    with pytest.raises(TypeError, match="DerivativeOptions"):
        compat.onnx_derivative(_model(), weights=[], options=1)
    path = tmp_path / "grad.onnx"
    grad = compat.onnx_derivative(_model(), path_name=str(path))
    assert onnx.load(path) == grad
    assert grad == onnxgrad.onnx_derivative(_model())


@pytest.mark.ort_training
def test_keep_yield_op_uses_the_training_builder():
    grad = compat.onnx_derivative(_model(), options=compat.DerivativeOptions.KeepYieldOp)
    assert "YieldOp" in {n.op_type for n in grad.graph.node}


def test_nesterov_defaults_to_invscaling_as_scikit_learn_mlp():
    optimizers = pytest.importorskip("sklearn.neural_network._stochastic_optimizers")
    rate = compat.LearningRateSGDNesterov(eta0=0.1, power_t=0.5)
    assert rate.learning_rate == "invscaling"
    assert isinstance(rate, LearningRateSGDNesterov)
    assert LearningRateSGDNesterov().learning_rate == "constant"  # onnxgrad's default kept
    reference = optimizers.SGDOptimizer(
        [np.zeros(1)], learning_rate_init=0.1, lr_schedule="invscaling", power_t=0.5
    )
    rate.init_learning_rate()
    for t in (1, 4, 100):  # samples seen
        rate.update_learning_rate(t)
        reference.iteration_ends(t)
        assert rate.value == pytest.approx(reference.learning_rate, rel=1e-12)


def _estimator(**kwargs):
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    options = {"max_iter": 3, "batch_size": 10, "random_state": 0, **kwargs}
    return compat.OrtGradientForwardBackwardOptimizer(model, ["coefs", "intercept"], **options)


def test_estimator_selects_the_invscaling_nesterov_and_pickles():
    est = _estimator(learning_rate="Nesterov")
    assert type(est.learning_rate) is compat.LearningRateSGDNesterov
    assert est.get_params()["learning_rate"] == "Nesterov"
    assert "learning_rate='invscaling'" in repr(est)
    est.fit(*linear_data())
    assert type(est.learning_rate_) is compat.LearningRateSGDNesterov
    copy = pickle.loads(pickle.dumps(est))
    assert type(copy.learning_rate) is compat.LearningRateSGDNesterov
    base = onnxgrad.OrtGradientForwardBackwardOptimizer(
        est.model_onnx, ["coefs", "intercept"], learning_rate="Nesterov"
    )
    assert base.learning_rate.learning_rate == "constant"


def test_get_state_is_a_list_of_ortvalues_and_set_state_takes_it_back():
    est = _estimator().fit(*linear_data())
    weights = est.get_state_dict()
    state = est.get_state()
    assert isinstance(state, list)
    assert all(isinstance(v, C_OrtValue) for v in state)
    for value, expected in zip(state, weights.values()):
        np.testing.assert_array_equal(value.numpy(), expected)
    changed = [v.numpy() + 1 for v in state]
    est.set_state(changed)
    for value, expected in zip(est.get_state_dict().values(), changed):
        np.testing.assert_array_equal(value, expected)
    est.set_state(state)  # C-level OrtValues as get_state gave them
    for value, expected in zip(est.get_state_dict().values(), weights.values()):
        np.testing.assert_array_equal(value, expected)
    with pytest.raises(ValueError, match="expected 2 tensors"):
        est.set_state(state[:1])


def test_get_state_follows_the_order_of_weights_to_train():
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    est = compat.OrtGradientForwardBackwardOptimizer(
        model, ["intercept", "coefs"], max_iter=2, batch_size=10, random_state=0
    ).fit(*linear_data())
    assert [v.shape() for v in est.get_state()] == [[1], [3, 1]]
