"""Integer expressions of constants folded: same outputs on onnxruntime, Constant nodes
where the expression was, float expressions and large results left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.normalize.folding import MAX_ELEMENTS, folded_integer_constants

FLOAT = TensorProto.FLOAT


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _torch_pad_model():
    """``F.pad(x, (2, 3), mode='reflect')`` as PyTorch exports it: the pads list is
    completed with zeros, reversed pairwise and cast at run time."""
    nodes = [
        helper.make_node("Constant", [], ["pairs"], value=_ints("", [2, 3])),
        helper.make_node("Shape", ["pairs"], ["n"]),
        helper.make_node("Sub", ["four", "n"], ["missing"]),
        helper.make_node("ConstantOfShape", ["missing"], ["zeros"], value=_ints("", [0])),
        helper.make_node("Concat", ["pairs", "zeros"], ["listed"], axis=0),
        helper.make_node("Reshape", ["listed", "two_columns"], ["table"]),
        helper.make_node("Slice", ["table", "minus_one", "far", "zero", "minus_one"], ["reversed"]),
        helper.make_node("Transpose", ["reversed"], ["by_side"], perm=[1, 0]),
        helper.make_node("Reshape", ["by_side", "flat"], ["pads64"]),
        helper.make_node("Cast", ["pads64"], ["pads"], to=TensorProto.INT64),
        helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect"),
        helper.make_node("Mul", ["y", "scale"], ["z"]),
    ]
    initializers = [
        _ints("four", [4]),
        _ints("two_columns", [-1, 2]),
        _ints("minus_one", [-1]),
        _ints("far", [-(2**62)]),
        _ints("zero", [0]),
        _ints("flat", [-1]),
        numpy_helper.from_array(np.array(2.0, np.float32), "scale"),
    ]
    graph = helper.make_graph(
        nodes,
        "torch_pad",
        [helper.make_tensor_value_info("x", FLOAT, [1, 6])],
        [helper.make_tensor_value_info("z", FLOAT, [1, 11])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_torch_pads_become_a_constant_with_the_same_outputs():
    model = _torch_pad_model()
    x = np.arange(6, dtype=np.float32).reshape(1, 6)
    expected = _run(model, x)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    folded = folded_integer_constants(copy)
    onnx.checker.check_model(folded, full_check=True)
    np.testing.assert_array_equal(_run(folded, x), expected)
    producers = {n.output[0]: n for n in folded.graph.node}
    assert producers["pads"].op_type == "Constant"
    pads = numpy_helper.to_array(producers["pads"].attribute[0].t)
    np.testing.assert_array_equal(pads, [0, 2, 0, 3])
    assert [n.op_type for n in folded.graph.node if n.op_type != "Constant"] == ["Pad", "Mul"]


def test_float_expressions_and_large_results_stay_nodes():
    nodes = [
        helper.make_node("Mul", ["w", "w"], ["w2"]),
        helper.make_node("ConstantOfShape", ["big"], ["ones"], value=_ints("", [1])),
        helper.make_node("Cast", ["ones"], ["ones_float"], to=FLOAT),
        helper.make_node("Add", ["x", "w2"], ["xw"]),
        helper.make_node("ReduceSum", ["ones_float", "all"], ["count"], keepdims=0),
        helper.make_node("Add", ["xw", "count"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", FLOAT, [3])],
        [helper.make_tensor_value_info("y", FLOAT, [3])],
        [
            numpy_helper.from_array(np.ones(3, np.float32), "w"),
            _ints("big", [MAX_ELEMENTS + 1]),
            _ints("all", [0]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    before = model.SerializeToString()
    assert folded_integer_constants(model).SerializeToString() == before
