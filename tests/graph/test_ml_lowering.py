"""``lower_ml_operators``: each ``ai.onnx.ml`` operator, per attribute, computes in standard
ONNX what onnxruntime computes for the original node (random inputs)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxgrad.graph import (
    get_train_initializer,
    lower_ml_operators,
    replace_initializers_into_onnx,
)

ML = "ai.onnx.ml"
_ORT_VERSION = tuple(int(p) for p in ort.__version__.split(".")[:2])
F, D, I64, S = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.STRING


def _model(op_type, inputs, outputs, opset=15, extra_initializers=(), **attributes):
    """One ``ai.onnx.ml`` node; ``inputs``/``outputs`` are ``(name, elem_type, shape)``."""
    node = helper.make_node(
        op_type,
        [name for name, _, _ in inputs] + [i.name for i in extra_initializers],
        [name for name, _, _ in outputs],
        domain=ML,
        name=op_type,
        **attributes,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info(*o) for o in outputs],
        list(extra_initializers),
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(ML, 1)],
        ir_version=8,
    )


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _assert_same(model, feeds, rtol=1e-5):
    lowered = lower_ml_operators(model)
    assert ML not in {n.domain for n in lowered.graph.node}
    expected, got = _run(model, feeds), _run(lowered, feeds)
    assert [o.name for o in lowered.graph.output] == [o.name for o in model.graph.output]
    for e, g in zip(expected, got):
        assert e.dtype == g.dtype and e.shape == g.shape
        if e.dtype == object or np.issubdtype(e.dtype, np.integer):
            np.testing.assert_array_equal(g, e)
        else:
            np.testing.assert_allclose(g, e, rtol=rtol, atol=1e-6)
    return lowered


def _x(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("targets", [1, 3])
@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_linear_regressor(rng, targets, transform):
    model = _model(
        "LinearRegressor",
        [("X", F, [None, 4])],
        [("Y", F, [None, targets])],
        coefficients=rng.standard_normal(4 * targets).tolist(),
        intercepts=rng.standard_normal(targets).tolist(),
        targets=targets,
        post_transform=transform,
    )
    x = _x(rng, 7, 4)
    if transform == "SOFTMAX_ZERO":
        x[0] = 0
    lowered = _assert_same(model, {"X": x})
    weights = get_train_initializer(lowered)
    assert {w.shape for w, _ in weights.values()} == {(4, targets), (targets,)}


def test_linear_regressor_one_observation_as_a_vector(rng):
    model = _model(
        "LinearRegressor",
        [("X", F, [4])],
        [("Y", F, [1, 1])],
        coefficients=rng.standard_normal(4).tolist(),
        intercepts=[0.5],
    )
    _assert_same(model, {"X": _x(rng, 4)})


@pytest.mark.parametrize(("n_classes", "scores"), [(2, "one"), (2, "per_class"), (3, "per_class")])
@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("labels", ["ints", "strings"])
def test_linear_classifier(rng, n_classes, transform, labels, scores):
    n_scores = n_classes if scores == "per_class" else 1
    classes = (
        {"classlabels_ints": [3, 7, 11][:n_classes]}
        if labels == "ints"
        else {"classlabels_strings": ["a", "b", "c"][:n_classes]}
    )
    model = _model(
        "LinearClassifier",
        [("X", F, [None, 4])],
        [("label", I64 if labels == "ints" else S, [None]), ("scores", F, [None, None])],
        coefficients=rng.standard_normal(4 * n_scores).tolist(),
        intercepts=rng.standard_normal(n_scores).tolist(),
        post_transform=transform,
        **classes,
    )
    x = _x(rng, 9, 4)
    x[0] = 0
    if n_scores == 1 and transform == "LOGISTIC" and _ORT_VERSION < (1, 20):
        # onnxruntime 1.19 ignores LOGISTIC for one score ([1 - s, s]); numpy is the reference
        lowered = lower_ml_operators(model)
        node = model.graph.node[0]
        w = np.array(helper.get_attribute_value(node.attribute[1]), np.float32)
        b = helper.get_attribute_value(node.attribute[2])[0]
        t = 1 / (1 + np.exp(-(x @ w + b)))
        np.testing.assert_allclose(_run(lowered, {"X": x})[1], np.c_[1 - t, t], rtol=1e-5)
        return
    _assert_same(model, {"X": x})


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX"])
def test_binary_linear_classifier_keeps_one_parameter_set(rng, transform):
    """skl2onnx writes a binary model as rows ``(-w, -b)``, ``(w, b)``: the lowering keeps
    one ``w``, one ``b`` and the scores ``[-s, s]``, so probabilities stay a distribution
    whatever values training gives them."""
    w, b = rng.standard_normal(4), rng.standard_normal()
    model = _model(
        "LinearClassifier",
        [("X", F, [None, 4])],
        [("label", I64, [None]), ("scores", F, [None, 2])],
        coefficients=np.r_[-w, w].tolist(),
        intercepts=[-b, b],
        post_transform=transform,
        classlabels_ints=[0, 1],
    )
    x = _x(rng, 9, 4)
    lowered = _assert_same(model, {"X": x})
    weights = get_train_initializer(lowered)
    assert sorted(v.shape for v, _ in weights.values()) == [(1,), (4, 1)]
    moved = {k: (v * 3 + 1).astype(np.float32) for k, (v, _) in weights.items()}
    labels, scores = _run(replace_initializers_into_onnx(lowered, moved), {"X": x})
    s = x @ (moved[_named(weights, (4, 1))].ravel()) + moved[_named(weights, (1,))]
    expected = {"NONE": np.c_[-s, s], "LOGISTIC": 1 / (1 + np.exp(-np.c_[-s, s]))}
    if transform in expected:
        np.testing.assert_allclose(scores, expected[transform], rtol=1e-5, atol=1e-6)
    if transform != "NONE":
        np.testing.assert_allclose(scores.sum(axis=1), 1, rtol=1e-6)
    np.testing.assert_array_equal(labels, (s > 0).astype(np.int64))


def _named(weights, shape):
    return next(k for k, (v, _) in weights.items() if v.shape == shape)


def test_linear_classifier_int_input_and_multi_class_flag(rng):
    model = _model(
        "LinearClassifier",
        [("X", I64, [None, 3])],
        [("label", I64, [None]), ("scores", F, [None, 3])],
        coefficients=rng.standard_normal(9).tolist(),
        intercepts=[0.1, 0.2, 0.3],
        classlabels_ints=[0, 1, 2],
        multi_class=1,
        post_transform="LOGISTIC",
    )
    _assert_same(model, {"X": rng.integers(-3, 3, (6, 3))})


@pytest.mark.parametrize("sizes", [(1, 1), (4, 4)])
@pytest.mark.parametrize("dtype", [F, D, I64])
def test_scaler(rng, sizes, dtype):
    model = _model(
        "Scaler",
        [("X", dtype, [None, 4])],
        [("Y", F, [None, 4])],
        offset=rng.standard_normal(sizes[0]).tolist(),
        scale=rng.standard_normal(sizes[1]).tolist(),
    )
    x = (_x(rng, 5, 4) * 3).astype(helper.tensor_dtype_to_np_dtype(dtype))
    _assert_same(model, {"X": x})


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
@pytest.mark.parametrize("shape", [(6, 4), (4,)])
def test_normalizer(rng, norm, shape):
    model = _model("Normalizer", [("X", F, list(shape))], [("Y", F, list(shape))], norm=norm)
    x = _x(rng, *shape)
    if len(shape) == 2:
        x[0] = 0
        x[1] = -np.abs(x[1])
    _assert_same(model, {"X": x})


def test_binarizer(rng):
    model = _model("Binarizer", [("X", F, [None, 4])], [("Y", F, [None, 4])], threshold=0.3)
    _assert_same(model, {"X": _x(rng, 5, 4)})


@pytest.mark.parametrize("replaced", [0.0, float("nan")])
@pytest.mark.parametrize("n_values", [1, 3])
def test_imputer_floats(rng, replaced, n_values):
    model = _model(
        "Imputer",
        [("X", F, [None, 3])],
        [("Y", F, [None, 3])],
        imputed_value_floats=[1.5, -2.0, 7.0][:n_values],
        replaced_value_float=replaced,
    )
    x = _x(rng, 6, 3)
    x[::2, 1] = replaced
    _assert_same(model, {"X": x})


def test_imputer_int64(rng):
    model = _model(
        "Imputer",
        [("X", I64, [None, 3])],
        [("Y", I64, [None, 3])],
        imputed_value_int64s=[5, 6, 7],
        replaced_value_int64=-1,
    )
    _assert_same(model, {"X": rng.integers(-2, 3, (6, 3))})


@pytest.mark.parametrize("x_shape", [(5, 6), (2, 3, 6), (6,)])
@pytest.mark.parametrize("dtype", [F, I64, S])
def test_array_feature_extractor(rng, x_shape, dtype):
    model = _model(
        "ArrayFeatureExtractor",
        [("X", dtype, list(x_shape)), ("I", I64, [None])],
        [("Z", dtype, [None] * max(2, len(x_shape)))],
    )
    x = rng.integers(0, 9, x_shape)
    x = (
        x.astype(str).astype(object)
        if dtype == S
        else x.astype(helper.tensor_dtype_to_np_dtype(dtype))
    )
    _assert_same(model, {"X": x, "I": np.array([4, 0, 4], np.int64)})


@pytest.mark.parametrize("dtype", [F, D, I64])
def test_feature_vectorizer(rng, dtype):
    model = _model(
        "FeatureVectorizer",
        [("A", dtype, [None, 2]), ("B", dtype, [None, 3]), ("C", dtype, [None, 4])],
        [("Y", F, [None, 8])],
        inputdimensions=[2, 2, 4],
    )
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    feeds = {name: (_x(rng, 3, k) * 4).astype(np_type) for name, k in zip("ABC", (2, 3, 4))}
    _assert_same(model, feeds)


def test_feature_vectorizer_pads_narrow_inputs(rng):
    model = _model(
        "FeatureVectorizer",
        [("A", F, [None, 2]), ("B", F, [None, 1])],
        [("Y", F, [None, 6])],
        inputdimensions=[3, 3],
    )
    _assert_same(model, {"A": _x(rng, 4, 2), "B": _x(rng, 4, 1)})


def _zipmap_model(rng, opset):
    classifier = helper.make_node(
        "LinearClassifier",
        ["X"],
        ["label", "probability_tensor"],
        domain=ML,
        coefficients=rng.standard_normal(12).tolist(),
        intercepts=[0.0, 0.1, 0.2],
        classlabels_ints=[0, 1, 2],
        post_transform="SOFTMAX",
    )
    zipmap = helper.make_node(
        "ZipMap",
        ["probability_tensor"],
        ["output_probability"],
        domain=ML,
        classlabels_int64s=[0, 1, 2],
    )
    map_type = helper.make_sequence_type_proto(
        helper.make_map_type_proto(I64, helper.make_tensor_type_proto(F, []))
    )
    graph = helper.make_graph(
        [classifier, zipmap],
        "g",
        [helper.make_tensor_value_info("X", F, [None, 4])],
        [
            helper.make_tensor_value_info("label", I64, [None]),
            helper.make_value_info("output_probability", map_type),
        ],
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(ML, 1)],
        ir_version=7,
    )


@pytest.mark.parametrize("keep_zipmap", [True, False])
def test_zipmap_exposes_the_probability_tensor(rng, keep_zipmap):
    model = _zipmap_model(rng, opset=15)
    x = _x(rng, 5, 4)
    lowered = lower_ml_operators(model, keep_zipmap=keep_zipmap)
    names = [o.name for o in lowered.graph.output]
    expected = _run(model, {"X": x})
    got = dict(zip(names, _run(lowered, {"X": x})))
    probabilities = np.array([[row[k] for k in range(3)] for row in expected[1]])
    np.testing.assert_allclose(got["probabilities"], probabilities, rtol=1e-6)
    np.testing.assert_array_equal(got["label"], expected[0])
    if keep_zipmap:
        assert names == ["label", "output_probability", "probabilities"]
        for row, reference in zip(got["output_probability"], expected[1]):
            assert list(row) == list(reference)
            np.testing.assert_allclose(list(row.values()), list(reference.values()), rtol=1e-6)
    else:
        assert names == ["label", "probabilities"]
        assert ML not in {n.domain for n in lowered.graph.node}


def test_old_opset_is_upgraded(rng):
    model = _zipmap_model(rng, opset=9)
    lowered = lower_ml_operators(model, keep_zipmap=False)
    assert {op.domain: op.version for op in lowered.opset_import}[""] == 13
    x = _x(rng, 5, 4)
    np.testing.assert_array_equal(_run(lowered, {"X": x})[0], _run(model, {"X": x})[0])


def test_the_argument_is_not_modified(rng):
    model = _zipmap_model(rng, opset=9)
    before = model.SerializeToString()
    lower_ml_operators(model)
    assert model.SerializeToString() == before


def test_lowered_weights_are_trainable(rng):
    model = _model(
        "LinearRegressor",
        [("X", F, [None, 3])],
        [("Y", F, [None, 1])],
        coefficients=[1.0, 2.0, 3.0],
        intercepts=[4.0],
    )
    weights = get_train_initializer(lower_ml_operators(model))
    np.testing.assert_array_equal(weights["LinearRegressor_coefficients"][0], [[1], [2], [3]])
    np.testing.assert_array_equal(weights["LinearRegressor_intercepts"][0], [4])
    assert onnx.numpy_helper.to_array(weights["LinearRegressor_intercepts"][1]).dtype == np.float32
