"""What code written for onnxcustom reads from the estimators, the loader and the devices."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi._pybind_state import OrtDevice
from onnxruntime.capi._pybind_state import OrtValue as C_OrtValue

from onnxgrad import ConvergenceWarning
from onnxgrad.training import (
    ElasticLearningPenalty,
    LearningRateSGD,
    LearningRateSGDNesterov,
    NoLearningPenalty,
    OrtDataLoader,
    OrtGradientForwardBackwardOptimizer,
    SquareLearningLoss,
)
from onnxgrad.training.running.ort_devices import (
    get_ort_device,
    get_ort_device_from_session,
    get_ort_device_type,
    numpy_to_ort_value,
    ort_device_to_string,
)
from tests.models import linear_regression_model
from tests.training.test_seed_compat import linear_data


def _estimator(**kwargs):
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    options = {"max_iter": 3, "batch_size": 10, "random_state": 0, **kwargs}
    return OrtGradientForwardBackwardOptimizer(model, ["coefs", "intercept"], **options)


def test_shorthands_read_back_as_the_objects_they_select():
    est = _estimator(learning_rate="Nesterov")
    assert isinstance(est.learning_rate, LearningRateSGDNesterov)
    assert isinstance(est.learning_loss, SquareLearningLoss)
    assert isinstance(est.learning_penalty, NoLearningPenalty)
    assert est.learning_rate is est.learning_rate  # resolved once, not at every read
    number = _estimator(learning_rate=1e-3)
    assert isinstance(number.learning_rate, LearningRateSGD)
    assert number.learning_rate.eta0 == 1e-3
    given = ElasticLearningPenalty(l1=0.1, l2=0.2)
    assert _estimator(learning_penalty=given).learning_penalty is given


def test_get_params_and_clone_keep_the_values_as_given():
    sklearn = pytest.importorskip("sklearn.base")
    est = _estimator(learning_rate="Nesterov")
    params = est.get_params()
    assert params["learning_rate"] == "Nesterov"
    assert params["learning_loss"] == "squared_error"
    assert params["learning_penalty"] is None
    cloned = sklearn.clone(est)
    assert cloned.get_params()["learning_rate"] == "Nesterov"
    assert isinstance(cloned.learning_rate, LearningRateSGDNesterov)


def test_a_fit_never_changes_the_parameters_and_exposes_what_it_trained_with():
    X, y = linear_data()
    rate = LearningRateSGD(eta0=0.01)
    est = _estimator(learning_rate=rate).fit(X, y)
    assert est.get_params()["learning_rate"] is rate
    assert not hasattr(rate, "value")  # the given object was copied, never run
    assert est.learning_rate is est.learning_rate_  # the live optimizer, onnxcustom's view
    assert est.learning_rate.value < 0.01  # 'invscaling' decayed during the fit
    est.set_params(learning_rate="Nesterov")  # a new parameter forgets the fitted object
    assert isinstance(est.learning_rate, LearningRateSGDNesterov)
    assert est.learning_rate is not est.learning_rate_


def test_repr_prints_nested_objects_whole():
    text = repr(_estimator(learning_rate=1e-3))
    expected = (
        "learning_rate=LearningRateSGD(eta0=0.001, alpha=0.0001, power_t=0.25, "
        "learning_rate='invscaling')"
    )
    assert expected in text
    assert "learning_loss=SquareLearningLoss(" in text and "..." not in text
    assert "model_onnx=<ModelProto 'lr'>" in text


def test_an_unknown_shorthand_fails_at_fit_and_repr_shows_it():
    est = _estimator(learning_rate="sgdd")
    assert "learning_rate='sgdd'" in repr(est)
    with pytest.raises(ValueError, match="unknown learning_rate 'sgdd'"):
        est.fit(*linear_data())


def test_fitted_estimator_pickles_with_its_resolved_objects():
    est = _estimator(learning_rate="Nesterov").fit(*linear_data())
    again = pickle.loads(pickle.dumps(est))
    assert again.get_params()["learning_rate"] == "Nesterov"
    assert isinstance(again.learning_rate, LearningRateSGDNesterov)
    np.testing.assert_allclose(again.learning_rate.value, est.learning_rate.value)


def test_a_misspelt_schedule_fails_at_construction():
    with pytest.raises(ValueError, match="unknown learning_rate schedule 'EXC'"):
        LearningRateSGD(learning_rate="EXC")
    with pytest.raises(ValueError, match="unknown learning_rate schedule"):
        LearningRateSGDNesterov(learning_rate="CST")


def test_sample_weight_as_a_column_trains_as_the_vector():
    X, y = linear_data()
    w = np.linspace(0.5, 2, len(X)).astype(np.float32)
    vector = _estimator(weight_name="w").fit(X, y, w)
    column = _estimator(weight_name="w").fit(X, y, w.reshape((-1, 1)))
    for name, value in vector.get_state().items():
        np.testing.assert_array_equal(column.get_state()[name], value)


def test_divergence_without_exc_warns_a_convergence_warning():
    est = _estimator(learning_rate=1e12, exc=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(*linear_data())
    assert any(issubclass(w.category, ConvergenceWarning) for w in caught)
    assert issubclass(ConvergenceWarning, RuntimeWarning)


def test_loader_describes_its_arrays_and_holds_float_targets_as_a_column():
    X = np.arange(14, dtype=np.float64).reshape((7, 2))
    loader = OrtDataLoader(X, X[:, 0], np.ones((7, 1)), batch_size=3, random_iter=False)
    assert loader.desc == [((7, 2), np.float64), ((7, 1), np.float64), ((7,), np.float64)]
    assert repr(loader).startswith("OrtDataLoader(...")
    assert loader.data_np == loader.arrays() and len(loader.data_ort) == 3
    labels = OrtDataLoader(X, np.arange(7), batch_size=3)
    assert labels.desc[1] == ((7,), np.int64)  # class indices stay a vector


def test_loader_yields_c_level_ortvalues_owning_their_memory():
    X = np.arange(12, dtype=np.float32).reshape((6, 2))
    loader = OrtDataLoader(X, X[:, 0], batch_size=4, random_iter=False)
    batches = list(loader.iter_ortvalue())
    assert all(isinstance(v, C_OrtValue) for batch in batches for v in batch)
    assert [b[0].shape() for b in batches] == [[4, 2], [2, 2]]
    X[:] = -1  # the values were copied: the batches do not follow the source
    np.testing.assert_array_equal(batches[0][0].numpy(), np.arange(8).reshape((4, 2)))
    wrapped = ort.OrtValue(batches[0][0])  # what InferenceSession.run_with_ortvalues takes
    assert wrapped.shape() == [4, 2]


def test_numpy_to_ort_value_copies_into_a_c_level_value():
    array = np.arange(6, dtype=np.float32).reshape((2, 3))
    value = numpy_to_ort_value(array)
    array += 10
    assert isinstance(value, C_OrtValue)
    np.testing.assert_array_equal(value.numpy(), np.arange(6).reshape((2, 3)))


def test_gpu_is_cuda_and_device_types_of_devices():
    assert ort_device_to_string(get_ort_device("gpu")) == "cuda"
    assert ort_device_to_string(get_ort_device("gpu:1")) == "cuda:1"
    assert get_ort_device_type(get_ort_device("cuda:1")) == OrtDevice.cuda()
    assert get_ort_device_type(get_ort_device("cpu")) == OrtDevice.cpu()
    with pytest.raises(TypeError):
        get_ort_device_type(0)
    with pytest.raises(ValueError, match="unknown device"):
        get_ort_device_type("gpu:x")


def test_device_of_a_session():
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for target in (session, session._sess):
        device = get_ort_device_from_session(target)
        assert device.device_type() == OrtDevice.cpu() and device.device_id() == 0
