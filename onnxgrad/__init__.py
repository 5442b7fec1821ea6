"""onnxgrad: turn ONNX models into trainable and differentiable graphs, and train them.

Layers, each importing only from the ones before it:

* :mod:`onnxgrad.graph` — pure rewrites ``ModelProto -> ModelProto``;
* :mod:`onnxgrad.functions` — small fixed graphs authored with onnxscript;
* :mod:`onnxgrad.derivative` — ``onnx_derivative`` with the native and ORT backends;
* :mod:`onnxgrad.training` — fused train steps, the runner and sklearn-style estimators.

``import onnxgrad`` loads none of them: each public name below is imported from its
subpackage on first use (PEP 562), so the rewrites and the native derivative never load
onnxruntime, and nothing loads onnxscript, networkx or matplotlib before it is needed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: subpackage -> the public names it defines; ``tests/test_import.py`` checks this table
#: against each subpackage's ``__all__``.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "onnxgrad.exceptions": ("ConvergenceError", "ConvergenceWarning", "NotFittedError"),
    "onnxgrad.plotting": ("plot_onnxs", "to_dot"),
    "onnxgrad.graph": (
        "add_initializer",
        "add_loss_output",
        "add_lora",
        "get_train_initializer",
        "lower_ml_operators",
        "merge_lora",
        "onnx_rename_weights",
        "onnx_simple_text_plot",
        "remove_unused_nodes",
        "replace_initializers_into_onnx",
        "select_model_inputs_outputs",
        "unreduced_onnx_loss",
    ),
    "onnxgrad.functions": ("function_onnx_graph", "get_supported_functions"),
    "onnxgrad.derivative": (
        "DerivativeOptions",
        "onnx_derivative",
        "onnx_hvp",
        "onnx_jacobian",
        "onnx_jvp",
    ),
    "onnxgrad.training": (
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
        "get_ort_device_from_session",
        "get_ort_device_type",
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
        "provider_to_device",
        "save_checkpoint",
        "weights_as_inputs",
        "with_batch_indices",
    ),
}

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *_MODULE_OF]


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'onnxgrad' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
