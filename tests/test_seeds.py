"""The seed notebooks' code, run with onnxgrad's names, prints the seeds' numbers.

Each test names the seed file of ``shared/seeds`` it replays and the values it printed. Where
a seed draws random data without a seed (its training runs), the test replays the code and
checks what does not depend on the draw: the interfaces, and that the loss falls to the
printed order of magnitude.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxgrad import (
    DerivativeOptions,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
    add_loss_output,
    onnx_derivative,
    select_model_inputs_outputs,
)
from tests.models import linear_regression_model, seed004_model

#: "Stochastic Gradient Descent on simple function" (004_e96780b1c4f40b99.txt)
SEED_004 = "004_e96780b1c4f40b99.txt"

x = np.array([[0, 0], [1, 0], [0, 1], [1, 1], [2, 2]], dtype=np.float32)


def run(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """``OnnxInference(model, runtime='onnxruntime1').run(feeds)`` of the seeds."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def io(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    return [i.name for i in model.graph.input], [o.name for o in model.graph.output]


def test_seed_004_fct():
    """``fct(x)`` printed ``[[-1.], [-2.5], [1.6666701], [0.16667008], [1.6666799]]``."""
    printed = np.array([[-1.0], [-2.5], [1.6666701], [0.16667008], [1.6666799]], np.float32)
    np.testing.assert_allclose(run(seed004_model(), {"x": x})["y"], printed, rtol=1e-6)


def test_seed_004_gradient_interface():
    """``onnx_text_plot_io(onnx_derivative(onx))``: inputs x, init, init_1, init_b10, y_grad;
    outputs x_grad, init_grad, init_1_grad, init_b10_grad."""
    grad = onnx_derivative(seed004_model())
    assert io(grad) == (
        ["x", "init", "init_1", "init_b10", "y_grad"],
        ["x_grad", "init_grad", "init_1_grad", "init_b10_grad"],
    )


def test_seed_004_add_loss_output_sums():
    """``add_loss_output(onx)`` ends in ``ReduceSum(loss_diff_2) -> loss``; outputs loss, y;
    ``select_model_inputs_outputs(onx_loss, outputs=['loss'])`` keeps the loss alone."""
    onx_loss = add_loss_output(seed004_model())
    assert io(onx_loss) == (["x", "label"], ["loss", "y"])
    assert [n.op_type for n in onx_loss.graph.node][-3:] == ["Sub", "Mul", "ReduceSum"]
    onx_loss_only = select_model_inputs_outputs(onx_loss, outputs=["loss"])
    assert io(onx_loss_only) == (["x", "label"], ["loss"])


#: the table the seed printed after ``pprint.pprint(result)``
PRINTED_TABLE = {
    "init_1_grad": [[109.333244, 102.666565]],
    "init_b10_grad": [76.6666],
    "init_grad": [[193.33316, 186.66649]],
    "label_grad": [[-4.0], [-12.0], [-5.33332], [-13.333321], [-41.99996]],
    "loss": [[532.5546]],
    "x_grad": [
        [2.0, 1.33332],
        [54.0, 3.99996],
        [2.66666, 33.777676],
        [59.999943, 84.44432],
        [356.99966, 517.9994],
    ],
}


def test_seed_004_gradient_table():
    """ "Gradient again : loss + retropropagation": the seed's code, onnxgrad's names, the
    native backend; every value of the printed table (float32 printing, rtol 1e-5)."""
    onx = seed004_model()
    onx_loss = add_loss_output(onx)
    onx_loss_only = select_model_inputs_outputs(onx_loss, outputs=["loss"])
    grad_loss = onnx_derivative(
        onx_loss_only, options=DerivativeOptions.FillGrad | DerivativeOptions.KeepOutputs
    )
    assert io(grad_loss) == (
        ["x", "label", "init", "init_1", "init_b10"],
        ["x_grad", "label_grad", "init_grad", "init_1_grad", "init_b10_grad", "loss"],
    )
    y = run(onx, {"x": x})["y"]
    init = np.array([[2, 3]], dtype=np.float32)
    init_1 = np.array([[0.5, 0.33333]], dtype=np.float32)
    init_b10 = np.array([1], dtype=np.float32)
    result = run(
        grad_loss, {"x": x, "label": y, "init": init, "init_1": init_1, "init_b10": init_b10}
    )
    assert sorted(result) == sorted(PRINTED_TABLE)
    for name, printed in PRINTED_TABLE.items():
        printed = np.array(printed, dtype=np.float32)
        np.testing.assert_allclose(
            result[name].reshape(printed.shape), printed, rtol=1e-5, err_msg=name
        )


def seed_004_data():
    """``X = randn(100, 2) / 10``, ``y = fct(X) + randn(100, 1) / 1000`` (seeded here)."""
    rng = np.random.default_rng(0)
    X = (rng.standard_normal((100, 2)) / 10).astype(np.float32)
    noise = (rng.standard_normal((100, 1)) / 1000).astype(np.float32)
    return X, run(seed004_model(), {"x": X})["y"] + noise


def test_seed_004_training_session():
    """ "TrainingSession": ``OrtGradientOptimizer(onx_loss, [...], learning_rate=1e-1,
    batch_size=5, max_iter=100)``; the seed's last losses were 0.0032 to 0.0038 (the sum
    over a batch of 5 rows) and ``init_b10`` ended at -1.0016667."""
    X, y = seed_004_data()
    train_session = OrtGradientOptimizer(
        add_loss_output(seed004_model()),
        ["init", "init_1", "init_b10"],
        learning_rate=1e-1,
        batch_size=5,
        max_iter=100,
        random_state=0,
    )
    train_session.fit(X, y)
    assert max(train_session.train_losses_[-5:]) < 0.01
    assert train_session.trained_coef_["init_b10"] == pytest.approx([-1.0], abs=0.01)


def test_seed_004_forward_backward():
    """ "Fordward backward: TrainingAgent": batch_size=2; the seed's last losses were 3e-4 to
    5e-4 and the trained model predicted y[:5] within 0.04."""
    X, y = seed_004_data()
    onx = seed004_model()
    train_session = OrtGradientForwardBackwardOptimizer(
        onx, ["init", "init_1", "init_b10"], learning_rate=1e-1, batch_size=2, max_iter=100
    )
    train_session.fit(X, y)
    assert max(train_session.train_losses_[-5:]) < 5e-3
    trained_onx = train_session.get_trained_onnx()
    np.testing.assert_allclose(run(trained_onx, {"x": X})["y"][:5], y[:5], atol=0.04)


def test_seed_001_elastic_loss_with_penalty_and_weights():
    """ "Full Training with OrtGradientOptimizer" (001_8e69bf8325385cfa.txt): the snippet's
    add_loss_output call, OrtGradientOptimizer with sample weights, get_state, train_losses_;
    the loss is sum_i w_i (0.1 |d_i| + 0.9 d_i^2) + 0.01 |coef|^2."""
    rng = np.random.default_rng(1)
    X_train = rng.standard_normal((40, 2)).astype(np.float32)
    y_train = (X_train @ np.array([1.5, -0.5]) + 2).astype(np.float32)
    w_train = rng.uniform(1, 2, 40).astype(np.float32)
    onx = linear_regression_model(np.array([1.0, 0.0]), np.array([0.0]))
    for init in onx.graph.initializer:
        init.name = {"coefs": "coef"}.get(init.name, init.name)
    onx.graph.node[0].input[1] = "coef"
    onx_loss = add_loss_output(
        onx,
        weight_name="weight",
        score_name="elastic",
        l1_weight=0.1,
        l2_weight=0.9,
        penalty={"coef": {"l2": 0.01}},
    )
    d = X_train @ np.array([1.0, 0.0]) - y_train
    expected = (w_train * (0.1 * np.abs(d) + 0.9 * d**2)).sum() + 0.01
    feeds = {"X": X_train, "label": y_train[:, None], "weight": w_train}
    assert run(onx_loss, feeds)["loss"] == pytest.approx(expected, rel=1e-5)
    train_session = OrtGradientOptimizer(
        onx_loss, ["intercept", "coef"], learning_rate=1e-3, max_iter=20
    )
    train_session.fit(X_train, y_train, w_train)
    state_tensors = train_session.get_state()
    losses = train_session.train_losses_
    assert set(state_tensors) == {"intercept", "coef"}
    assert len(losses) == 20 and losses[-1] < losses[0] / 2
