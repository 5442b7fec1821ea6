"""The rule table of batched seeds, one entry per rule: a node over a seeded input ``x`` (and
unbatched values ``u``, ``v``), given ``K`` seeds along a leading axis, equals ``K`` runs of the
node (onnxruntime, float64); covered nodes run without a ``Scan``, others in one."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import copy_message
from onnxgrad.derivative.seeds import batch_seeds

K = 3
RNG = np.random.default_rng(7)


def _session(model):
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _case(nodes, x, u=None, v=None, constants=(), opset=18, seeded=("x",), dtype=np.float64):
    """A model of ``nodes`` reading ``x`` (seeded), ``u``, ``v`` and integer ``constants``,
    writing ``y``; and its feeds (of ``dtype``: float32 where onnxruntime has no float64
    kernel)."""
    feeds = {"x": x} | ({"u": u} if u is not None else {}) | ({"v": v} if v is not None else {})
    feeds = {k: a.astype(dtype) for k, a in feeds.items()}
    elem = TensorProto.DOUBLE if dtype == np.float64 else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(k, elem, list(a.shape)) for k, a in feeds.items()]
    graph = helper.make_graph(
        nodes, "case", inputs, [helper.make_tensor_value_info("y", elem, None)],
        [_ints(name, values) for name, values in constants],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    return onnx.shape_inference.infer_shapes(model), feeds, seeded


def _r(*shape):
    return RNG.standard_normal(shape)


node = helper.make_node
CASES = {
    "add_lower_rank_seed": _case([node("Add", ["x", "u"], ["y"])], _r(3), u=_r(2, 3)),
    "mul_higher_rank_seed": _case([node("Mul", ["x", "u"], ["y"])], _r(2, 3), u=_r(3)),
    "where": _case(
        [node("Greater", ["u", "v"], ["c"]), node("Where", ["c", "x", "u"], ["y"])],
        _r(3),
        u=_r(2, 3),
        v=_r(3),
    ),
    "two_seeds_of_two_ranks": _case(
        [node("Tanh", ["x"], ["t"]), node("Mul", ["t", "u"], ["y"])],
        _r(2, 3),
        u=_r(2, 3),
        seeded=("x", "u"),
    ),
    "transpose_default": _case([node("Transpose", ["x"], ["y"])], _r(2, 3, 4)),
    "reshape_zero_and_minus_one": _case(
        [node("Reshape", ["x", "s"], ["y"])], _r(2, 3, 4), constants=[("s", [0, -1])]
    ),
    "reshape_computed_shape": _case(
        [node("Shape", ["u"], ["s"]), node("Reshape", ["x", "s"], ["y"])], _r(6), u=_r(2, 3)
    ),
    "expand_to_more_axes": _case(
        [node("Expand", ["x", "s"], ["y"])], _r(3, 1), constants=[("s", [2, 3, 4])]
    ),
    "tile": _case([node("Tile", ["x", "r"], ["y"])], _r(2, 3), constants=[("r", [2, 1])]),
    "concat_with_unbatched": _case(
        [node("Concat", ["x", "u"], ["y"], axis=-1)], _r(2, 3), u=_r(2, 1)
    ),
    "split": _case([node("Split", ["x"], ["y", "w"], axis=1, num_outputs=2)], _r(2, 4)),
    "slice_default_axes": _case(
        [node("Slice", ["x", "b", "e"], ["y"])],
        _r(4, 5),
        constants=[("b", [1, 0]), ("e", [3, 4])],
    ),
    "gather": _case(
        [node("Gather", ["x", "i"], ["y"], axis=1)], _r(2, 4), constants=[("i", [[3, 0], [1, 1]])]
    ),
    "gather_elements": _case(
        [node("GatherElements", ["x", "i"], ["y"], axis=-1)],
        _r(2, 3),
        constants=[("i", [[2, 0], [1, 1]])],
    ),
    "scatter_elements": _case(
        [node("ScatterElements", ["u", "i", "x"], ["y"], axis=1)],
        _r(2, 2),
        u=_r(2, 3),
        constants=[("i", [[2, 0], [1, 0]])],
    ),
    "softmax_13": _case([node("Softmax", ["x"], ["y"])], _r(2, 3)),
    "softmax_11_coerced": _case([node("Softmax", ["x"], ["y"], axis=1)], _r(2, 3, 2), opset=11),
    "flatten": _case([node("Flatten", ["x"], ["y"], axis=2)], _r(2, 3, 4)),
    "flatten_axis_0": _case([node("Flatten", ["x"], ["y"], axis=0)], _r(2, 3)),
    "reduce_sum_axes": _case(
        [node("ReduceSum", ["x", "a"], ["y"], keepdims=0)], _r(2, 3, 4), constants=[("a", [-1, 0])]
    ),
    "reduce_mean_all": _case([node("ReduceMean", ["x"], ["y"])], _r(2, 3)),
    "reduce_sum_attribute_axes": _case(
        [node("ReduceSum", ["x"], ["y"], axes=[1])], _r(2, 3), opset=12
    ),
    "unsqueeze_squeeze": _case(
        [node("Unsqueeze", ["x", "a"], ["t"]), node("Squeeze", ["t", "b"], ["y"])],
        _r(2, 3),
        constants=[("a", [0, -1]), ("b", [0])],
    ),
    "cumsum": _case([node("CumSum", ["x", "a"], ["y"])], _r(2, 3), constants=[("a", 1)]),
    "pad": _case([node("Pad", ["x", "p"], ["y"])], _r(2, 3), constants=[("p", [0, 1, 1, 2])]),
    "shape_and_size": _case(
        [
            node("Size", ["x"], ["n"]),
            node("Cast", ["n"], ["f"], to=TensorProto.DOUBLE),
            node("Mul", ["x", "f"], ["y"]),
        ],
        _r(2, 3),
    ),
    "matmul_batched_left": _case([node("MatMul", ["x", "u"], ["y"])], _r(2, 4, 3), u=_r(3, 5)),
    "matmul_vector_left": _case([node("MatMul", ["x", "u"], ["y"])], _r(3), u=_r(3, 5)),
    "matmul_batched_right": _case([node("MatMul", ["u", "x"], ["y"])], _r(3, 5), u=_r(2, 4, 3)),
    "matmul_matrix_vector": _case([node("MatMul", ["u", "x"], ["y"])], _r(3), u=_r(4, 3)),
    "matmul_two_seeded": _case(
        [node("MatMul", ["x", "u"], ["y"])], _r(2, 4, 3), u=_r(3, 5), seeded=("x", "u")
    ),
    "gemm_transposed": _case(
        [node("Gemm", ["u", "x", "v"], ["y"], transA=1, transB=1, alpha=0.5, beta=2.0)],
        _r(5, 3),
        u=_r(3, 4),
        v=_r(4, 5),
    ),
    "gemm_bias_seeded": _case(
        [node("Gemm", ["u", "v", "x"], ["y"])], _r(5), u=_r(4, 3), v=_r(3, 5)
    ),
    "gemm_seeded_left_float32": _case(
        [node("Gemm", ["x", "u", "v"], ["y"], transB=1, alpha=0.5, beta=2.0)],
        _r(4, 3),
        u=_r(5, 3),
        v=_r(5),
        dtype=np.float32,
    ),
    "gemm_seeded_left_untransposed_float32": _case(
        [node("Gemm", ["x", "u"], ["y"])], _r(4, 3), u=_r(3, 5), dtype=np.float32
    ),
    "einsum": _case(
        [node("Einsum", ["u", "x"], ["y"], equation="bij,bjk->bik")], _r(2, 3, 4), u=_r(2, 5, 3)
    ),
    "conv": _case(
        [node("Conv", ["x", "u"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])],
        _r(2, 3, 5, 5),
        u=_r(4, 3, 3, 3),
        dtype=np.float32,
    ),
    "conv_transpose": _case(
        [node("ConvTranspose", ["x", "u"], ["y"], strides=[2, 2])],
        _r(1, 3, 4, 4),
        u=_r(3, 2, 3, 3),
        dtype=np.float32,
    ),
    "average_pool": _case(
        [node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2])], _r(2, 3, 4, 4), dtype=np.float32
    ),
    "global_average_pool": _case(
        [node("GlobalAveragePool", ["x"], ["y"])], _r(2, 3, 4, 4), dtype=np.float32
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rule_equals_k_runs(name):
    model, feeds, seeded = CASES[name]
    batched = batch_seeds(copy_message(model), list(seeded), ["y"], K)
    assert "Scan" not in {n.op_type for n in batched.graph.node}, "the rule applies"
    _assert_k_runs(model, batched, feeds, seeded)


@pytest.mark.parametrize("name", ["gemm_seeded_left_float32", "gemm_transposed"])
def test_a_float32_gemm_on_seeds_is_a_matmul(name):
    """A float32 ``Gemm`` whose first operand carries the seeds is a ``MatMul`` by the
    (transposed) weight, which onnxruntime runs faster than an ``Einsum``; float64 keeps the
    ``Einsum`` (a ``Transpose`` before a ``MatMul`` becomes onnxruntime's ``FusedMatMul``,
    which has no float64 kernel)."""
    model, _, seeded = CASES[name]
    ops = {n.op_type for n in batch_seeds(copy_message(model), list(seeded), ["y"], K).graph.node}
    float32 = name.endswith("float32")
    assert ("MatMul" in ops, "Einsum" in ops) == (float32, not float32), sorted(ops)


def _assert_k_runs(model, batched, feeds, seeded):
    stacked = {
        k: np.stack([v + i for i in range(K)]) if k in seeded else v for k, v in feeds.items()
    }
    (got,) = _session(batched).run(["y"], stacked)
    single = _session(model)
    for i in range(K):
        one = {k: v[i] if k in seeded else v for k, v in stacked.items()}
        tight = got.dtype == np.float64
        expected = single.run(["y"], one)[0]
        np.testing.assert_allclose(
            got[i], expected, rtol=1e-12 if tight else 1e-5, atol=1e-12 if tight else 1e-5
        )


def test_a_node_without_a_rule_runs_in_a_scan():
    """``TopK`` (no rule) reads the seeded value: it runs once per seed, the nodes around it
    vectorised."""
    model, feeds, seeded = _case(
        [node("Mul", ["x", "u"], ["m"]), node("TopK", ["m", "k"], ["t", "i"], axis=-1),
         node("Neg", ["t"], ["y"])],
        _r(2, 4), u=_r(4), constants=[("k", [2])],
    )  # fmt: skip
    batched = batch_seeds(copy_message(model), ["x"], ["y"], K)
    assert [n.op_type for n in batched.graph.node].count("Scan") == 1
    _assert_k_runs(model, batched, feeds, seeded)


def test_a_value_of_unknown_rank_read_by_a_seeded_node_is_checked():
    """``r = Reshape(u, s)`` with ``s`` fed at run time has no rank: the ``CastLike`` reading
    it runs in a ``Scan``, and the check of the seeded nodes takes ``r`` as an input of
    unknown rank (onnx's checker wants a shape on every input; inference must not get
    one)."""
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3]),
        helper.make_tensor_value_info("u", TensorProto.DOUBLE, [6]),
        helper.make_tensor_value_info("s", TensorProto.INT64, [None]),
    ]
    graph = helper.make_graph(
        [node("Reshape", ["u", "s"], ["r"]), node("CastLike", ["x", "r"], ["y"])],
        "unranked", inputs, [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    model = onnx.shape_inference.infer_shapes(model)
    feeds = {"x": _r(2, 3), "u": _r(6), "s": np.array([2, 3], dtype=np.int64)}
    batched = batch_seeds(copy_message(model), ["x"], ["y"], K)
    assert [n.op_type for n in batched.graph.node].count("Scan") == 1
    _assert_k_runs(model, batched, feeds, ("x",))


def test_a_result_computed_once_is_repeated_for_every_seed():
    model, feeds, seeded = _case([node("Tanh", ["u"], ["y"])], _r(2), u=_r(2, 3))
    batched = batch_seeds(copy_message(model), ["x"], ["y"], K)
    _assert_k_runs(model, batched, feeds, seeded)


def test_nodes_without_a_rule_next_to_each_other_share_one_scan():
    model, feeds, seeded = _case(
        [
            node("TopK", ["x", "k"], ["t", "i"], axis=-1),
            node("TopK", ["t", "k"], ["w", "j"], axis=-1),
            node("Neg", ["w"], ["n"]),
            node("TopK", ["n", "k"], ["y", "l"], axis=-1),
        ],
        _r(2, 4),
        constants=[("k", [2])],
    )
    batched = batch_seeds(copy_message(model), ["x"], ["y"], K)
    assert [n.op_type for n in batched.graph.node].count("Scan") == 2
    _assert_k_runs(model, batched, feeds, seeded)


def test_a_helper_node_asked_twice_is_made_once():
    """Two ``Pad`` nodes over the same pads: the seed axis prepended to the pads (two
    ``Slice``, one ``Concat``) and its constants are made once, read by both."""
    model, feeds, seeded = _case(
        [node("Pad", ["x", "p"], ["a"]), node("Pad", ["x", "p"], ["b"], mode="edge"),
         node("Add", ["a", "b"], ["y"])],
        _r(2, 3), constants=[("p", [1, 0, 0, 2])],
    )  # fmt: skip
    batched = batch_seeds(copy_message(model), ["x"], ["y"], K)
    ops = [n.op_type for n in batched.graph.node]
    assert (ops.count("Slice"), ops.count("Concat")) == (2, 1), ops
    values = [numpy_helper.to_array(t).tobytes() for t in batched.graph.initializer]
    assert len(values) == len(set(values)), "one initializer per distinct value"
    _assert_k_runs(model, batched, feeds, seeded)


def test_what_a_rule_gave_up_on_is_not_reused():
    """A ``Gemm`` whose batched ``C`` has an unknown rank falls back to a ``Scan`` after its
    rule made the product: a later ``Gemm`` over the same operands makes it again rather
    than read a node that was dropped."""
    from onnxgrad._onnx_utils import NameScope
    from onnxgrad.derivative.seed_axis import SeedAxis

    shapes = {"a": [2, 4], "b": [4, 5], "c": [2, 5]}  # no rank for "unknown"
    given = {"a", "b", "c", "unknown"}
    axis = SeedAxis(K, NameScope(given), shapes, {}, {}, 18)
    axis.batched.update({"a", "c", "unknown"})
    axis.rewrite(node("Gemm", ["a", "b", "unknown"], ["y1"]))
    axis.rewrite(node("Gemm", ["a", "b", "c"], ["y2"]))
    axis.flush()
    defined = given | {t.name for t in axis.initializers}
    for made in axis.nodes:
        assert set(made.input) <= defined, (made.op_type, list(made.input))
        defined.update(made.output)
    assert {"y1", "y2"} <= defined
