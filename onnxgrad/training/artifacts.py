"""On-device training artifacts: a model prepared once, fine-tuned by any inference runtime.

:func:`generate_artifacts` (the names of onnxruntime's on-device training API) writes into
one folder:

* ``training_model.onnx``: the fused train step (:func:`make_train_step`), standard ONNX
  operators only. Its inputs are exactly the batch (features, label), the trained weights,
  the optimizer state and the scalar learning rate; its outputs the loss (summed over the
  batch by default), the new weights and the new state. Frozen weights are initializers of
  the graph. A runtime trains by calling it in a loop and feeding each new weight and state
  back to its input;
* ``eval_model.onnx``: the loss of a batch, the trained weights as inputs;
* ``inference_model.onnx``: the user's model (same inputs and outputs), initial weights;
* ``checkpoint.json`` + ``checkpoint.bin``: the initial weights and optimizer state
  (:mod:`onnxgrad.training.checkpoint`, readable without onnx or numpy);
* ``artifacts.json``: which input receives which output, the learning rate, the roles.

:func:`merge_checkpoint` puts a trained checkpoint back into the inference model (merging
low-rank adapters, :func:`onnxgrad.graph.lora.add_lora`), ready to deploy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from onnx import ModelProto

from onnxgrad._files import save_model, write_atomically
from onnxgrad._onnx_utils import ModelLike, load_model, np_dtype
from onnxgrad.graph import get_train_initializer, replace_initializers_into_onnx
from onnxgrad.graph.lora import lora_adapters, merge_lora
from onnxgrad.training.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from onnxgrad.training.composition import LossModel, make_eval_step, make_train_step
from onnxgrad.training.learning_rate import BaseLearningRate, learning_rate_from_name
from onnxgrad.training.losses import BaseLearningLoss, select_learning_loss
from onnxgrad.training.train_step import StateSlot, TrainStep

TRAINING_MODEL = "training_model.onnx"
EVAL_MODEL = "eval_model.onnx"
INFERENCE_MODEL = "inference_model.onnx"
CHECKPOINT = "checkpoint.json"
MANIFEST = "artifacts.json"
FORMAT = "onnxgrad.artifacts"
VERSION = 1


@dataclass(frozen=True)
class TrainingArtifacts:
    """What :func:`generate_artifacts` wrote in :attr:`directory`, and the objects behind it."""

    directory: Path
    train_step: TrainStep
    eval_step: LossModel
    inference_model: ModelProto
    checkpoint: Checkpoint
    #: the learning rate the runtimes are advised to feed (constant)
    learning_rate: float

    def path(self, name: str) -> Path:
        return self.directory / name


def generate_artifacts(
    model: ModelLike,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: str | BaseLearningLoss = "squared_error",
    optimizer: str | BaseLearningRate = "adam",
    artifact_directory: str | os.PathLike | None = None,
    *,
    learning_rate: float | None = None,
    output: str | None = None,
    folder: str | os.PathLike | None = None,
) -> TrainingArtifacts:
    """Write the on-device training artifacts of ``model`` (see the module docstring).

    :param requires_grad: the weights to train (default: every trainable initializer,
        :func:`onnxgrad.get_train_initializer`, but ``frozen_params``; only the low-rank
        adapters of a model rewritten by :func:`onnxgrad.graph.lora.add_lora`)
    :param frozen_params: weights kept constant, folded into the graphs as initializers
    :param loss: a name of the loss table (``'squared_error'``, ``'absolute_error'``,
        ``'log_logits'``, ``'cross_entropy_logits'``..., :mod:`onnxgrad.graph.loss_table`)
        or a loss object, put on ``output`` (default: the first float output)
    :param optimizer: ``'sgd'``, ``'momentum'``, ``'nesterov'``, ``'adam'`` or an optimizer
        object; its update (and state) is part of the train step
    :param learning_rate: the constant rate written in ``artifacts.json`` (default: the
        optimizer's ``eta0``); the runtime feeds it, so it can change it at every step
    :param artifact_directory: the folder to write (created if missing; ``folder`` is
        another name for it)
    """
    directory = _directory(artifact_directory, folder)
    model = load_model(model)
    weights = _trained_weights(model, requires_grad, frozen_params)
    loss_object = select_learning_loss(loss)
    optimizer_object = _optimizer(optimizer, learning_rate)
    lr = float(learning_rate if learning_rate is not None else optimizer_object.eta0)
    step = make_train_step(
        model, weights, loss=loss_object, learning_rate=optimizer_object, output=output
    )
    evaluation = make_eval_step(model, weights, loss=loss_object, output=output)
    initial = get_train_initializer(model)
    checkpoint = Checkpoint(
        weights={w: initial[w][0] for w in step.weights},
        optimizer_state=step.initial_state(),
    )
    directory.mkdir(parents=True, exist_ok=True)
    save_model(step.model, directory / TRAINING_MODEL)
    save_model(evaluation.model, directory / EVAL_MODEL)
    save_model(model, directory / INFERENCE_MODEL)
    save_checkpoint(checkpoint, directory / CHECKPOINT)
    manifest = _manifest(step, evaluation, lr, loss_object, optimizer_object, model)
    _write_json(directory / MANIFEST, manifest)
    return TrainingArtifacts(directory, step, evaluation, model, checkpoint, lr)


def load_train_step(artifact_directory: str | os.PathLike) -> TrainStep:
    """The :class:`TrainStep` of saved artifacts, to run ``training_model.onnx`` with the
    Python :class:`~onnxgrad.training.runner.TrainingRunner`."""
    directory = Path(artifact_directory)
    manifest = read_manifest(directory)
    train = manifest["train"]
    slots = {
        s["input"]: StateSlot(
            suffix=s["suffix"],
            weight=s["weight"],
            shared=s["shared"],
            shape=tuple(s["shape"]),
            initial=s["initial"],
            elem_type=s["elem_type"],
        )
        for s in train["state"]
    }
    return TrainStep(
        model=load_model(directory / manifest["training_model"]),
        features=tuple(train["features"]),
        label=train["label"],
        sample_weight=None,
        weights=tuple(w["input"] for w in train["weights"]),
        weight_shapes={w["input"]: tuple(w["shape"]) for w in train["weights"]},
        new_weights=tuple(w["output"] for w in train["weights"]),
        state=tuple(slots),
        new_state=tuple(s["output"] for s in train["state"]),
        state_slots=slots,
        learning_rate=train["learning_rate"],
        loss=train["loss"],
        layout="per_weight",
    )


def read_manifest(artifact_directory: str | os.PathLike) -> dict:
    """The ``artifacts.json`` of an artifact folder, checked."""
    path = Path(artifact_directory) / MANIFEST
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist: not an artifact folder")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{str(path)!r} is not an {FORMAT} manifest of version {VERSION}")
    return manifest


def merge_checkpoint(model: ModelLike, checkpoint: Checkpoint | str | os.PathLike) -> ModelProto:
    """The deployable model: ``model`` (the inference model, or an artifact folder) with
    the weights of ``checkpoint`` (or the path of its ``.json``), low-rank adapters merged
    into their weights (:func:`onnxgrad.graph.lora.merge_lora`)."""
    if isinstance(model, (str, os.PathLike)) and Path(model).is_dir():
        model = Path(model) / INFERENCE_MODEL
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = load_checkpoint(checkpoint)
    model = load_model(model)
    initializers = {init.name for init in model.graph.initializer}
    unknown = sorted(set(checkpoint.weights) - initializers)
    if unknown:
        raise ValueError(f"checkpoint weights {unknown} are not initializers of the model")
    merged = replace_initializers_into_onnx(model, checkpoint.weights)
    return merge_lora(merged)


def _directory(artifact_directory, folder) -> Path:
    if artifact_directory is not None and folder is not None:
        raise TypeError("give artifact_directory or folder, not both")
    chosen = artifact_directory if artifact_directory is not None else folder
    if chosen is None:
        raise TypeError("generate_artifacts needs artifact_directory, the folder to write")
    directory = Path(chosen)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{str(directory)!r} exists and is not a folder")
    return directory


def _trained_weights(model, requires_grad, frozen_params) -> list[str]:
    for what, names in (("requires_grad", requires_grad), ("frozen_params", frozen_params)):
        if isinstance(names, str):
            raise TypeError(f"{what} must be a list of names, not the string {names!r}")
    frozen = list(frozen_params or ())
    initializers = {init.name for init in model.graph.initializer}
    unknown = sorted(set(frozen) - initializers)
    if unknown:
        raise ValueError(f"frozen_params {unknown} are not initializers of the model")
    if requires_grad is not None:
        both = sorted(set(requires_grad) & set(frozen))
        if both:
            raise ValueError(f"weights {both} are in both requires_grad and frozen_params")
        return list(requires_grad)
    adapters = lora_adapters(model)
    if adapters:
        candidates = [name for a in adapters for name in (a["a"], a["b"])]
    else:
        candidates = list(get_train_initializer(model))
    weights = [w for w in candidates if w not in set(frozen)]
    if not weights:
        raise ValueError("every weight is frozen: nothing to train")
    return weights


def _optimizer(optimizer, learning_rate) -> BaseLearningRate:
    if isinstance(optimizer, BaseLearningRate):
        optimizer.check()
        return optimizer
    if not isinstance(optimizer, str):
        raise TypeError(f"optimizer must be a name or an optimizer object, got {optimizer!r}")
    return learning_rate_from_name(optimizer, eta0=learning_rate, schedule="constant")


def _manifest(step, evaluation, lr, loss, optimizer, model) -> dict:
    lr_type = next(i for i in step.model.graph.input if i.name == step.learning_rate)
    outputs = [o.name for o in model.graph.output]
    return {
        "format": FORMAT,
        "version": VERSION,
        "training_model": TRAINING_MODEL,
        "eval_model": EVAL_MODEL,
        "inference_model": INFERENCE_MODEL,
        "checkpoint": CHECKPOINT,
        "learning_rate": {
            "value": lr,
            "dtype": np_dtype(lr_type.type.tensor_type.elem_type).name,
        },
        "loss_function": {"class": type(loss).__name__, **loss.get_params(deep=False)},
        "optimizer": {"class": type(optimizer).__name__, **optimizer.get_params(deep=False)},
        "train": {
            "features": list(step.features),
            "label": step.label,
            "learning_rate": step.learning_rate,
            "loss": step.loss,
            "weights": [
                {"input": w, "output": new, "shape": list(step.weight_shapes[w])}
                for w, new in zip(step.weights, step.new_weights)
            ],
            "state": [
                {
                    "input": name,
                    "output": new,
                    "suffix": slot.suffix,
                    "weight": slot.weight,
                    "shared": slot.shared,
                    "shape": list(slot.shape),
                    "initial": slot.initial,
                    "elem_type": slot.elem_type,
                }
                for (name, slot), new in zip(step.state_slots.items(), step.new_state)
            ],
        },
        "eval": {
            "features": list(evaluation.features),
            "label": evaluation.label,
            "weights": list(evaluation.weights),
            "loss": evaluation.loss,
        },
        "inference": {
            "inputs": [i.name for i in model.graph.input if i.name not in _initializers(model)],
            "outputs": outputs,
        },
        "lora": lora_adapters(model),
    }


def _initializers(model: ModelProto) -> set[str]:
    return {init.name for init in model.graph.initializer}


def _write_json(path: Path, value: dict) -> None:
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(value, indent=1)))


__all__ = [
    "TrainingArtifacts",
    "generate_artifacts",
    "load_train_step",
    "merge_checkpoint",
    "read_manifest",
]
