"""Training sessions get the options of :mod:`onnxgrad.training.session_options` unless the
caller passes its own."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnxgrad.training import LearningRateSGDNesterov, TrainingRunner, make_train_step
from onnxgrad.training.devices import check_device
from onnxgrad.training.session_options import training_session_options
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
