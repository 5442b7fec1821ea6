"""Training: fused train steps, the onnxruntime runner and scikit-learn style estimators.

* :mod:`~onnxgrad.training.composition` fuses forward, loss, gradient, penalty and update
  into one ONNX graph (:func:`make_train_step`, described by a
  :class:`~onnxgrad.training.train_step.TrainStep`), plus the evaluation and prediction
  graphs;
* :mod:`~onnxgrad.training.runner` runs them with IOBinding, the state on the device;
* :mod:`~onnxgrad.training.estimators` wraps both in ``fit``/``score`` estimators;
* :mod:`~onnxgrad.training.artifacts` writes a train step, its checkpoint and the models
  around it for inference-only runtimes (on-device training).
"""

# ruff: noqa: E402
from onnxgrad._runtime import import_onnxruntime

import_onnxruntime()  # first, so that the training wheel's import does not load PyTorch

from onnxgrad.training.artifacts import (
    TrainingArtifacts,
    generate_artifacts,
    load_train_step,
    merge_checkpoint,
)
from onnxgrad.training.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from onnxgrad.training.classifier import OrtGradientClassifier
from onnxgrad.training.composition import (
    LossModel,
    make_eval_step,
    make_loss_model,
    make_predict_model,
    make_train_step,
    weights_as_inputs,
    with_batch_indices,
)
from onnxgrad.training.data import OrtDataLoader
from onnxgrad.training.devices import Device, check_device, parse_device
from onnxgrad.training.estimators import (
    BaseOrtOptimizer,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
)
from onnxgrad.training.forward_backward import (
    OrtGradientForwardBackward,
    OrtGradientForwardBackwardFunction,
)
from onnxgrad.training.learning_rate import (
    BaseLearningRate,
    LearningRateAdam,
    LearningRateSGD,
    LearningRateSGDNesterov,
    learning_rate_from_name,
)
from onnxgrad.training.loss_scaling import LossScaling
from onnxgrad.training.losses import (
    AbsoluteLearningLoss,
    BaseLearningLoss,
    CrossEntropyLearningLoss,
    ElasticLearningLoss,
    NegLogLearningLoss,
    SquareLearningLoss,
)
from onnxgrad.training.ort_devices import (
    device_to_providers,
    get_ort_device,
    numpy_to_ort_value,
    ort_device_to_string,
)
from onnxgrad.training.penalties import (
    BaseLearningPenalty,
    ElasticLearningPenalty,
    NoLearningPenalty,
)
from onnxgrad.training.runner import GraphRunner, TrainingRunner
from onnxgrad.training.train_step import StateSlot, TrainStep

__all__ = [
    "AbsoluteLearningLoss",
    "BaseLearningLoss",
    "BaseLearningPenalty",
    "BaseLearningRate",
    "BaseOrtOptimizer",
    "Checkpoint",
    "CrossEntropyLearningLoss",
    "Device",
    "ElasticLearningLoss",
    "ElasticLearningPenalty",
    "GraphRunner",
    "LearningRateAdam",
    "LearningRateSGD",
    "LearningRateSGDNesterov",
    "LossModel",
    "LossScaling",
    "NegLogLearningLoss",
    "NoLearningPenalty",
    "OrtDataLoader",
    "OrtGradientClassifier",
    "OrtGradientForwardBackward",
    "OrtGradientForwardBackwardFunction",
    "OrtGradientForwardBackwardOptimizer",
    "OrtGradientOptimizer",
    "SquareLearningLoss",
    "StateSlot",
    "TrainStep",
    "TrainingArtifacts",
    "TrainingRunner",
    "check_device",
    "device_to_providers",
    "generate_artifacts",
    "get_ort_device",
    "learning_rate_from_name",
    "load_checkpoint",
    "load_train_step",
    "make_eval_step",
    "make_loss_model",
    "make_predict_model",
    "make_train_step",
    "merge_checkpoint",
    "numpy_to_ort_value",
    "ort_device_to_string",
    "parse_device",
    "save_checkpoint",
    "weights_as_inputs",
    "with_batch_indices",
]
