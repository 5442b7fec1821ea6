"""Forward mode by tangent propagation (issue 33): the common operators take the direct pass
(their values are checked against finite differences by test_forward_rules.py), loose
tangents of broadcast inputs are expanded where the shape matters, weights are tangents
too, and a model the pass cannot handle is left untouched for the transposition."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_jvp
from onnxgrad._onnx_utils import copy_message
from onnxgrad.derivative.autodiff.tangent import NoTangentRule
from onnxgrad.derivative.tangent_graph import tangent_jvp
from onnxgrad.normalize import normalized_model
from tests.derivative.autodiff.gradcheck import case_model
from tests.derivative.autodiff.test_rules import CASES

DOUBLE = TensorProto.DOUBLE
EPS = 1e-6

#: the operators of transformers, CNNs and MLPs the brief of issue 33 lists
COMMON = [
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Exp", "Log", "Tanh",
    "Sigmoid", "Relu", "Erf", "MatMul", "Gemm", "Softmax", "LogSoftmax", "ReduceSum",
    "ReduceMean", "Reshape", "Transpose", "Slice", "Concat", "Gather", "Unsqueeze", "Expand",
    "Where", "LayerNormalization", "Conv", "Cast", "MaxPool",
]  # fmt: skip


def _first_cases():
    seen, cases = set(), []
    for case in CASES:
        if case.op_type in COMMON and not case.domain and case.op_type not in seen:
            seen.add(case.op_type)
            cases.append(pytest.param(case, id=case.id))
    return cases


@pytest.mark.parametrize("case", _first_cases())
def test_common_operators_take_the_tangent_pass(case):
    model, _ = case_model(case, np.float64)
    jvp, seeds, results = tangent_jvp(normalized_model(model), [], case.differentiated)
    assert seeds == [f"{n}_tangent" for n in case.differentiated]
    assert results and set(results) <= {o.name for o in jvp.graph.output}


def test_every_common_operator_has_a_case():
    assert {p.values[0].op_type for p in _first_cases()} == set(COMMON)


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model, feeds):
    known = {i.name for i in model.graph.input}
    outputs = ReferenceEvaluator(model).run(None, {k: v for k, v in feeds.items() if k in known})
    return dict(zip([o.name for o in model.graph.output], outputs))


def test_loose_tangents_are_expanded_before_a_reduction_and_at_the_outputs():
    """``s = x + b`` with ``x`` of shape (1, 3), ``b`` (2, 3): ``s``'s tangent is ``t``
    broadcast, so ``ReduceSum(s)`` moves by ``2 sum(t)`` and ``s`` by ``t`` on each row."""
    b = np.arange(6.0).reshape(2, 3)
    model = _model(
        [
            helper.make_node("Add", ["x", "b"], ["s"]),
            helper.make_node("ReduceSum", ["s"], ["total"], keepdims=0),
        ],
        [helper.make_tensor_value_info("x", DOUBLE, [1, 3])],
        [
            helper.make_tensor_value_info("s", DOUBLE, [2, 3]),
            helper.make_tensor_value_info("total", DOUBLE, []),
        ],
        [numpy_helper.from_array(b, "b")],
    )
    t = np.array([[1.0, -2.0, 0.5]])
    got = _run(onnx_jvp(model), {"x": np.zeros((1, 3)), "x_tangent": t})
    np.testing.assert_array_equal(got["s_tangent"], np.broadcast_to(t, (2, 3)))
    np.testing.assert_allclose(got["total_tangent"], 2 * t.sum())


def _mlp():
    """``y = Softmax(tanh(x W + b) V)``, float64."""
    rng = np.random.default_rng(3)
    weights = {"W": rng.standard_normal((3, 5)), "b": rng.standard_normal(5)}
    weights["V"] = rng.standard_normal((5, 4))
    model = _model(
        [
            helper.make_node("Gemm", ["x", "W", "b"], ["a"]),
            helper.make_node("Tanh", ["a"], ["h"]),
            helper.make_node("MatMul", ["h", "V"], ["z"]),
            helper.make_node("Softmax", ["z"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", DOUBLE, [2, 3])],
        [helper.make_tensor_value_info("y", DOUBLE, [2, 4])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return model, weights, rng


def test_weights_and_inputs_against_finite_differences():
    model, weights, rng = _mlp()
    x = rng.standard_normal((2, 3))
    jvp = onnx_jvp(model, weights=None, keep_outputs=True)
    sources = ["x", *weights]
    assert [i.name for i in jvp.graph.input] == sources + [f"{s}_tangent" for s in sources]
    assert not jvp.graph.initializer
    values = {"x": x, **weights}
    tangents = {s: rng.standard_normal(v.shape) for s, v in values.items()}
    got = _run(jvp, {**values, **{f"{s}_tangent": t for s, t in tangents.items()}})
    plain = copy_message(model)
    del plain.graph.initializer[:]
    plain.graph.input.extend(
        helper.make_tensor_value_info(k, DOUBLE, list(v.shape)) for k, v in weights.items()
    )

    def moved(sign):
        return _run(plain, {s: v + sign * EPS * tangents[s] for s, v in values.items()})["y"]

    expected = (moved(1) - moved(-1)) / (2 * EPS)
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(got["y_tangent"], expected, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(got["y"], _run(model, {"x": x})["y"], rtol=1e-12)


def test_the_forward_pass_is_computed_once():
    """Each forward node appears once; the tangent nodes add at most three per node (the
    transposition built 28 nodes for this model: the reverse pass and the forward twice)."""
    model, _, _ = _mlp()
    jvp = onnx_jvp(model, weights=[])
    signatures = [(n.op_type, tuple(n.input)) for n in jvp.graph.node]
    for node in model.graph.node:
        assert signatures.count((node.op_type, tuple(node.input))) == 1, node.op_type
    assert len(jvp.graph.node) <= 4 * len(model.graph.node)


def test_a_node_without_tangent_rule_leaves_the_model_untouched():
    """ReduceProd has no tangent rule: the pass refuses it before changing anything, and
    onnx_jvp's transposition gives the tangent (``y = prod(exp(x)) = exp(sum(x))``,
    ``y_tangent = y sum(t)``)."""
    model = _model(
        [
            helper.make_node("Exp", ["x"], ["e"]),
            helper.make_node("ReduceProd", ["e"], ["y"], keepdims=0),
        ],
        [helper.make_tensor_value_info("x", DOUBLE, [4])],
        [helper.make_tensor_value_info("y", DOUBLE, [])],
    )
    normalized = normalized_model(model)
    before = normalized.SerializeToString()
    with pytest.raises(NoTangentRule, match="ReduceProd"):
        tangent_jvp(normalized, [], ["x"])
    assert normalized.SerializeToString() == before
    x = np.array([0.0, 1.0, 3.0, 2.0])
    t = np.array([1.0, 2.0, 3.0, 4.0])
    got = _run(onnx_jvp(model), {"x": x, "x_tangent": t})["y_tangent"]
    np.testing.assert_allclose(got, np.exp(x.sum()) * t.sum())


def test_castlike_gives_its_tangent_the_target_type():
    """``y = CastLike(exp(x), z)^2``, ``x`` float32 and ``z`` float64: the tangent after the
    cast is float64, and so are the constants of the rules after it."""
    model = _model(
        [
            helper.make_node("Exp", ["x"], ["e"]),
            helper.make_node("CastLike", ["e", "z"], ["c"]),
            helper.make_node("Mul", ["c", "c"], ["y"]),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("z", DOUBLE, [1]),
        ],
        [helper.make_tensor_value_info("y", DOUBLE, [3])],
    )
    x = np.array([0.1, 0.2, 0.3], np.float32)
    t = np.array([1.0, 2.0, 3.0], np.float32)
    got = _run(onnx_jvp(model, inputs=["x"]), {"x": x, "z": np.zeros(1), "x_tangent": t})
    assert got["y_tangent"].dtype == np.float64
    np.testing.assert_allclose(
        got["y_tangent"], 2 * np.exp(2 * x.astype(np.float64)) * t, rtol=1e-6
    )


def test_castlike_reads_only_the_type_of_its_second_input():
    """``y = Pad(x, [1, 1], CastLike(-inf, x))``, as in Attention's body: no tangent flows from
    the type donor ``x`` into the pad value, so the tangent pass takes the model (it fell back
    to the transposition before) and ``y``'s tangent is ``t`` padded with zeros."""
    model = _model(
        [
            helper.make_node("CastLike", ["inf", "x"], ["fill"]),
            helper.make_node("Pad", ["x", "pads", "fill"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", DOUBLE, [3])],
        [helper.make_tensor_value_info("y", DOUBLE, [5])],
        [
            numpy_helper.from_array(np.array(-np.inf, np.float32), "inf"),
            numpy_helper.from_array(np.array([1, 1], np.int64), "pads"),
        ],
    )
    built = tangent_jvp(normalized_model(model), [], ["x"], False, True)[0]
    t = np.array([1.0, 2.0, 3.0])
    got = _run(built, {"x": np.zeros(3), "x_tangent": t})
    np.testing.assert_array_equal(got["y_tangent"], [0.0, 1.0, 2.0, 3.0, 0.0])


def test_a_layer_norm_after_an_add_runs_in_onnxruntime_at_its_default_level():
    """onnxruntime fuses ``LayerNormalization(a + b)`` into a ``SkipLayerNormalization``
    that leaves the mean and inverse deviation outputs unset: the tangent of a layer norm
    reads neither (its moments are computed), and the JVP matches finite differences."""
    ort = pytest.importorskip("onnxruntime")
    f32 = TensorProto.FLOAT
    rng = np.random.default_rng(3)
    gamma, beta = (rng.standard_normal(8).astype(np.float32) for _ in range(2))
    scale, bias = numpy_helper.from_array(gamma, "scale"), numpy_helper.from_array(beta, "bias")
    model = _model(
        [
            helper.make_node("Add", ["x", "r"], ["s"]),
            helper.make_node("LayerNormalization", ["s", "scale", "bias"], ["y"], axis=-1),
        ],
        [helper.make_tensor_value_info(n, f32, [2, 5, 8]) for n in ("x", "r")],
        [helper.make_tensor_value_info("y", f32, [2, 5, 8])],
        [scale, bias],
    )
    jvp = onnx_jvp(model, inputs=["x"])
    assert not any(len(n.output) > 1 for n in jvp.graph.node if n.op_type == "LayerNormalization")
    x, r, t = (rng.standard_normal((2, 5, 8)).astype(np.float32) for _ in range(3))
    session = ort.InferenceSession(jvp.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, {"x": x, "r": r, "x_tangent": t})))["y_tangent"]

    def layer_norm(v):
        v = v.astype(np.float64)
        centred = v - v.mean(-1, keepdims=True)
        normed = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5)
        return normed * gamma + beta

    step = 1e-4
    expected = (layer_norm(x + r + step * t) - layer_norm(x + r - step * t)) / (2 * step)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
