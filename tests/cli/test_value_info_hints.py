"""Declared intermediate shapes are hints onnxruntime infers again: a wrong one (as
onnxruntime-genai's model builder writes for its constants) does not make the command refuse
the model, while inconsistent input shapes still do (``test_errors.py``)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.cli.helpers import run_in_process


def _model_with_a_wrong_hint() -> onnx.ModelProto:
    """``Y = X * c``, ``c`` a Constant of shape ``[1]`` declared of rank 0."""
    constant = helper.make_node(
        "Constant", [], ["c"], value=numpy_helper.from_array(np.ones(1, np.float32))
    )
    graph = helper.make_graph(
        [constant, helper.make_node("Mul", ["X", "c"], ["Y"])],
        "hint",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 3])],
        value_info=[helper.make_tensor_value_info("c", TensorProto.FLOAT, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_wrong_intermediate_shape_hint_is_not_fatal(tmp_path):
    model = _model_with_a_wrong_hint()
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp_path / "hint.onnx")
    result = run_in_process("info", "hint.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "X" in result.stdout
