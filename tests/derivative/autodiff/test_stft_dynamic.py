"""STFT's gradient with the signal's batch and length known at run time only: one gradient
graph serves signals of several lengths, each equal to float64 central differences."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from tests.derivative.autodiff.gradcheck import finite_differences


def _dynamic_stft(frame: int, step: int) -> onnx.ModelProto:
    node = helper.make_node("STFT", ["signal", "step", "window"], ["y"], onesided=1)
    graph = helper.make_graph(
        [node],
        "stft",
        [
            helper.make_tensor_value_info("signal", TensorProto.DOUBLE, ["batch", "n", 1]),
            helper.make_tensor_value_info("window", TensorProto.DOUBLE, [frame]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["batch", "frames", frame // 2 + 1, 2])],
        [numpy_helper.from_array(np.array(step, np.int64), "step")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_one_gradient_graph_for_every_length():
    model = _dynamic_stft(frame=6, step=4)
    gradient = onnx_derivative(model, weights=[], inputs=["signal", "window"])
    session = ReferenceEvaluator(gradient)
    rng = np.random.default_rng(3)
    window = rng.uniform(0.5, 1.0, 6)
    for batch, length in [(1, 15), (2, 18)]:
        feeds = {"signal": rng.standard_normal((batch, length, 1)), "window": window}
        (y,) = ReferenceEvaluator(model).run(None, feeds)
        seed = rng.standard_normal(y.shape)
        got = dict(zip([o.name for o in gradient.graph.output],
                       session.run(None, {**feeds, "y_grad": seed})))  # fmt: skip
        for name in feeds:
            expected = finite_differences(model, feeds, name, [seed], 1e-6)
            np.testing.assert_allclose(got[f"{name}_grad"], expected, rtol=1e-6, atol=1e-8)
