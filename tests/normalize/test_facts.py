"""Facts handed between normalisation passes: the ranks pass skips its inference only
where the declared-shapes pass's inference ranked every value, and the result is the
model the passes give without facts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import _onnx_utils
from onnxgrad._onnx_utils import check_strictly, weightless_bytes
from onnxgrad.normalize import normalized_model, pipeline, ranks
from onnxgrad.normalize.facts import Facts
from onnxgrad.normalize.folding import folded_integer_constants
from onnxgrad.normalize.shapes import reconciled_shapes

FLOAT = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _ranked():
    """Every value ranked by plain inference."""
    return _model(
        [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Softmax", ["t"], ["y"])],
        [helper.make_tensor_value_info("x", FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", FLOAT, ["N", 4])],
    )


def _unranked():
    """``Squeeze(x)`` without axes, ``x`` of symbolic dims: its rank depends on the data,
    plain inference leaves it unknown (the ranks pass's rules read it from the ``Concat``)."""
    nodes = [
        helper.make_node("Squeeze", ["x"], ["s"]),
        helper.make_node("Tanh", ["z"], ["t"]),
        helper.make_node("Concat", ["s", "t"], ["y"], axis=0),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("x", FLOAT, ["N", "M"]),
            helper.make_tensor_value_info("z", FLOAT, [2, 3]),
        ],
        [helper.make_tensor_value_info("y", FLOAT, None)],
    )


@pytest.mark.parametrize("make, known", [(_ranked, True), (_unranked, False)])
def test_declared_shapes_pass_tells_whether_every_rank_is_known(make, known):
    facts = Facts()
    reconciled_shapes(make(), facts)
    assert facts.ranks_known is known


def test_ranks_pass_skipped_only_where_it_finds_nothing(monkeypatch):
    """With the facts, the pipeline gives the same bytes as with every pass run alone, and
    runs no rank inference for a model whose values are all ranked."""
    for make in (_ranked, _unranked):
        alone = make()
        for step in pipeline.PASSES:
            alone = step.run(alone)
        assert normalized_model(make()).SerializeToString() == alone.SerializeToString()
    calls = []
    monkeypatch.setattr(ranks, "_rank_facts", lambda model: calls.append(1) or [])
    normalized_model(_ranked())
    assert not calls
    normalized_model(_unranked())
    assert calls


def test_folding_and_other_passes_forget_the_facts(monkeypatch):
    model = _model(
        [
            helper.make_node("Add", ["a", "b"], ["c"]),
            helper.make_node("Reshape", ["x", "c"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", FLOAT, [3, 2])],
        [_ints("a", [1, 1]), _ints("b", [2, 1])],
    )
    facts = Facts(ranks_known=True)
    folded_integer_constants(model, facts)
    assert model.graph.node[0].op_type == "Constant" and not facts.ranks_known
    unchanged = Facts(ranks_known=True)
    folded_integer_constants(_ranked(), unchanged)
    assert unchanged.ranks_known
    seen = []
    declared = next(p for p in pipeline.PASSES if p.name == "declared_shapes")
    spy = pipeline.Pass("spy", lambda m, f: seen.append(f.ranks_known) or m, "", facts=True)
    plain = pipeline.Pass("plain", lambda m: m, "")
    monkeypatch.setattr(pipeline, "PASSES", (declared, spy, plain, spy))
    normalized_model(_ranked())
    assert seen == [True, False]


@pytest.mark.parametrize("one_call", [True, False])
def test_strict_check_in_one_call_or_two(monkeypatch, one_call):
    """The checker and strict inference together (small graphs) or one after the other
    (large ones) refuse an ill-typed model alike."""
    monkeypatch.setattr(_onnx_utils, "FULL_CHECK_NODES", 10 if one_call else 0)
    good = _ranked()
    check_strictly(weightless_bytes(good), len(good.graph.node))
    bad = _ranked()
    bad.graph.output[0].type.tensor_type.elem_type = TensorProto.INT64
    with pytest.raises(onnx.shape_inference.InferenceError, match="y"):
        check_strictly(weightless_bytes(bad), len(bad.graph.node))
    unknown = _ranked()
    unknown.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(onnx.checker.ValidationError, match="NoSuchOp"):
        check_strictly(weightless_bytes(unknown), len(unknown.graph.node))


def _gemm_identity():
    """Every value ranked, a weight past the weightless threshold, an ``Identity`` of a
    float value (a propagating operator with no data to propagate)."""
    w = numpy_helper.from_array(np.ones((4, 300), np.float32), "w")
    return _model(
        [
            helper.make_node("Identity", ["w"], ["w2"]),
            helper.make_node("MatMul", ["x", "w2"], ["m"]),
            helper.make_node("Softmax", ["m"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", FLOAT, ["N", 300])],
        [w],
    )


def _with_shape():
    """``Reshape(x, Shape(x))``: data propagation follows the shape."""
    return _model(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])],
        [helper.make_tensor_value_info("x", FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", FLOAT, ["N", 4])],
    )


def _declared_otherwise():
    """The output declared with a dimension name the inputs do not use."""
    model = _ranked()
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    return model


@pytest.mark.parametrize(
    "make, handed",
    [
        (_ranked, True),
        (_gemm_identity, True),
        (_unranked, False),
        (_with_shape, False),
        (_declared_otherwise, False),
    ],
)
def test_normalisation_hands_its_inference_where_it_is_the_engines(make, handed):
    """``Facts.inferred`` is set where the engine's own inference (declarations kept, data
    propagated) would give the same types, and those types are then the same."""
    from onnxgrad.derivative.autodiff.value_types import infer_value_types

    facts = Facts()
    model = normalized_model(make(), facts)
    assert (facts.inferred is not None) == handed
    if handed:
        assert infer_value_types(model, facts.inferred) == infer_value_types(model)


def test_a_light_models_view_is_the_view_built_field_by_field(monkeypatch):
    """A model with few weight bytes gets its weightless view as a copy less its weights:
    the same message as the view built field by field (node metadata dropped too)."""
    model = _gemm_identity()
    model.graph.initializer.append(_ints("small", [1, 2]))
    model.graph.node[1].metadata_props.add(key="trace", value="a stack trace")
    assert _onnx_utils._light_weights(model) == [0]
    copied = _onnx_utils.weightless_view(model)
    copied_bytes = _onnx_utils.weightless_bytes(model)
    monkeypatch.setattr(_onnx_utils, "COPIED_VIEW_BYTES", 0)
    assert _onnx_utils._light_weights(model) is None
    built = _onnx_utils.weightless_view(model)
    assert copied.SerializeToString() == built.SerializeToString()
    assert [i.name for i in built.graph.input] == ["x", "w"]
    assert copied_bytes == built.SerializeToString()


def test_the_engine_takes_the_handed_inference():
    """``derive_in_place`` given the normalisation's facts reads their inference once and
    leaves them without it (no view of the graph held past the engine's types); the
    gradient is the one built without them."""
    from onnxgrad import onnx_derivative
    from onnxgrad.derivative.api import derive_in_place

    facts = Facts()
    model = normalized_model(_gemm_identity(), facts)
    assert facts.inferred is not None
    gradient = derive_in_place(model, weights=[], inputs=["x"], facts=facts)
    assert facts.inferred is None
    plain = derive_in_place(normalized_model(_gemm_identity()), weights=[], inputs=["x"])
    assert gradient.SerializeToString() == plain.SerializeToString()
    expected = onnx_derivative(_gemm_identity(), weights=[], inputs=["x"])
    assert gradient.SerializeToString() == expected.SerializeToString()
