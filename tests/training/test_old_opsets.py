"""A model below opset 13 is raised to it by onnx's version converter before a loss or a train
step is built; one the converter cannot raise is refused with an error naming the opsets,
never trained at its old opset."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_loss_output
from onnxgrad.training import OrtGradientForwardBackwardOptimizer, generate_artifacts
from tests.cli.helpers import run_model

W = np.array([0.5, -1.0, 2.0], np.float32)


def scaled_model(opset: int, tile: bool):
    """``y = x * W`` (tiled once along axis 0: Tile-1 has no version converter adapter)."""
    nodes = [helper.make_node("Mul", ["x", "W"], ["xw" if tile else "y"])]
    if tile:
        nodes.append(helper.make_node("Tile", ["xw", "tiles", "axis"], ["y"]))
    init = [
        numpy_helper.from_array(W, "W"),
        numpy_helper.from_array(np.array(1, np.float32), "tiles"),
        numpy_helper.from_array(np.array(0, np.float32), "axis"),
    ]
    graph = helper.make_graph(
        nodes,
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
        init if tile else init[:1],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


def test_an_old_opset_the_converter_raises_gets_the_right_loss():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 4, 3)).astype(np.float32)
    with_loss = add_loss_output(scaled_model(9, tile=False), "squared_error")
    assert {o.version for o in with_loss.opset_import if o.domain in ("", "ai.onnx")} >= {13}
    got = run_model(with_loss, {"x": x, "label": y})["loss"]
    np.testing.assert_allclose(got, np.sum((x.astype(np.float64) * W - y) ** 2), rtol=1e-6)


MESSAGE = r"opset 5, this needs opset >= 13.*Tile.*convert the model to opset 13"


def test_add_loss_output_refuses_an_opset_it_cannot_raise():
    with pytest.raises(ValueError, match=MESSAGE):
        add_loss_output(scaled_model(5, tile=True), "squared_error")


def test_generate_artifacts_refuses_an_opset_it_cannot_raise(tmp_path):
    with pytest.raises(ValueError, match=MESSAGE):
        generate_artifacts(scaled_model(5, tile=True), folder=tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_fit_refuses_an_opset_it_cannot_raise():
    x = np.ones((4, 3), np.float32)
    est = OrtGradientForwardBackwardOptimizer(scaled_model(5, tile=True), max_iter=1)
    with pytest.raises(ValueError, match=MESSAGE):
        est.fit(x, x)
