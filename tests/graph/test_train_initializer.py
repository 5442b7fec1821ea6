"""get_train_initializer: float weights on a differentiable path to an output."""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from onnxgrad.graph import get_train_initializer
from tests.models import linear_regression_model, seed004_model


def test_seed004_weights_are_the_three_float_coefficients():
    model = seed004_model()
    expected = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    found = get_train_initializer(model)
    assert list(found) == ["init", "init_1", "init_b10"]
    for name, (array, proto) in found.items():
        np.testing.assert_array_equal(array, expected[name])
        assert proto.name == name


def test_linear_regression_weights():
    found = get_train_initializer(linear_regression_model(np.array([1.0, 2.0]), np.array([3.0])))
    assert list(found) == ["coefs", "intercept"]
    np.testing.assert_array_equal(found["coefs"][0], np.array([[1.0], [2.0]], dtype=np.float32))
