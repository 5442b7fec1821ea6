"""onnx_simple_text_plot: the indented text view of seed 004, with real shapes."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.graph import add_loss_output, onnx_simple_text_plot
from tests.graph.sklearn_models import logistic_regression
from tests.models import seed004_model

#: The node lines seed 004 prints for this graph (mlprodict's view).
SEED004_NODES = """\
Mul(x, x) -> out_mul_0
  Mul(out_mul_0, init) -> out_mul_0_1
Mul(x, init_1) -> out_mul_0_2
  Add(out_mul_0_2, out_mul_0_1) -> out_add_0
    Slice(out_add_0, init_2, init_3, init_2) -> out_sli_0
      Squeeze(out_sli_0, init_2) -> out_squ_0
    Slice(out_add_0, init_5, init_2, init_2) -> out_sli_0_1
      Squeeze(out_sli_0_1, init_2) -> out_squ_0_1
        Add(out_squ_0_1, out_squ_0) -> out_add_0_1
          Add(out_add_0_1, init_b10) -> out_add_0_2
            Reshape(out_add_0_2, init_b11) -> y"""


def test_seed004_layout():
    model = seed004_model()
    before = model.SerializeToString()
    text = onnx_simple_text_plot(model)
    assert model.SerializeToString() == before
    lines = text.splitlines()
    assert lines[0] == "opset: domain='' version=14"
    assert lines[1] == "input: name='x' type=dtype('float32') shape=(None, 2)"
    assert lines[2] == (
        "init: name='init' type=dtype('float32') shape=(1, 2) -- "
        f"{np.array([0.5, -0.33333], dtype=np.float32)!r}"
    )
    assert lines[8] == (
        f"init: name='init_b11' type=dtype('int64') shape=(2,) -- {np.array([-1, 1])!r}"
    )
    assert "\n".join(lines[9:20]) == SEED004_NODES
    assert lines[20] == "output: name='y' type=dtype('float32') shape=(None, 1)"
    assert len(lines) == 21


def test_loss_nodes_hang_below_the_prediction():
    text = onnx_simple_text_plot(add_loss_output(seed004_model()))
    lines = text.splitlines()
    reshape = next(k for k, line in enumerate(lines) if "Reshape(out_add_0_2" in line)
    sub = next(k for k, line in enumerate(lines) if line.strip().startswith("Sub(y, label)"))
    indent = len(lines[reshape]) - len(lines[reshape].lstrip())
    assert len(lines[sub]) - len(lines[sub].lstrip()) == indent + 2
    assert "input: name='label' type=dtype('float32') shape=(None, 1)" in lines
    assert "output: name='loss' type=dtype('float32') shape=()" in lines


def test_attributes_domains_symbolic_dims_and_long_values():
    conv = logistic_regression()
    text = onnx_simple_text_plot(conv.onnx)
    assert "ArgMax(raw_scores, axis=1) -> label1" in text
    assert "ai.onnx.ml.ArrayFeatureExtractor(classes, label1)" in text
    assert "opset: domain='ai.onnx.ml' version=1" in text

    values = np.arange(20, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "long",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 20])],
        [numpy_helper.from_array(values, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    lines = onnx_simple_text_plot(model).splitlines()
    assert lines[1] == "input: name='x' type=dtype('float32') shape=('batch', 20)"
    assert lines[2] == (
        f"init: name='w' type=dtype('float32') shape=(20,) -- {values[:8]!r} ... (20 values)"
    )


def test_subgraphs_are_indented_below_their_node():
    f = TensorProto.FLOAT
    branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["n"])],
        "b",
        [],
        [helper.make_tensor_value_info("n", f, [2])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["i"])],
        "o",
        [],
        [helper.make_tensor_value_info("i", f, [2])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)],
        "if",
        [
            helper.make_tensor_value_info("x", f, [2]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", f, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    lines = onnx_simple_text_plot(model).splitlines()
    start = lines.index("If(c) -> y")
    assert lines[start + 1 : start + 4] == [
        "  else_branch:",
        "    Identity(x) -> i",
        "    output: name='i' type=dtype('float32') shape=(2,)",
    ]
    assert lines[start + 4 : start + 7] == [
        "  then_branch:",
        "    Neg(x) -> n",
        "    output: name='n' type=dtype('float32') shape=(2,)",
    ]
