"""replace_initializers_into_onnx and add_initializer, checked by running the models."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnxgrad.graph import add_initializer, replace_initializers_into_onnx
from tests.graph.sklearn_models import linear_regression, mlp_regressor, run
from tests.models import linear_regression_model, seed004_model


def test_new_values_change_the_predictions(rng):
    model = linear_regression_model(np.array([1.0, 2.0]), np.array([3.0]))
    before = model.SerializeToString()
    coefs = rng.standard_normal((2, 1)).astype(np.float32)
    intercept = np.array([-0.5], dtype=np.float32)

    result = replace_initializers_into_onnx(model, {"coefs": coefs, "intercept": intercept})

    assert model.SerializeToString() == before
    onnx.checker.check_model(result, full_check=True)
    assert [i.name for i in result.graph.initializer] == ["coefs", "intercept"]
    X = rng.standard_normal((5, 2)).astype(np.float32)
    np.testing.assert_allclose(run(result, {"X": X})["Y"], X @ coefs + intercept, rtol=1e-6)


def test_ort_values_are_accepted_for_a_converted_mlp():
    conv = mlp_regressor()
    est = conv.estimator
    new = [c * 2 for c in est.coefs_]
    values = {
        "coefficient": ort.OrtValue.ortvalue_from_numpy(new[0].astype(np.float32)),
        "coefficient1": ort.OrtValue.ortvalue_from_numpy(new[1].astype(np.float32)),
    }
    result = replace_initializers_into_onnx(conv.onnx, values)
    hidden = np.maximum(conv.X @ new[0] + est.intercepts_[0], 0)
    expected = hidden @ new[1] + est.intercepts_[1]
    np.testing.assert_allclose(
        run(result, {"X": conv.X})["variable"], expected, rtol=1e-5, atol=1e-5
    )


def test_double_weights_of_a_converted_linear_regression():
    conv = linear_regression()
    coef = np.array([[1.0], [2.0], [3.0]])
    result = replace_initializers_into_onnx(conv.onnx, {"coef": coef})
    expected = conv.X @ coef + conv.estimator.intercept_
    np.testing.assert_allclose(run(result, {"X": conv.X})["variable"], expected, rtol=1e-12)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"nope": np.zeros(1, np.float32)}, r"unknown initializers \['nope'\]"),
        ({"coefs": np.zeros((2, 1))}, r"weight 'coefs'.*dtype float64.*float32"),
        ({"coefs": np.zeros((1, 2), np.float32)}, r"weight 'coefs'.*shape \(1, 2\).*\(2, 1\)"),
    ],
)
def test_replace_errors_name_the_weight(values, match):
    model = linear_regression_model(np.array([1.0, 2.0]), np.array([3.0]))
    before = model.SerializeToString()
    with pytest.raises(ValueError, match=match):
        replace_initializers_into_onnx(model, values)
    assert model.SerializeToString() == before


def test_replace_rejects_values_that_are_not_arrays():
    model = linear_regression_model(np.array([1.0, 2.0]), np.array([3.0]))
    with pytest.raises(TypeError, match="value of 'intercept'"):
        replace_initializers_into_onnx(model, {"intercept": "3"})
    with pytest.raises(TypeError, match="values must be a dict"):
        replace_initializers_into_onnx(model, [np.zeros((2, 1), np.float32)])


def test_add_initializer_appends_a_value():
    model = seed004_model()
    before = model.SerializeToString()
    value = np.arange(6, dtype=np.float32).reshape((2, 3))
    result = add_initializer(model, "extra", value)
    assert model.SerializeToString() == before
    onnx.checker.check_model(result, full_check=True)
    added = {i.name: i for i in result.graph.initializer}["extra"]
    np.testing.assert_array_equal(numpy_helper.to_array(added), value)
    assert len(result.graph.initializer) == len(model.graph.initializer) + 1


def test_add_initializer_accepts_ort_values():
    value = ort.OrtValue.ortvalue_from_numpy(np.array([1.5, 2.5]))
    result = add_initializer(seed004_model(), "extra", value)
    added = {i.name: i for i in result.graph.initializer}["extra"]
    np.testing.assert_array_equal(numpy_helper.to_array(added), [1.5, 2.5])


@pytest.mark.parametrize("name", ["init", "x", "out_mul_0", "y"])
def test_add_initializer_refuses_existing_names(name):
    with pytest.raises(ValueError, match=f"name '{name}' already exists"):
        add_initializer(seed004_model(), name, np.zeros(1, np.float32))


def test_add_initializer_refuses_empty_names():
    with pytest.raises(TypeError, match="non-empty string"):
        add_initializer(seed004_model(), "", np.zeros(1, np.float32))
