"""Training sessions get the options of :mod:`onnxgrad.training.running.session_options` unless the
caller passes its own."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnxgrad.training import LearningRateSGDNesterov, TrainingRunner, make_train_step
from onnxgrad.training.running.data import OrtDataLoader
from onnxgrad.training.running.devices import check_device
from onnxgrad.training.running.session_options import training_session_options
from tests.models import linear_regression_model


def test_defaults_and_overrides():
    options = training_session_options(2)
    assert not options.enable_mem_pattern
    assert options.enable_cpu_mem_arena
    assert not training_session_options(enable_cpu_mem_arena=False).enable_cpu_mem_arena
    assert options.intra_op_num_threads == 2
    assert training_session_options(enable_mem_pattern=True).enable_mem_pattern
    assert not options.enable_mem_reuse
    assert training_session_options(enable_mem_reuse=True).enable_mem_reuse
    with pytest.raises(ValueError, match="no option 'enable_memory_pattern'"):
        training_session_options(enable_memory_pattern=False)


def test_runner_uses_them_unless_given_its_own():
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    step = make_train_step(model, learning_rate=LearningRateSGDNesterov())
    weights = {"coefs": np.zeros((3, 1), np.float32), "intercept": np.zeros(1, np.float32)}
    cpu = check_device("cpu")
    runner = TrainingRunner(step, cpu, weights)
    assert not runner.session.get_session_options().enable_mem_pattern
    assert not runner.session.get_session_options().enable_mem_reuse
    mine = ort.SessionOptions()
    runner = TrainingRunner(step, cpu, weights, session_options=mine)
    assert runner.session.get_session_options().enable_mem_pattern
    assert runner.session.get_session_options().enable_mem_reuse


def test_training_sessions_share_one_cpu_arena():
    """The sessions allocate from the arena registered in onnxruntime's environment (not
    with the arena off), and train exactly as a session with its own arena."""
    from onnxgrad.training.running.cpu_arena import USE_SHARED_ARENA

    key, value = USE_SHARED_ARENA
    assert training_session_options().get_session_config_entry(key) == value
    alone = training_session_options(enable_cpu_mem_arena=False)
    with pytest.raises(RuntimeError, match="does not have configuration"):
        alone.get_session_config_entry(key)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((16, 3)).astype(np.float32)
    y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    step = make_train_step(model, learning_rate=LearningRateSGDNesterov(eta0=0.05))
    cpu = check_device("cpu")
    trained = []
    for options in (training_session_options(), ort.SessionOptions()):
        weights = {"coefs": np.zeros((3, 1), np.float32), "intercept": np.zeros(1, np.float32)}
        runner = TrainingRunner(step, cpu, weights, session_options=options)
        loader = OrtDataLoader(X, y, batch_size=4, random_state=0)
        for _ in range(3):
            runner.run_epoch(loader, 0.05)
        trained.append(runner.get_weights())
    assert trained[0]["coefs"].any()
    for name in trained[0]:
        np.testing.assert_array_equal(trained[0][name], trained[1][name])
