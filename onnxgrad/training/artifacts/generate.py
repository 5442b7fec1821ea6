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
* ``inference_model.onnx``: the user's model as given (same inputs, outputs and operators:
  fused, float16, quantized and converter forms kept, low-rank adapters beside their
  weights), initial weights: nothing that exists for training (lowered operators,
  straight-through terms, stop-gradients) reaches it;
* ``checkpoint.json`` + ``checkpoint.bin``: the initial weights and optimizer state
  (:mod:`onnxgrad.training.artifacts.checkpoint`, readable without onnx or numpy);
* ``artifacts.json``: which input receives which output, the learning rate, the roles, and
  the SHA-256 digest of every other file (loaders refuse a folder that does not match);
* ``data.json`` + ``data.bin``: training data for the JavaScript example, when given.

The folder is written as a unit (:func:`onnxgrad._folders.replace_folder`): a new folder
beside it, swapped in once complete, so no reader ever sees two runs' files mixed.

:func:`merge_checkpoint` puts a trained checkpoint back into the inference model (merging
low-rank adapters, :func:`onnxgrad.graph.lora.add_lora`), ready to deploy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import ModelProto

from onnxgrad._external_data import load_external_data
from onnxgrad._files import is_data_file_of, save_model, write_atomically
from onnxgrad._folders import replace_folder
from onnxgrad._onnx_utils import (
    PROTOBUF_LIMIT,
    ModelLike,
    check_external_data_loaded,
    checker_knows,
    finalize_model,
    first_float_output,
    header_only,
    load_model,
    model_from_bytes,
    np_dtype,
    onnx_errors_as_value_errors,
    protobuf_failures_as_memory_errors,
)
from onnxgrad._untrusted import read_bounded
from onnxgrad.derivative.recompute import TRAINING_RECOMPUTE
from onnxgrad.graph.initializers import train_initializer_names
from onnxgrad.graph.lora import QUANTIZED_MODES, lora_adapters, merge_lora
from onnxgrad.normalize import normalized_model
from onnxgrad.normalize.ste import quantized_activations as rounding
from onnxgrad.normalize.trained import trained_model
from onnxgrad.training.artifacts.checkpoint import (
    ARTIFACT_CHECKPOINT,
    OPTIMIZER_STATE,
    WEIGHTS,
    Checkpoint,
    TensorWriter,
    checkpoint_shapes,
    load_checkpoint,
    save_manifest,
    save_tensors,
)
from onnxgrad.training.artifacts.manifest import (
    FORMAT,
    MANIFEST,
    VERSION,
    checked_train,
    file_digests,
    read_artifacts,
    read_manifest,
)
from onnxgrad.training.artifacts.shared_weights import (
    SharedWeights,
    merged_in_place,
    tensor_view,
)
from onnxgrad.training.artifacts.webgpu import (
    check_target,
    check_webgpu_model,
    recompute_for,
    sums_as_adds,
)
from onnxgrad.training.step._weights import no_weight_error, weights_reaching
from onnxgrad.training.step.composition import (
    LossModel,
    make_loss_model,
    train_step_of_loss,
    weights_as_inputs,
)
from onnxgrad.training.step.learning_rate import BaseLearningRate, learning_rate_from_name
from onnxgrad.training.step.losses import BaseLearningLoss, select_learning_loss
from onnxgrad.training.step.master_weights import as_stored
from onnxgrad.training.step.train_step import StateSlot, TrainStep

TRAINING_MODEL = "training_model.onnx"
EVAL_MODEL = "eval_model.onnx"
INFERENCE_MODEL = "inference_model.onnx"
CHECKPOINT = ARTIFACT_CHECKPOINT
CHECKPOINT_DATA = "checkpoint.bin"
DATA = "data.json"
_MODELS = (TRAINING_MODEL, EVAL_MODEL, INFERENCE_MODEL)
#: Every name an artifact folder may hold (a folder holding others is not replaced).
KNOWN_FILES = frozenset(
    {MANIFEST, CHECKPOINT, CHECKPOINT_DATA, DATA, "data.bin"}
    | {name + suffix for name in _MODELS for suffix in ("", ".data")}
)


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


@protobuf_failures_as_memory_errors()
@onnx_errors_as_value_errors()
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
    data: tuple[np.ndarray, np.ndarray] | None = None,
    loss_scale: str | float | None = "auto",
    recompute: str | Sequence[str] | None = TRAINING_RECOMPUTE,
    quantized_activations: str = "straight_through",
    target: str = "cpu",
) -> TrainingArtifacts:
    """Write the on-device training artifacts of ``model`` (see the module docstring).

    :param requires_grad: the weights to train (default: every trainable initializer,
        :func:`onnxgrad.get_train_initializer`, but ``frozen_params``, that reaches
        ``output``; only the low-rank adapters of a model rewritten by
        :func:`onnxgrad.graph.lora.add_lora`)
    :param frozen_params: weights kept constant, folded into the graphs as initializers
    :param loss: a name of the loss table (``'squared_error'``, ``'absolute_error'``,
        ``'log_logits'``, ``'cross_entropy_logits'``..., :mod:`onnxgrad.graph.loss_table`)
        or a loss object, put on ``output`` (default: the first float output)
    :param optimizer: ``'sgd'``, ``'momentum'``, ``'nesterov'``, ``'adam'`` or an optimizer
        object; its update (and state) is part of the train step
    :param learning_rate: the constant rate written in ``artifacts.json`` (default: the
        optimizer's ``eta0``); the runtime feeds it, so it can change it at every step
    :param artifact_directory: the folder to write (created with its parents if missing,
        replaced as a whole if it holds an earlier run's artifacts; ``folder`` is another
        name for it)
    :param data: ``(X, y)`` written as ``data.json`` for the JavaScript example
    :param loss_scale: loss scaling of :func:`make_train_step` (default ``'auto'``: dynamic,
        its scale and count of finite steps part of the optimizer state, for a model
        computing in float16; :mod:`onnxgrad.training.step.loss_scaling`)
    :param recompute: forward values the train step's backward recomputes (default
        ``"attention"``: large attentions in tiles; ``"auto"``, block patterns or ``None``,
        see :func:`onnxgrad.onnx_derivative`)
    :param quantized_activations: ``"straight_through"`` (default) or ``"exact"``, as
        :func:`onnxgrad.onnx_derivative`
    :param target: ``'cpu'`` or ``'webgpu'``: artifacts whose every node has a kernel in
        onnxruntime-web's WebGPU provider (the attention untiled, no control flow;
        :mod:`onnxgrad.training.artifacts.webgpu`)
    """
    recompute = recompute_for(check_target(target), recompute)
    directory = _directory(artifact_directory, folder)
    # the inference model is the model as given: the caller's own message is only read
    deployed = model if isinstance(model, ModelProto) else load_model(model)
    with rounding(quantized_activations):
        model = normalized_model(deployed)
    weights = _trained_weights(model, requires_grad, frozen_params, output)
    loss_object = select_learning_loss(loss)
    optimizer_object = _optimizer(optimizer, learning_rate)
    lr = float(learning_rate if learning_rate is not None else optimizer_object.eta0)
    adapters = lora_adapters(model)
    # the browser fetches a model's bytes alone; a merge of the folder reads no shared data
    sharing = target != "webgpu" and merged_in_place(deployed, weights)
    pending, built = [model], {}  # fill takes the normalised model over: no copy of it
    del model

    def fill(folder: Path) -> None:
        lm = make_loss_model.normalized(pending.pop(), loss_object, weights=weights, output=output)
        evaluation = _eval_step(lm)
        shared = SharedWeights(deployed if sharing else ModelProto(), CHECKPOINT_DATA)
        step, digests = _write_checkpoint_and_step(
            folder, lm, optimizer_object, step_options, shared
        )
        del lm  # the forward model and its trained weights go
        if target == "webgpu":
            for role, graph in (("train step", step.model), ("eval", evaluation.model)):
                sums_as_adds(graph.graph)
                check_webgpu_model(graph, role)
        save_model(step.model, folder / TRAINING_MODEL, digests)
        save_model(evaluation.model, folder / EVAL_MODEL, digests)
        save_model(deployed, folder / INFERENCE_MODEL, digests, external=shared.references)
        if data is not None:
            _save_data(step, *data, folder / DATA)
        roles = (loss_object, optimizer_object, adapters)
        manifest = _manifest(step, evaluation, lr, *roles, deployed)
        manifest["files"] = _folder_digests(folder, digests)
        _write_json(folder / MANIFEST, manifest)
        built.update(step=step, evaluation=evaluation)

    step_options = {"loss_scale": loss_scale, "recompute": recompute}
    replace_folder(directory, fill, KNOWN_FILES)
    step, evaluation = built["step"], built["evaluation"]
    # the initial weights as views of the checkpoint written, the constant state as
    # broadcast views of its value: no copy in memory (nor address space for the state)
    weights = load_checkpoint(directory / CHECKPOINT, mapped=True, weights_only=True).weights
    checkpoint = Checkpoint(weights, _constant_state(step))
    return TrainingArtifacts(directory, step, evaluation, deployed, checkpoint, lr)


def _constant_state(step: TrainStep) -> dict[str, np.ndarray]:
    """The initial optimizer state, each a read-only view of its one value."""
    state = {}
    for name, slot in step.state_slots.items():
        value = np.array(slot.initial, np_dtype(slot.elem_type))
        state[name] = np.broadcast_to(value, slot.shape)
    return state


def _write_checkpoint_and_step(
    folder: Path,
    lm: LossModel,
    optimizer: BaseLearningRate,
    options: dict,
    shared: SharedWeights,
) -> tuple[TrainStep, dict]:
    """Build the train step of ``lm`` (taking it over) and write the checkpoint: the trained
    weights streamed from ``lm`` before the build turns them into inputs (each offered to
    ``shared``), the optimizer state after (zeros as holes). Returns the step and ``{file
    name: digest}``."""
    with TensorWriter(folder / CHECKPOINT_DATA) as checkpoint:
        initializers = {init.name: init for init in lm.model.graph.initializer}
        for name in lm.weights:
            array = tensor_view(initializers[name])
            shared.offer(initializers[name], checkpoint.add(name, WEIGHTS, array), array.nbytes)
            del array
        del initializers
        step = train_step_of_loss(lm, optimizer, **options)
        for name, slot in step.state_slots.items():
            dtype = np_dtype(slot.elem_type)
            checkpoint.add_filled(name, OPTIMIZER_STATE, dtype, slot.shape, slot.initial)
    written = [e["name"] for e in checkpoint.manifest["tensors"] if e["group"] == WEIGHTS]
    if written != list(step.weights):  # the format lists them in the order of the inputs
        raise AssertionError(f"checkpoint weights {written} != the train step's {step.weights}")
    save_manifest(checkpoint.manifest, folder / CHECKPOINT)
    return step, {CHECKPOINT_DATA: checkpoint.digest()}


def _folder_digests(folder: Path, known: dict) -> dict:
    """The digest of every file of ``folder`` by name: ``known`` (hashed as written), the
    others read."""
    names = sorted(p.name for p in folder.iterdir())
    read = file_digests(folder, [name for name in names if name not in known])
    return {name: known.get(name) or read[name] for name in names}


def _eval_step(lm: LossModel) -> LossModel:
    """The eval step of a loss model: its trained weights as inputs (a copy without their
    data; ``lm`` is left whole for the train step)."""
    return dataclasses.replace(lm, model=weights_as_inputs(lm.model, lm.weights))


def _save_data(step: TrainStep, X: np.ndarray, y: np.ndarray, path: Path) -> None:
    """The training data, one tensor per data input of the step (a 1-D ``y`` as a column
    when the label is 2-D)."""
    label = next(i for i in step.model.graph.input if i.name == step.label)
    if np.ndim(y) == 1 and len(label.type.tensor_type.shape.dim) == 2:
        y = np.reshape(y, (-1, 1))
    save_tensors({step.features[0]: X, step.label: y}, path)


def load_train_step(artifact_directory: str | os.PathLike) -> TrainStep:
    """The :class:`TrainStep` of saved artifacts, to run ``training_model.onnx`` with the
    Python :class:`~onnxgrad.training.running.runner.TrainingRunner`.

    The folder may come from elsewhere: every file is read once and its digest checked on
    the bytes read, which are the bytes loaded (:func:`read_artifacts`); every field of
    ``train`` is type-checked, and the shapes it declares must be those of the weights in
    its checkpoint (a state slot: its weight's, or one element when shared) and of the
    training model's inputs, so no declared shape drives an allocation."""
    directory = Path(artifact_directory)
    manifest, files = read_artifacts(directory, _loaded_files)
    train = checked_train(manifest, directory / MANIFEST)
    sizes = {name: listed["bytes"] for name, listed in manifest["files"].items()}
    checkpoint = directory / manifest["checkpoint"]
    saved = checkpoint_shapes(checkpoint, files[checkpoint.name], sizes)
    weight_shapes = _checked_weight_shapes(train, saved, directory)
    training_model = directory / manifest["training_model"]
    model = model_from_bytes(files[manifest["training_model"]], training_model, files)
    slots = {
        s["input"]: StateSlot(
            suffix=s["suffix"],
            weight=s["weight"],
            shared=s["shared"],
            shape=_checked_slot_shape(s, weight_shapes, directory),
            initial=s["initial"],
            elem_type=s["elem_type"],
        )
        for s in train["state"]
    }
    declared = {**weight_shapes, **{name: slot.shape for name, slot in slots.items()}}
    _check_model_inputs(model, declared, training_model)
    return TrainStep(
        model=model,
        features=tuple(train["features"]),
        label=train["label"],
        sample_weight=None,
        weights=tuple(w["input"] for w in train["weights"]),
        weight_shapes=weight_shapes,
        new_weights=tuple(w["output"] for w in train["weights"]),
        state=tuple(slots),
        new_state=tuple(s["output"] for s in train["state"]),
        state_slots=slots,
        learning_rate=train["learning_rate"],
        loss=train["loss"],
        layout="per_weight",
    )


def _checked_weight_shapes(train: dict, saved: dict, directory: Path) -> dict:
    shapes = {w["input"]: tuple(w["shape"]) for w in train["weights"]}
    if shapes != saved:
        raise ValueError(
            f"{str(directory / MANIFEST)!r} declares weights {shapes}, its checkpoint holds {saved}"
        )
    return shapes


def _loaded_files(manifest: dict) -> set[str]:
    """The files :func:`load_train_step` loads: the training model with its external data,
    and the checkpoint's manifest (its data is only digested)."""
    return {*_model_files(manifest, "training_model"), Path(manifest["checkpoint"]).name}


def _model_files(manifest: dict, entry: str) -> set[str]:
    """The listed files of the model ``manifest[entry]``: it and its external data."""
    model = manifest[entry]
    data = {n for n in manifest["files"] if is_data_file_of(n, model) or n == f"{model}.data"}
    return {model, *data}


def _check_model_inputs(model: ModelProto, shapes: dict, path: Path) -> None:
    """``ValueError`` naming a weight or state the training model has no input for, or whose
    input's declared shape differs from the manifest's and checkpoint's."""
    inputs = {i.name: i for i in model.graph.input}
    for name, shape in shapes.items():
        if name not in inputs:
            raise ValueError(f"{str(path)!r} has no input {name!r}, which {MANIFEST} trains")
        dims = inputs[name].type.tensor_type.shape.dim
        declared = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        if len(declared) != len(shape) or any(
            d is not None and d != s for d, s in zip(declared, shape, strict=True)
        ):
            raise ValueError(
                f"{str(path)!r}: input {name!r} is declared {declared}, {MANIFEST} and the "
                f"checkpoint give {list(shape)}"
            )


def _checked_slot_shape(slot: dict, weight_shapes: dict, directory: Path) -> tuple[int, ...]:
    shape = tuple(slot["shape"])
    shared = slot["shared"]
    expected = None if shared else weight_shapes.get(slot["weight"])
    if (shared and math.prod(shape) != 1) or (not shared and shape != expected):
        raise ValueError(
            f"{str(directory / MANIFEST)!r}: state {slot['input']!r} has shape {list(shape)}, "
            f"expected {'one element' if shared else expected} (weight {slot['weight']!r})"
        )
    return shape


@protobuf_failures_as_memory_errors()
@onnx_errors_as_value_errors()
def merge_checkpoint(
    model: ModelLike,
    checkpoint: Checkpoint | str | os.PathLike,
    quantized: str = "keep",
    integer_branch: bool = False,
) -> ModelProto:
    """The deployable model: ``model`` (the inference model, or an artifact folder) with
    the weights of ``checkpoint`` (or the path of its ``.json``), low-rank adapters merged
    into their weights (:func:`onnxgrad.graph.lora.merge_lora`; ``quantized="keep"`` leaves
    the adapters of quantized weights beside their base, ``"requantize"`` folds them and
    quantizes the base again in its own format), float32 master weights rounded to their
    float16 or bfloat16 initializers. A model given in its own
    form (a converted model with ``ai.onnx.ml`` operators, weights held by ``Constant``
    nodes) keeps it, its weights trained (:func:`onnxgrad.normalize.trained.trained_model`).
    ``integer_branch`` goes to :func:`~onnxgrad.graph.lora.merge_lora` (adapters kept beside
    ``quantize_dynamic`` products computing ``x A`` from the codes of ``x``)."""
    if quantized not in QUANTIZED_MODES:
        raise ValueError(f"quantized must be one of {QUANTIZED_MODES}, got {quantized!r}")
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = load_checkpoint(checkpoint, mapped=True, weights_only=True)  # views
    model, trained, load_rest = _inference_model(model, set(checkpoint.weights))
    checkpoint = Checkpoint(as_stored(model, checkpoint.weights), checkpoint.optimizer_state)
    if trained is not None and set(checkpoint.weights) != trained:
        raise ValueError(
            f"the checkpoint holds weights {sorted(checkpoint.weights)}, the artifacts train "
            f"{sorted(trained)}: a checkpoint of other artifacts?"
        )
    if not merged_in_place(model, checkpoint.weights):
        load_rest()
        trained = trained_model(model, checkpoint.weights)  # named as normalised
        return merge_lora(trained, quantized=quantized, integer_branch=integer_branch)
    del load_rest  # an artifact folder's bytes go
    _check_matches(checkpoint, model)
    weights = checkpoint.weights
    del checkpoint  # the weights go as they are merged
    merged = _with_weights(model, weights)
    if not lora_adapters(merged):
        return merged
    return merge_lora(merged, quantized=quantized, integer_branch=integer_branch)


def _inference_model(model: ModelLike, replaced: set[str]):
    """``(model, trained, load_rest)``: the model to merge into (a ModelProto given is only
    read; a file or an artifact folder's inference model is loaded without the external
    data of the initializers ``replaced``), the weights an artifact folder trains (None for
    a model), and a function loading the data left out."""
    if isinstance(model, ModelProto):
        check_external_data_loaded(model)
        return model, None, lambda: None
    if not isinstance(model, (str, os.PathLike)):
        return load_model(model), None, lambda: None  # the TypeError naming it
    folder = Path(model)
    trained, files = None, None
    if folder.is_dir():
        manifest, files = read_artifacts(folder, lambda m: _model_files(m, "inference_model"))
        trained = {w["input"] for w in checked_train(manifest, folder)["weights"]}
        path = folder / manifest["inference_model"]
        data = files[path.name]  # the bytes digested
    else:
        path = folder
        if not path.exists():
            raise ValueError(f"model file {str(path)!r} does not exist")
        data = read_bounded(path, PROTOBUF_LIMIT, "model file")
    # an artifact folder's trained weights may point into its checkpoint: never read here
    skipped = replaced | (trained or set())
    loaded = model_from_bytes(data, path, files, skipped=skipped)
    return loaded, trained, lambda: load_external_data(loaded, path.parent, str(path), files)


def _with_weights(model: ModelProto, weights: dict[str, np.ndarray]) -> ModelProto:
    """A copy of ``model`` whose initializers ``weights`` hold these values, written one at
    a time and taken out of ``weights`` (their old data is never read: it may be left
    external); checked."""
    merged = header_only(model)
    for init in model.graph.initializer:
        tensor = merged.graph.initializer.add()
        if init.name not in weights:
            tensor.CopyFrom(init)
            continue
        tensor.name, tensor.data_type = init.name, init.data_type
        tensor.dims.extend(init.dims)
        array = weights.pop(init.name)  # a mapped view read: its pages go with it
        tensor.raw_data = np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()
    return finalize_model(merged, check=checker_knows(merged))


def _check_matches(checkpoint: Checkpoint, model: ModelProto) -> None:
    """``ValueError`` naming a checkpoint weight that is no initializer of ``model`` or
    differs from it in shape or element type."""
    initializers = {init.name: init for init in model.graph.initializer}
    unknown = sorted(set(checkpoint.weights) - set(initializers))
    if unknown:
        raise ValueError(f"checkpoint weights {unknown} are not initializers of the model")
    for name, value in checkpoint.weights.items():
        init = initializers[name]
        expected = (tuple(init.dims), np_dtype(init.data_type))
        if (value.shape, value.dtype) != expected:
            raise ValueError(
                f"checkpoint weight {name!r} is {value.dtype} {list(value.shape)}, the "
                f"model's initializer is {expected[1]} {list(expected[0])}"
            )


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


def _trained_weights(model, requires_grad, frozen_params, output) -> list[str]:
    """``requires_grad`` as given, else the trainable weights (the adapters of a LoRA model)
    but ``frozen_params`` that reach ``output`` (default: the first float one)."""
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
        candidates = train_initializer_names(model)
    if not candidates:
        raise no_weight_error(model)
    weights = [w for w in candidates if w not in set(frozen)]
    if not weights:
        raise ValueError(f"every weight is frozen by frozen_params {frozen}: nothing to train")
    target = output or first_float_output(model.graph)
    if target is None:
        return weights
    return list(weights_reaching(model, getattr(target, "name", target), weights))


def _optimizer(optimizer, learning_rate) -> BaseLearningRate:
    if isinstance(optimizer, BaseLearningRate):
        optimizer.check()
        return optimizer
    if not isinstance(optimizer, str):
        raise TypeError(f"optimizer must be a name or an optimizer object, got {optimizer!r}")
    return learning_rate_from_name(optimizer, eta0=learning_rate, schedule="constant")


def _manifest(step, evaluation, lr, loss, optimizer, adapters, deployed) -> dict:
    """``artifacts.json`` (``adapters``: the LoRA adapters of the normalised model,
    ``deployed``: the inference model, as given)."""
    lr_type = next(i for i in step.model.graph.input if i.name == step.learning_rate)
    outputs = [o.name for o in deployed.graph.output]
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
            "inputs": [
                i.name for i in deployed.graph.input if i.name not in _initializers(deployed)
            ],
            "outputs": outputs,
        },
        "lora": adapters,
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
