"""STFT's gradient with sizes known at run time only (the signal's batch and length, the
window's length, a ``frame_length`` input): one gradient graph serves several sizes, each
equal to float64 central differences."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from tests.derivative.autodiff.gradcheck import finite_differences

STEP = numpy_helper.from_array(np.array(4, np.int64), "step")


def _model(inputs: list[str], declared: list, onesided: int) -> onnx.ModelProto:
    node = helper.make_node("STFT", ["signal", "step", *inputs], ["y"], onesided=onesided)
    infos = [helper.make_tensor_value_info("signal", TensorProto.DOUBLE, ["batch", "n", 1])]
    infos += [helper.make_tensor_value_info(*d) for d in declared]
    output = helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["b", "f", "k", 2])
    graph = helper.make_graph([node], "stft", infos, [output], [STEP])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


CASES = {
    # a static window: the basis is a constant
    "static-window": (["window"], [("window", TensorProto.DOUBLE, [6])], 1),
    # a window of unknown length, a frame_length fed at run time: the basis from a DFT
    "dynamic-window": (["window"], [("window", TensorProto.DOUBLE, ["L"])], 1),
    "frame-length-input": (["", "frame_length"], [("frame_length", TensorProto.INT64, [])], 0),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_one_gradient_graph_for_every_size(kind):
    model = _model(*CASES[kind])
    wrt = ["signal", "window"] if "window" in CASES[kind][0] else ["signal"]
    gradient = onnx_derivative(model, weights=[], inputs=wrt)
    session = ReferenceEvaluator(gradient)
    rng = np.random.default_rng(3)
    sizes = [(1, 15, 6), (2, 18, 6)] if kind == "static-window" else [(1, 15, 6), (2, 13, 5)]
    for batch, length, frame in sizes:
        feeds = {"signal": rng.standard_normal((batch, length, 1))}
        if "window" in wrt:
            feeds["window"] = rng.uniform(0.5, 1.0, frame)
        else:
            feeds["frame_length"] = np.array(frame, np.int64)
        (y,) = ReferenceEvaluator(model).run(None, feeds)
        seed = rng.standard_normal(y.shape)
        names = [o.name for o in gradient.graph.output]
        got = dict(zip(names, session.run(None, {**feeds, "y_grad": seed})))
        for name in wrt:
            expected = finite_differences(model, feeds, name, [seed], 1e-6)
            np.testing.assert_allclose(got[f"{name}_grad"], expected, rtol=1e-6, atol=1e-8)
