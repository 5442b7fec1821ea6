"""Tangent rules found missing on shipped files (issue 30, a fourth set): ``ScatterElements``
with ``reduction='add'`` and ``ReduceL2`` on sizes known only at run time (a graph network's
message sum and edge lengths, as caustic-nmr's PaiNN export computes them), ``ReduceMax`` and
``ReduceMin`` (a YOLO head's anchor scores). Without them the JVP falls back to transposing
the reverse graph, which needs ranks inference cannot give there. Checked against float64
central differences of a numpy evaluation of the same model."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h

from onnxgrad import onnx_jvp


def _model(opset: int):
    zero = h.make_tensor("zero", T.FLOAT, [1], [0.0])
    if opset >= 18:
        norm = [h.make_node("ReduceL2", ["s", "axis1"], ["n"], keepdims=1)]
    else:
        norm = [h.make_node("ReduceL2", ["s"], ["n"], axes=[1], keepdims=1)]
    constants = [
        h.make_tensor("axis1", T.INT64, [1], [1]),
        h.make_tensor("starts", T.INT64, [2], [0, 0]),
        h.make_tensor("axes01", T.INT64, [2], [0, 1]),
    ]
    nodes = [
        h.make_node("Shape", ["x"], ["shape"]),
        h.make_node("ConstantOfShape", ["shape"], ["zeros"], value=zero),
        h.make_node("Tanh", ["u"], ["messages"]),
        # PyTorch's scatter_add export: the row ids expanded to the messages, which are cut
        # to the indices' shape
        h.make_node("Unsqueeze", ["rows", "axis1"], ["column"]),
        h.make_node("Shape", ["messages"], ["message_shape"]),
        h.make_node("Expand", ["column", "message_shape"], ["idx"]),
        h.make_node("Shape", ["idx"], ["idx_shape"]),
        h.make_node("Slice", ["messages", "starts", "idx_shape", "axes01"], ["cut"]),
        h.make_node("ScatterElements", ["zeros", "idx", "cut"], ["s"], axis=0, reduction="add"),
        *norm,
        h.make_node("Mul", ["s", "n"], ["sn"]),
        h.make_node("Add", ["sn", "x"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "scatter_l2",
        [
            h.make_tensor_value_info("x", T.FLOAT, ["atoms", 3]),
            h.make_tensor_value_info("rows", T.INT64, ["edges"]),
            h.make_tensor_value_info("u", T.FLOAT, ["edges", 3]),
        ],
        [h.make_tensor_value_info("y", T.FLOAT, ["atoms", 3])],
        initializer=constants,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def _numpy(x, rows, u):
    s = np.zeros_like(x)
    np.add.at(s, rows, np.tanh(u))
    return s * np.sqrt(np.sum(s * s, axis=1, keepdims=True)) + x


def test_jvp_through_scatter_add_and_l2_norm_with_dynamic_sizes():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    x[3] = 0  # an atom no edge reaches: its norm is 0
    rows = rng.integers(0, 3, 7).astype(np.int64)
    u = rng.standard_normal((7, 3)).astype(np.float32)
    tx, tu = rng.standard_normal(x.shape), rng.standard_normal(u.shape)
    step = 1e-6
    expected = (
        _numpy(x + step * tx, rows, u + step * tu) - _numpy(x - step * tx, rows, u - step * tu)
    ) / (2 * step)
    for opset in (17, 18):
        jvp = onnx_jvp(_model(opset), inputs=["x", "u"], weights=[])
        session = ort.InferenceSession(jvp.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {"x": x, "rows": rows, "u": u}
        feeds.update({"x_tangent": tx.astype(np.float32), "u_tangent": tu.astype(np.float32)})
        names = [o.name for o in session.get_outputs()]
        got = dict(zip(names, session.run(None, feeds)))["y_tangent"]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _extremum_model(op_type: str, opset: int, keepdims: int):
    if opset >= 18:
        reduce = h.make_node(op_type, ["x", "axes"], ["m"], keepdims=keepdims)
        inits = [h.make_tensor("axes", T.INT64, [1], [1])]
    else:
        reduce = h.make_node(op_type, ["x"], ["m"], axes=[1], keepdims=keepdims)
        inits = []
    graph = h.make_graph(
        [reduce, h.make_node("Mul", ["m", "m"], ["y"])],
        "extremum",
        [h.make_tensor_value_info("x", T.FLOAT, ["n", 5])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        initializer=inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def test_reduce_max_and_min_have_tangents_ties_share_them():
    """``ReduceMax``/``ReduceMin`` propagate tangents themselves (YOLO's end-to-end head
    scores its anchors by a ``ReduceMax`` over classes; isbnx's HVP fell back to the
    transposition and was refused): the tangent at the extremum, the mean of the tied
    ones' tangents (row 1 ties)."""
    from onnxgrad.derivative.tangent_graph import tangent_jvp
    from onnxgrad.normalize import normalized_model

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    x[1, 3] = x[1, 1] = 2.0
    t = rng.standard_normal(x.shape).astype(np.float32)
    for op_type, pick in (("ReduceMax", np.max), ("ReduceMin", np.min)):
        for opset in (17, 18):
            for keepdims in (0, 1):
                model = _extremum_model(op_type, opset, keepdims)
                tangent_jvp(normalized_model(model), None, ["x"])  # no fallback
                jvp = onnx_jvp(model, inputs=["x"], weights=[])
                session = ort.InferenceSession(
                    jvp.SerializeToString(), providers=["CPUExecutionProvider"]
                )
                names = [o.name for o in session.get_outputs()]
                got = dict(zip(names, session.run(None, {"x": x, "x_tangent": t})))["y_tangent"]
                m = pick(x, axis=1)
                hits = x == m[:, None]
                expected = 2 * m * (hits * t).sum(axis=1) / hits.sum(axis=1)
                np.testing.assert_allclose(got.ravel(), expected, rtol=1e-5, atol=1e-6)
