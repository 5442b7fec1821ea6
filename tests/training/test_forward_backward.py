"""OrtGradientForwardBackward: onnxcustom's forward/backward API on onnxgrad's gradient graph."""

import pickle

import numpy as np
import pytest
from onnxruntime.capi._pybind_state import OrtValue as C_OrtValue
from onnxruntime.capi._pybind_state import OrtValueVector

from onnxgrad.training import OrtGradientForwardBackward, numpy_to_ort_value
from tests.models import linear_regression_model


@pytest.fixture(scope="module")
def forback():
    coef = np.array([[1.0, -2.0, 0.5]], dtype=np.float32)
    return OrtGradientForwardBackward(linear_regression_model(coef, np.array([0.1])))


def _data(rng, n=7):
    x = rng.standard_normal((n, 3)).astype(np.float32)
    coefs = rng.standard_normal((3, 1)).astype(np.float32)
    intercept = rng.standard_normal(1).astype(np.float32)
    return x, coefs, intercept


def test_names_follow_the_model(forback):
    graphs = forback.cls_type_
    assert graphs._weights_to_train == ["coefs", "intercept"]
    assert graphs._input_names == ["X"] and graphs._output_names == ["Y"]
    assert graphs._bw_fetches_names == ["X_grad", "coefs_grad", "intercept_grad"]
    assert [i.name for i in graphs._sess_eval.get_inputs()] == ["X", "coefs", "intercept"]
    assert repr(forback) == "OrtGradientForwardBackward(...)"


@pytest.mark.parametrize("kind", ["numpy", "list", "vector"])
def test_forward_and_backward_match_numpy(forback, rng, kind):
    x, coefs, intercept = _data(rng)
    g = rng.standard_normal((7, 1)).astype(np.float32)
    wrap = {
        "numpy": lambda arrays: arrays,
        "list": lambda arrays: [numpy_to_ort_value(a) for a in arrays],
        "vector": _vector,
    }[kind]
    inst = forback.new_instance()
    got = inst.forward(wrap([x, coefs, intercept]), training=True)
    x64, c64 = x.astype(np.float64), coefs.astype(np.float64)
    np.testing.assert_allclose(got[0].numpy(), x64 @ c64 + intercept, rtol=1e-5, atol=1e-6)
    grads = [v.numpy() for v in inst.backward(wrap([g]))]
    np.testing.assert_allclose(grads[0], g @ c64.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1], x64.T @ g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[2].ravel(), g.sum(axis=0), rtol=1e-5, atol=1e-5)


def _vector(arrays):
    vector = OrtValueVector()
    for a in arrays:
        vector.push_back(numpy_to_ort_value(a))
    return vector


def test_gradient_given_flat_is_read_in_the_output_shape(forback, rng):
    x, coefs, intercept = _data(rng)
    g = rng.standard_normal((7, 1)).astype(np.float32)
    inst = forback.new_instance()
    inst.forward([x, coefs, intercept], training=True)
    flat = inst.backward([g.reshape((1, -1))])[1].numpy()
    np.testing.assert_allclose(flat, x.astype(np.float64).T @ g, rtol=1e-5, atol=1e-5)


def test_pickled_object_rebuilds_its_sessions(forback, rng):
    x, coefs, intercept = _data(rng)
    again = pickle.loads(pickle.dumps(forback))
    got = again.new_instance().forward([x, coefs, intercept])
    assert isinstance(got[0], C_OrtValue)
    np.testing.assert_allclose(got[0].numpy(), x @ coefs + intercept, rtol=1e-5, atol=1e-6)


def test_refuses_unknown_providers_and_backward_before_forward(forback):
    coef = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
    with pytest.raises(ValueError, match="unknown execution providers"):
        OrtGradientForwardBackward(
            linear_regression_model(coef, np.array([0.0])), providers=["NONE"]
        )
    with pytest.raises(RuntimeError, match="needs a forward"):
        forback.new_instance().backward([np.zeros((1, 1), np.float32)])
