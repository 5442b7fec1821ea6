"""``lower_ml_operators`` on ``SVMRegressor`` and ``SVMClassifier``: per attribute, the lowered
model computes what onnxruntime computes for the original node (random inputs), labels
exactly, ties included."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import onnx_derivative
from onnxgrad.derivative import DerivativeOptions
from onnxgrad.graph import add_loss_output, get_train_initializer, lower_ml_operators, ml_lowering
from onnxgrad.graph.ml_lowering import why_not_lowered
from tests.derivative.fd import onnx_numerical_vjp
from tests.graph.test_ml_lowering import _assert_same, _model, _run, _x

F, D, I64, S = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.STRING
_ORT_VERSION = tuple(int(p) for p in ort.__version__.split(".")[:2])
KERNELS = {
    "LINEAR": [0.0, 0.0, 0.0],
    "POLY": [0.3, 0.5, 3.0],
    "RBF": [0.4, 0.0, 0.0],
    "SIGMOID": [0.2, -0.1, 0.0],
}


def _classifier(
    rng,
    n_classes: int = 3,
    kernel: str = "RBF",
    params=None,
    proba: bool = False,
    transform: str = "NONE",
    labels: str = "ints",
    x_type: int = F,
    x_shape=(None, 4),
    **overrides,
):
    """An ``SVMClassifier`` in libsvm's layout, ``[2, 3, 1, 2]`` vectors for its classes."""
    per_class = [2, 3, 1, 2][:n_classes]
    n_vectors, n_pairs = sum(per_class), n_classes * (n_classes - 1) // 2
    attributes = {
        "coefficients": rng.standard_normal((n_classes - 1) * n_vectors).tolist(),
        "support_vectors": rng.standard_normal(n_vectors * x_shape[-1]).tolist(),
        "vectors_per_class": per_class,
        "rho": (0.3 * rng.standard_normal(n_pairs)).tolist(),
        "kernel_type": kernel,
        "kernel_params": KERNELS[kernel] if params is None else params,
        "post_transform": transform,
    }
    if proba:
        attributes["prob_a"] = (-rng.uniform(0.5, 3.0, n_pairs)).tolist()
        attributes["prob_b"] = (0.3 * rng.standard_normal(n_pairs)).tolist()
    if labels == "ints":
        attributes["classlabels_ints"] = [3, 7, 11, 13][:n_classes]
    else:
        attributes["classlabels_strings"] = ["a", "b", "c", "d"][:n_classes]
    attributes.update(overrides)
    return _model(
        "SVMClassifier",
        [("X", x_type, list(x_shape))],
        [("label", I64 if labels == "ints" else S, [None]), ("scores", F, [None, None])],
        **attributes,
    )


@pytest.mark.parametrize("proba", [False, True])
@pytest.mark.parametrize("n_classes", [2, 3, 4])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_svm_classifier_kernels(rng, kernel, n_classes, proba):
    model = _classifier(rng, n_classes, kernel, proba=proba)
    lowered = _assert_same(model, {"X": _x(rng, 40, 4)})
    assert ("Loop" in {n.op_type for n in lowered.graph.node}) == proba


@pytest.mark.parametrize("degree", [2.0, 1.5])
def test_svm_classifier_poly_degree_and_no_coef0(rng, degree):
    model = _classifier(rng, 3, "POLY", params=[0.3, 4.0 if degree == 1.5 else 0.0, degree])
    _assert_same(model, {"X": _x(rng, 20, 4)})


@pytest.mark.parametrize("labels", ["ints", "strings"])
@pytest.mark.parametrize("proba", [False, True])
@pytest.mark.parametrize("n_classes", [2, 3])
@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_svm_classifier_post_transform(rng, transform, n_classes, proba, labels):
    model = _classifier(rng, n_classes, proba=proba, transform=transform, labels=labels)
    x = _x(rng, 30, 4)
    if transform == "LOGISTIC" and n_classes == 2 and not proba and _ORT_VERSION < (1, 20):
        # onnxruntime 1.19 writes [1 - s, s]; the reference is the logistic of its own s
        s = _run(_with_transform(model, "NONE"), {"X": x})[1][:, 1:]
        got = _run(lower_ml_operators(model), {"X": x})[1]
        np.testing.assert_allclose(got, 1 / (1 + np.exp(np.c_[s, -s])), rtol=1e-5)
        return
    _assert_same(model, {"X": x})


def _with_transform(model, transform: str):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for attribute in copy.graph.node[0].attribute:
        if attribute.name == "post_transform":
            attribute.s = transform.encode()
    return copy


@pytest.mark.parametrize(("x_type", "x_shape"), [(D, (None, 4)), (I64, (None, 4)), (F, (4,))])
def test_svm_classifier_input_types(rng, x_type, x_shape):
    model = _classifier(rng, 3, proba=True, x_type=x_type, x_shape=x_shape)
    x = (_x(rng, *(s or 7 for s in x_shape)) * 2).astype(helper.tensor_dtype_to_np_dtype(x_type))
    _assert_same(model, {"X": x})


@pytest.mark.parametrize(
    ("rho", "expected"),
    [
        ([1.0, -1.0, 1.0], 3),  # votes (1, 1, 1): the first class
        ([0.0, 0.0, 0.0], 11),  # s = 0 votes for the second class of the pair: (0, 1, 2)
        ([-1.0, 1.0, 1.0], 7),  # (1, 2, 0)
        ([1.0, 1.0, 0.0], 3),  # (2, 0, 1)
    ],
)
def test_svm_classifier_vote_ties(rng, rho, expected):
    """At ``x = 0`` a linear kernel is 0 and ``s = rho``: pair ``(i, j)`` votes ``i`` when
    ``s > 0``, else ``j``; the most voted class wins, the first one on ties."""
    model = _classifier(rng, 3, "LINEAR", rho=rho)
    x = np.zeros((2, 4), np.float32)
    _assert_same(model, {"X": x})
    np.testing.assert_array_equal(_run(lower_ml_operators(model), {"X": x})[0], [expected] * 2)


def test_svm_classifier_binary_zero_score_votes_second_class(rng):
    model = _classifier(rng, 2, "LINEAR", rho=[0.0])
    x = np.zeros((1, 4), np.float32)
    _assert_same(model, {"X": x})
    assert _run(lower_ml_operators(model), {"X": x})[0].tolist() == [7]


def _liblinear(rng, n_classes, positive, proba=False, transform="NONE", labels="ints"):
    coefficients = rng.standard_normal(n_classes * 4)
    attributes = {
        "coefficients": (np.abs(coefficients) if positive else coefficients).tolist(),
        "rho": [0.25],
        "kernel_type": "LINEAR",
        "kernel_params": [0.1, 0.0, 3.0],
        "post_transform": transform,
    }
    if proba:
        attributes.update(prob_a=[-1.0], prob_b=[0.1])
    key = "classlabels_ints" if labels == "ints" else "classlabels_strings"
    attributes[key] = [3, 7, 11][:n_classes] if labels == "ints" else ["a", "b", "c"][:n_classes]
    return _model(
        "SVMClassifier",
        [("X", F, [None, 4])],
        [("label", I64 if labels == "ints" else S, [None]), ("scores", F, [None, n_classes])],
        **attributes,
    )


@pytest.mark.parametrize("labels", ["ints", "strings"])
@pytest.mark.parametrize("proba", [False, True])
@pytest.mark.parametrize(("n_classes", "positive"), [(2, True), (2, False), (3, False)])
def test_svm_classifier_liblinear_layout(rng, n_classes, positive, proba, labels):
    """No support vectors: ``s = x a^T + rho_0``; two classes without ``prob_a`` take
    ``classes[1]`` when ``max s > 0`` (``>= 0.5`` when every coefficient is >= 0)."""
    model = _liblinear(rng, n_classes, positive, proba, labels=labels)
    x = _x(rng, 60, 4) * rng.uniform(0.01, 1.0, (60, 1)).astype(np.float32)
    x[0] = 0
    _assert_same(model, {"X": x})


@pytest.mark.parametrize("transform", ["LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_svm_classifier_liblinear_post_transform(rng, transform):
    _assert_same(_liblinear(rng, 3, False, transform=transform), {"X": _x(rng, 10, 4)})


def test_svm_classifier_weights_are_its_attributes(rng):
    model = _classifier(rng, 3, "RBF", proba=True)
    attributes = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    weights = {
        name.split("_", 1)[1]: numpy_helper.to_array(tensor)
        for name, (_, tensor) in get_train_initializer(lower_ml_operators(model)).items()
    }
    assert sorted(weights) == ["coefficients", "prob_a", "prob_b", "rho", "support_vectors"]
    np.testing.assert_array_equal(
        weights["support_vectors"], np.float32(attributes["support_vectors"]).reshape(6, 4)
    )
    np.testing.assert_array_equal(
        weights["coefficients"], np.float32(attributes["coefficients"]).reshape(2, 6)
    )
    for name in ("rho", "prob_a", "prob_b"):
        np.testing.assert_array_equal(weights[name], np.float32(attributes[name]))


def test_svm_classifier_probit_is_left_with_its_reason(rng):
    model = _classifier(rng, 3, transform="PROBIT")
    lowered = lower_ml_operators(model)
    assert [n.op_type for n in lowered.graph.node] == ["SVMClassifier"]
    assert why_not_lowered(lowered.graph.node[0]) == "post_transform 'PROBIT' has no lowering"
    with pytest.raises(NotImplementedError, match=r"SVMClassifier.*post_transform 'PROBIT'"):
        onnx_derivative(model, weights=[])


def test_svm_classifier_inconsistent_sizes_are_left_with_their_reason(rng):
    model = _classifier(rng, 3, vectors_per_class=[2, 3])
    assert [n.op_type for n in lower_ml_operators(model).graph.node] == ["SVMClassifier"]
    assert "vectors_per_class [2, 3] does not fit 3 classes" in why_not_lowered(model.graph.node[0])


# -- SVMRegressor ------------------------------------------------------------------------------
@pytest.mark.parametrize("one_class", [0, 1])
@pytest.mark.parametrize("supports", [0, 3])
def test_svm_regressor_linear(rng, one_class, supports):
    vectors = {}
    if supports:
        vectors = {"support_vectors": rng.standard_normal(3 * 4).tolist(), "n_supports": 3}
    model = _model(
        "SVMRegressor",
        [("X", F, [None, 4])],
        [("Y", F, [None, 1])],
        coefficients=rng.standard_normal(supports or 4).tolist(),
        rho=[0.25],
        kernel_type="LINEAR",
        kernel_params=[0.3, 0.5, 3.0],
        one_class=one_class,
        **vectors,
    )
    _assert_same(model, {"X": _x(rng, 8, 4)})


@pytest.mark.parametrize("one_class", [0, 1])
@pytest.mark.parametrize("kernel", ["POLY", "RBF", "SIGMOID"])
def test_svm_regressor_kernels(rng, kernel, one_class):
    model = _model(
        "SVMRegressor",
        [("X", F, [None, 4])],
        [("Y", F, [None, 1])],
        coefficients=rng.standard_normal(5).tolist(),
        support_vectors=rng.standard_normal(5 * 4).tolist(),
        n_supports=5,
        rho=[0.25],
        kernel_type=kernel,
        kernel_params=KERNELS[kernel],
        one_class=one_class,
    )
    lowered = _assert_same(model, {"X": _x(rng, 12, 4)})
    shapes = {w.shape for w, _ in get_train_initializer(lowered).values()}
    assert shapes == (set() if one_class else {(5, 4), (5, 1), (1,)})


@pytest.mark.parametrize("opset", [9, 10, 12])
@pytest.mark.parametrize("kernel", ["LINEAR", "RBF"])
def test_svm_classifier_at_its_own_old_opset(rng, monkeypatch, kernel, opset):
    """When onnx's version converter cannot raise a model to 13, the lowering works at the
    model's opset (Gemm with its then required C, Slice-free shapes, attribute axes)."""
    monkeypatch.setattr(ml_lowering, "_upgraded", lambda model: model)
    model = _classifier(rng, 3, kernel, proba=True)
    model.opset_import[0].version = opset
    lowered = _assert_same(model, {"X": _x(rng, 10, 4)})
    assert {op.version for op in lowered.opset_import if op.domain == ""} == {opset}


@pytest.mark.parametrize(
    ("kernel", "n_classes", "proba"),
    [("SIGMOID", 3, True), ("POLY", 4, True), ("RBF", 2, False), ("LINEAR", 4, False)],
)
def test_svm_classifier_gradients_match_finite_differences(rng, kernel, n_classes, proba):
    """Gradients of a loss on the scores with respect to ``x`` and every weight (support
    vectors, dual coefficients, rho, Platt's A and B; through the coupling ``Loop``)."""
    model = lower_ml_operators(_classifier(rng, n_classes, kernel, proba=proba))
    with_loss = add_loss_output(model, "squared_error")
    weights = list(get_train_initializer(with_loss))
    assert len(weights) == (5 if proba else 3)
    grad = onnx_derivative(with_loss, options=DerivativeOptions.Loss, label="label")
    values = {i.name: numpy_helper.to_array(i) for i in with_loss.graph.initializer}
    n_scores = n_classes if proba or n_classes == 2 else n_classes * (n_classes - 1) // 2
    label = rng.uniform(0, 1, (5, n_scores)).astype(np.float32)
    feeds = {"X": _x(rng, 5, 4), "label": label, **{w: values[w] for w in weights}}
    got = dict(zip([o.name for o in grad.graph.output], _run(grad, feeds)))
    expected = onnx_numerical_vjp(with_loss, feeds, ["X", *weights], outputs=["loss"], eps=1e-6)
    for name in ["X", *weights]:
        scale = max(1.0, float(np.abs(expected[name]).max()))
        np.testing.assert_allclose(
            got[f"{name}_grad"], expected[name], rtol=2e-3, atol=2e-3 * scale, err_msg=name
        )


@pytest.mark.parametrize("proba", [False, True])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_svm_classifier_on_an_empty_batch(rng, kernel, proba):
    """No row in, no row out, as onnxruntime answers (the RBF rows are reshaped to
    ``[N, 1, F]`` with ``F`` written out: ``-1`` cannot be inferred from 0 elements)."""
    model = _classifier(rng, 3, kernel, proba=proba)
    label, scores = _run(lower_ml_operators(model), {"X": np.zeros((0, 4), np.float32)})
    assert label.shape == (0,) and scores.shape[0] == 0
    _assert_same(model, {"X": np.zeros((0, 4), np.float32)})
