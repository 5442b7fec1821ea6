"""onnx's checker and strict inference run piece by piece raise where they raise on the
whole graph, and pass where they pass: each case is judged by onnx on the whole model first."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad._onnx_utils as utils
from onnxgrad._strict_inference import check_in_pieces

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, initializers=(), value_info=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers), list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _chain(count: int, first: str = "x") -> tuple[list, str]:
    """``count`` Relu nodes after ``first``: they put what follows into a later piece."""
    nodes, value = [], first
    for i in range(count):
        nodes.append(helper.make_node("Relu", [value], [f"{first}{i}"], name=f"relu_{first}{i}"))
        value = f"{first}{i}"
    return nodes, value


def _valid():
    """Reads across pieces: a Constant shape, a graph input, an initializer, an If whose
    branches read an earlier value, a declared output."""
    relus, last = _chain(5)
    shape = helper.make_node(
        "Constant", [], ["shape"], value=numpy_helper.from_array(np.array([3, 2], np.int64))
    )
    branch = helper.make_graph(
        [helper.make_node("Neg", [last], ["b"])],
        "br",
        [],
        [helper.make_tensor_value_info("b", F, [2, 3])],
    )
    nodes = [
        shape,
        *relus,
        helper.make_node("Reshape", [last, "shape"], ["r"], name="reshape"),
        helper.make_node("Add", ["r", "w"], ["s"], name="add"),
        helper.make_node("If", ["c"], ["i"], name="if", then_branch=branch, else_branch=branch),
        helper.make_node("Mul", ["i", "x"], ["out"], name="mul"),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("x", F, [2, 3]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("out", F, [2, 3]),
            helper.make_tensor_value_info("s", F, [3, 2]),
        ],
        [numpy_helper.from_array(np.ones((3, 2), np.float32), "w")],
    )


def _bad_reshape(model):
    # a Constant of an early piece sizes a Reshape of a later one: 6 elements into 4x2
    model.graph.node[0].attribute[0].t.CopyFrom(numpy_helper.from_array(np.array([4, 2], np.int64)))


def _bad_types(model):
    # an early float value added to an int64 value in a later piece
    model.graph.node.insert(1, helper.make_node("Cast", ["x"], ["xi"], name="cast_x", to=I64))
    model.graph.node.append(helper.make_node("Add", ["x0", "xi"], ["bad"], name="bad_add"))


def _bad_output(model):
    # a declared output of a later piece whose declared type is not what the graph computes
    model.graph.output[1].type.tensor_type.elem_type = I64


def _bad_value_info(model):
    model.graph.value_info.append(helper.make_tensor_value_info("r", F, [3, 5]))


def _bad_initializer(model):
    # an initializer read by no node, declared as an input of another type
    model.graph.initializer.append(numpy_helper.from_array(np.ones(2, np.float32), "unused"))
    model.graph.input.append(helper.make_tensor_value_info("unused", I64, [2]))


def _bad_branch(model):
    # an If branch reading an early float value as an int64 operand
    then = model.graph.node[-2].attribute[0].g
    then.node.append(helper.make_node("Cast", ["x"], ["cast_in_branch"], to=I64))
    then.node.append(helper.make_node("Add", ["x0", "cast_in_branch"], ["b2"]))
    then.output.append(helper.make_tensor_value_info("b2", F, None))


BREAKAGES = {
    "reshape": _bad_reshape,
    "types": _bad_types,
    "output": _bad_output,
    "value_info": _bad_value_info,
    "initializer": _bad_initializer,
    "branch": _bad_branch,
}


def _pieces(model, piece_nodes):
    shell = utils.weightless_shell(model)
    assert check_in_pieces(shell, model.graph.node, piece_nodes)


@pytest.mark.parametrize("piece_nodes", [1, 2, 3, 100])
def test_a_valid_graph_passes_in_pieces(piece_nodes):
    model = _valid()
    onnx.checker.check_model(model, full_check=True)
    _pieces(model, piece_nodes)


def test_finalize_model_infers_a_big_graph_in_pieces(monkeypatch):
    monkeypatch.setattr(utils, "PIECE_NODES", 2)
    utils.finalize_model(_valid())
    model = _valid()
    _bad_types(model)
    with pytest.raises(onnx.shape_inference.InferenceError, match="bad_add"):
        utils.finalize_model(model)


def _unsorted(model):
    # a node reading a value a later piece computes
    model.graph.node.insert(1, helper.make_node("Neg", ["x3"], ["early"], name="too_early"))


def _written_twice(model):
    model.graph.node.append(helper.make_node("Neg", ["x"], ["x1"], name="again"))


def _bad_attribute(model):
    model.graph.node.append(helper.make_node("Relu", ["x4"], ["r2"], name="relu_attr", alpha=1.0))


def _writes_an_input(model):
    model.graph.node.append(helper.make_node("Relu", ["x4"], ["x"], name="writes_x"))


def _writes_an_initializer(model):
    model.graph.node.append(helper.make_node("Relu", ["x4"], ["w"], name="writes_w"))


def _output_nothing_writes(model):
    model.graph.output.append(helper.make_tensor_value_info("zz", F, [2, 3]))


INFERENCE, CHECKER = onnx.shape_inference.InferenceError, onnx.checker.ValidationError
#: name -> (how the valid graph is broken, what onnx raises on the whole graph)
CASES = {name: (breakage, INFERENCE) for name, breakage in BREAKAGES.items()}
CASES.update(
    unsorted=(_unsorted, CHECKER),
    written_twice=(_written_twice, CHECKER),
    attribute=(_bad_attribute, CHECKER),
    writes_an_input=(_writes_an_input, CHECKER),
    writes_an_initializer=(_writes_an_initializer, CHECKER),
    output_nothing_writes=(_output_nothing_writes, CHECKER),
)


@pytest.mark.parametrize("piece_nodes", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_graph_fails_in_pieces_as_it_does_whole(case, piece_nodes):
    breakage, error = CASES[case]
    model = _valid()
    breakage(model)
    with pytest.raises(error) as whole:
        onnx.checker.check_model(model, full_check=True)
    with pytest.raises(error) as pieces:
        _pieces(model, piece_nodes)
    assert str(whole.value).split("==>")[0].strip()[:60] in str(pieces.value), (whole, pieces)


def test_a_value_read_across_pieces_without_a_type_leaves_it_to_the_whole_graph():
    model = _valid()
    # a custom-domain node onnx cannot infer: its output has no type
    model.opset_import.append(helper.make_opsetid("custom", 1))
    model.graph.node.insert(2, helper.make_node("Op", ["x"], ["opaque"], domain="custom"))
    model.graph.node.append(helper.make_node("Identity", ["opaque"], ["seen"]))
    shell = utils.weightless_shell(model)
    assert not check_in_pieces(shell, model.graph.node, 2)


@pytest.mark.parametrize("piece_nodes", [1, 2])
def test_a_value_of_unknown_rank_read_across_pieces_passes(piece_nodes):
    # the checker wants a shape on every input; the piece's inference must still read the
    # value as of unknown rank (a Reshape to dims only known at run time)
    relus, last = _chain(3)
    nodes = [
        helper.make_node("Reshape", ["x", "dims"], ["u"], name="reshape"),
        *relus,
        helper.make_node("Neg", ["u"], ["n"], name="neg"),
        helper.make_node("Shape", ["n"], ["s"], name="shape"),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("x", F, [2, 3]),
            helper.make_tensor_value_info("dims", I64, ["k"]),
        ],
        [
            helper.make_tensor_value_info(last, F, [2, 3]),
            helper.make_tensor_value_info("s", I64, ["r"]),
        ],
    )
    onnx.checker.check_model(model, full_check=True)
    _pieces(model, piece_nodes)


def test_an_op_without_a_schema_leaves_the_graph_to_the_whole_check():
    # onnx's inference of a whole graph stops at an op it has no schema for, and so
    # reports nothing after it: a piece without that op must not judge what follows
    relus, last = _chain(3, "a")
    nodes = [
        helper.make_node("Gelu", ["x"], ["y"], name="gelu", domain="com.microsoft"),
        helper.make_node("Relu", ["x"], ["a"], name="relu_a"),
        *relus,
        helper.make_node("Relu", [last], ["z"], name="relu_z"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [
            helper.make_tensor_value_info("y", F, [2, 3]),
            helper.make_tensor_value_info("z", I64, [2, 3]),
        ],
    )
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.checker.check_model(model, full_check=True)  # onnx says nothing
    assert not check_in_pieces(utils.weightless_shell(model), model.graph.node, 2)
