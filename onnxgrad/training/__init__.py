"""Training: fused train steps, the onnxruntime runner and scikit-learn style estimators.

* :mod:`~onnxgrad.training.step.composition` fuses forward, loss, gradient, penalty and update
  into one ONNX graph (:func:`make_train_step`, described by a
  :class:`~onnxgrad.training.step.train_step.TrainStep`), plus the evaluation and prediction
  graphs;
* :mod:`~onnxgrad.training.running.runner` runs them with IOBinding, the state on the device;
* :mod:`~onnxgrad.training.estimators.optimizers` wraps both in ``fit``/``score`` estimators;
* :mod:`~onnxgrad.training.artifacts.generate` writes a train step, its checkpoint and the models
  around it for inference-only runtimes (on-device training).

``import onnxgrad.training`` loads none of its modules: each public name is imported from
its module on first use (PEP 562), after :func:`~onnxgrad._runtime.import_onnxruntime` (so
that the training wheel's import does not load PyTorch), and the composition of a train step
(:mod:`~onnxgrad.training.step.composition`) can be imported without onnxruntime.
"""

from __future__ import annotations

import importlib

#: module (in this package) -> the public names it defines
_EXPORTS: dict[str, tuple[str, ...]] = {
    "artifacts.generate": (
        "TrainingArtifacts",
        "generate_artifacts",
        "load_train_step",
        "merge_checkpoint",
    ),
    "artifacts.checkpoint": ("Checkpoint", "load_checkpoint", "save_checkpoint"),
    "estimators.classifier": ("OrtGradientClassifier",),
    "step.composition": (
        "LossModel",
        "make_eval_step",
        "make_loss_model",
        "make_predict_model",
        "make_train_step",
        "weights_as_inputs",
        "with_batch_indices",
    ),
    "running.data": ("OrtDataLoader",),
    "running.devices": ("Device", "check_device", "parse_device"),
    "estimators.optimizers": (
        "BaseOrtOptimizer",
        "OrtGradientForwardBackwardOptimizer",
        "OrtGradientOptimizer",
    ),
    "estimators.forward_backward": (
        "OrtGradientForwardBackward",
        "OrtGradientForwardBackwardFunction",
    ),
    "step.learning_rate": (
        "BaseLearningRate",
        "LearningRateAdam",
        "LearningRateSGD",
        "LearningRateSGDNesterov",
        "learning_rate_from_name",
    ),
    "step.loss_scaling": ("LossScaling",),
    "step.losses": (
        "AbsoluteLearningLoss",
        "BaseLearningLoss",
        "CrossEntropyLearningLoss",
        "ElasticLearningLoss",
        "NegLogLearningLoss",
        "SquareLearningLoss",
    ),
    "running.ort_devices": (
        "device_to_providers",
        "get_ort_device",
        "get_ort_device_from_session",
        "get_ort_device_type",
        "numpy_to_ort_value",
        "ort_device_to_string",
        "provider_to_device",
    ),
    "step.penalties": ("BaseLearningPenalty", "ElasticLearningPenalty", "NoLearningPenalty"),
    "running.runner": ("GraphRunner", "TrainingRunner"),
    "step.train_step": ("StateSlot", "TrainStep"),
}

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'onnxgrad.training' has no attribute {name!r}")
    from onnxgrad._runtime import import_onnxruntime

    import_onnxruntime()
    value = getattr(importlib.import_module(f"onnxgrad.training.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
