"""Composition: forward, loss, gradient, penalty and update fused into one ONNX graph.

Every function here is pure: it takes a model (``ModelProto`` or path), never modifies it,
and returns checker-valid models keeping the model's default-domain opset, so each graph
the runner executes can be inspected, saved and run by any onnxruntime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from onnx import ModelProto, TensorProto, helper

from onnxgrad._entries import normalizing
from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    NameScope,
    all_names,
    check_external_data_loaded,
    default_opset,
    finalize_model,
    first_float_output,
    load_model,
    np_dtype,
    tensor_nbytes,
    without_initializers,
)
from onnxgrad.derivative import DerivativeOptions
from onnxgrad.derivative.api import derive_in_place, graph_inputs
from onnxgrad.derivative.recompute import TRAINING_RECOMPUTE
from onnxgrad.graph.initializers import train_initializer_names
from onnxgrad.graph.loss import reshape_loss
from onnxgrad.graph.select import select_in_place
from onnxgrad.training.step._builder import StepBuilder, rename_values
from onnxgrad.training.step._inputs import check_batch_axis
from onnxgrad.training.step._weights import no_weight_error, weights_reaching
from onnxgrad.training.step.learning_rate import BaseLearningRate, LearningRateSGD
from onnxgrad.training.step.loss_scaling import (
    LossScaling,
    guard_update,
    resolve_loss_scale,
    scale_loss,
    unscale_gradients,
)
from onnxgrad.training.step.losses import BaseLearningLoss, SquareLearningLoss
from onnxgrad.training.step.master_weights import with_master_weights
from onnxgrad.training.step.node_order import place_after_producers
from onnxgrad.training.step.penalties import BaseLearningPenalty, NoLearningPenalty
from onnxgrad.training.step.train_step import DataRoles, TrainStep, append_update
from onnxgrad.training.step.update_gates import gate_updates


@dataclass(frozen=True)
class LossModel(DataRoles):
    """A model reduced to one scalar output ``loss`` with its data inputs named by role."""

    model: ModelProto
    features: tuple[str, ...]
    label: str
    sample_weight: str | None
    loss: str
    weights: tuple[str, ...]
    fixed: tuple[str, ...] = ()


@normalizing
def make_loss_model(
    model: ModelLike,
    loss: BaseLearningLoss | None = None,
    *,
    weights: Sequence[str] | None = None,
    output: str | None = None,
    penalty: BaseLearningPenalty | None = None,
    loss_output_name: str = "loss",
    label_name: str | None = None,
    weight_name: str | None = None,
    fixed_inputs: Sequence[str] = (),
) -> LossModel:
    """``model`` with one scalar output: the training loss (summed over the batch unless the
    loss object says ``reduction='mean'``), plus ``penalty``.

    :param loss: appended on ``output`` (default: the first float output) with new inputs
        for the label (``label_name``, default a free name starting with ``label``) and,
        when ``weight_name`` is given, per-sample weights. ``None``: the model already ends
        in a loss output ``loss_output_name`` with label input ``label_name`` (default
        ``'label'``) and sample-weight input ``weight_name`` (optional).
    :param weights: the trained initializers (default: the weights of
        :func:`onnxgrad.get_train_initializer` that reach the loss's output).
    :param fixed_inputs: inputs fed one value for every batch rather than one row per
        observation (:attr:`LossModel.fixed`; the other inputs are the features).

    The model is first made regular by :func:`onnxgrad.normalize.normalized_model`
    (``ai.onnx.ml`` operators lowered, opset 13 at least, weights stored as constants
    promoted to initializers). Trained float16 and bfloat16 weights become float32 master
    weights (:mod:`onnxgrad.training.step.master_weights`).
    """
    named = weights is not None
    weights = resolve_weights(model, weights)
    features = tuple(graph_inputs(model))
    if loss is None:
        label = label_name or "label"
        output = loss_output_name
        _check_existing_loss(model, loss_output_name, label, weight_name)
        if not named:
            weights = weights_reaching(model, output, weights)
        result = _existing_loss(model, loss_output_name, label, weight_name)
        features = tuple(n for n in features if n not in (label, weight_name))
    else:
        if not isinstance(loss, BaseLearningLoss):
            raise TypeError(f"loss must be a learning loss object or None, got {loss!r}")
        used = NameScope(all_names(model.graph))
        label = label_name or used.unique("label")
        loss_name = used.unique(loss_output_name)
        output = output or _first_float_output(model)
        if not named:
            weights = weights_reaching(model, output, weights)
        result = loss.build(model, output, loss_name, label, weight_name)  # takes `model` over
    fixed = _fixed_inputs(features, fixed_inputs)
    features = tuple(n for n in features if n not in fixed)
    result = with_master_weights(result, weights)
    _check_weight_types(result, weights)
    _share_batch_dim(result, [*features, label, weight_name])
    if penalty is not None:
        result = _add_penalty(result, penalty, weights)
    return LossModel(
        result,
        features=features,
        label=label,
        sample_weight=weight_name,
        loss=result.graph.output[0].name,
        weights=weights,
        fixed=fixed,
    )


@normalizing
def make_train_step(
    model: ModelLike,
    weights: Sequence[str] | None = None,
    *,
    loss: BaseLearningLoss | None = SquareLearningLoss(),  # noqa: B008
    learning_rate: BaseLearningRate | None = None,
    penalty: BaseLearningPenalty | None = None,
    output: str | None = None,
    loss_output_name: str = "loss",
    label_name: str | None = None,
    weight_name: str | None = None,
    backend: str = "onnx",
    layout: str = "per_weight",
    fixed_inputs: Sequence[str] = (),
    loss_scale: str | float | LossScaling | None = "auto",
    recompute: str | Sequence[str] | None = TRAINING_RECOMPUTE,
) -> TrainStep:
    """One ONNX graph running a whole optimisation step on a batch.

    ``loss_model = loss(f(x; W), y) + penalty(W)`` (see :func:`make_loss_model`), then
    ``G = dloss/dW`` by :func:`onnxgrad.onnx_derivative` (``backend``), then the update of
    ``learning_rate`` (default :class:`LearningRateSGD`): ``W', S' = update(W, G, S, lr)``,
    per weight tensor or on all of them end to end (``layout``, see
    :mod:`onnxgrad.training.step.train_step`).

    ``loss_scale``: ``'dynamic'`` scales the loss before the backward and skips steps whose
    gradients are not finite (:mod:`onnxgrad.training.step.loss_scaling`), a number is a static
    scale, ``None`` none; ``'auto'`` (default) is ``'dynamic'`` for a model computing in
    float16, else ``None``. ``recompute``: forward values the backward recomputes (see
    :func:`onnxgrad.onnx_derivative`; default ``'attention'``: large attentions in tiles,
    with ``backend='onnx'``).
    """
    learning_rate = checked_learning_rate(learning_rate)
    lm = make_loss_model.normalized(
        model,
        loss,
        weights=weights,
        output=output,
        penalty=penalty if penalty is not None else NoLearningPenalty(),
        loss_output_name=loss_output_name,
        label_name=label_name,
        weight_name=weight_name,
        fixed_inputs=fixed_inputs,
    )
    return train_step_of_loss(lm, learning_rate, backend, layout, loss_scale, recompute)


def train_step_of_loss(
    lm: LossModel,
    learning_rate: BaseLearningRate,
    backend: str = "onnx",
    layout: str = "per_weight",
    loss_scale: str | float | LossScaling | None = "auto",
    recompute: str | Sequence[str] | None = TRAINING_RECOMPUTE,
) -> TrainStep:
    """The train step of a loss model (:func:`make_loss_model`), which it takes over (the
    trained weights become inputs); the arguments as :func:`make_train_step`'s."""
    scaling = resolve_loss_scale(loss_scale, lm.model)
    scale = scale_loss(lm.model, lm.loss, scaling) if scaling else None
    trained_bytes = _initializer_bytes(lm.model, lm.weights)
    gradient = _compacted(loss_gradient(lm, backend, recompute, order_leaves=False), trained_bytes)
    if scaling:
        unscale_gradients(gradient, len(lm.weights), scale)
    roles = {
        "features": lm.features,
        "label": lm.label,
        "sample_weight": lm.sample_weight,
        "fixed": lm.fixed,
    }
    gradient_values = {o for node in gradient.graph.node for o in node.output}
    step = append_update(gradient, roles, lm.weights, learning_rate, layout)
    step = guard_update(step, scaling, scale) if scaling else step
    return _arranged_per_weight_update(step, gradient_values)


def _initializer_bytes(model: ModelProto, names: Sequence[str] | None = None) -> int:
    """The data size of the main-graph initializers ``names`` (default: all)."""
    chosen = None if names is None else set(names)
    return sum(
        tensor_nbytes(i) for i in model.graph.initializer if chosen is None or i.name in chosen
    )


def _compacted(model: ModelProto, dropped_bytes: int) -> ModelProto:
    """``model`` copied without the data its in-place rewrites dropped (``dropped_bytes``,
    the trained weights turned into inputs, which its arena still holds) when that frees
    more than the copy of what it keeps costs; else ``model`` itself."""
    if dropped_bytes <= _initializer_bytes(model):
        return model
    return without_initializers(model)


def _arranged_per_weight_update(step: TrainStep, gradient_values: set[str]) -> TrainStep:
    """A per-weight update made writable in place (each weight's update waits for the
    backward's reads of it, :mod:`~onnxgrad.training.step.update_gates`) and its nodes other than
    its leaves placed right after what they read
    (:func:`~onnxgrad.training.step.node_order.place_after_producers`), then checked once. The
    flat layout is left as it is: its weights are views of one vector only the update reads,
    and its ``Concat`` keeps its pieces in the order of readiness."""
    if step.layout != "per_weight":
        return step
    graph = step.model.graph
    gate_updates(graph, dict(zip(step.weights, step.new_weights)))
    place_after_producers(graph, lambda node: not gradient_values.intersection(node.output))
    return dataclasses.replace(step, model=finalize_model(step.model))


def checked_learning_rate(learning_rate: BaseLearningRate | None) -> BaseLearningRate:
    """``learning_rate`` (default :class:`LearningRateSGD`), checked."""
    learning_rate = learning_rate if learning_rate is not None else LearningRateSGD()
    if not isinstance(learning_rate, BaseLearningRate):
        raise TypeError(f"learning_rate must be an optimizer object, got {learning_rate!r}")
    learning_rate.check()
    return learning_rate


def loss_gradient(
    lm: LossModel, backend: str = "onnx", recompute=None, order_leaves: bool = True
) -> ModelProto:
    """``dloss/dW`` of a loss model (private and normalised, so derived in place) with
    respect to its weights: the gradient graph of the train step. The training entries'
    default ``recompute`` applies to ``backend='onnx'`` (onnxruntime-training builds its
    own graph). ``order_leaves=False`` for a gradient an update is appended to (the
    update's leaves then decide onnxruntime's order, and weight gradients moved to the end
    would only lengthen onnxruntime 1.19's sorts)."""
    if backend != "onnx" and recompute == TRAINING_RECOMPUTE:
        recompute = None
    return derive_in_place(
        lm.model,
        weights=list(lm.weights),
        inputs=[],
        options=DerivativeOptions.Loss,
        loss=lm.loss,
        label=lm.label,
        backend=backend,
        recompute=recompute,
        order_leaves=order_leaves,
    )


@normalizing
def make_eval_step(
    model: ModelLike,
    weights: Sequence[str] | None = None,
    *,
    loss: BaseLearningLoss | None = SquareLearningLoss(),  # noqa: B008
    output: str | None = None,
    loss_output_name: str = "loss",
    label_name: str | None = None,
    weight_name: str | None = None,
    penalty: BaseLearningPenalty | None = None,
    fixed_inputs: Sequence[str] = (),
) -> LossModel:
    """The loss of a batch (plus ``penalty``, none by default), without update; the
    weights are inputs."""
    lm = make_loss_model.normalized(
        model,
        loss,
        weights=weights,
        output=output,
        penalty=penalty,
        loss_output_name=loss_output_name,
        label_name=label_name,
        weight_name=weight_name,
        fixed_inputs=fixed_inputs,
    )
    return LossModel(
        weights_as_inputs(lm.model, lm.weights),
        lm.features,
        lm.label,
        lm.sample_weight,
        lm.loss,
        lm.weights,
        lm.fixed,
    )


def make_predict_model(model: ModelLike, weights: Sequence[str] | None = None) -> ModelProto:
    """``model`` with the trained ``weights`` turned into inputs (after its own inputs),
    float32 for float16 or bfloat16 weights (the master weights of the train step)."""
    model = load_model(model)
    weights = resolve_weights(model, weights)
    return weights_as_inputs(with_master_weights(model, weights, loss=False), weights)


def weights_as_inputs(model: ModelLike, weights: Sequence[str]) -> ModelProto:
    """A copy of ``model`` where the initializers ``weights`` are graph inputs instead (their
    data is not copied)."""
    if not isinstance(model, ModelProto):
        model = load_model(model)
    check_external_data_loaded(model)
    initializers = {init.name: init for init in model.graph.initializer}
    unknown = [w for w in weights if w not in initializers]
    if unknown:
        raise ValueError(f"unknown weights {unknown}: they are not initializers of the model")
    result = without_initializers(model, weights)
    listed = {i.name for i in result.graph.input}
    for name in weights:
        init = initializers[name]
        if name not in listed:
            result.graph.input.append(
                helper.make_tensor_value_info(name, init.data_type, init.dims)
            )
    return finalize_model(result)


def with_batch_indices(step: TrainStep, indices_name: str = "batch_indices") -> ModelProto:
    """The train step reading its batch from whole data sets: ``x[batch_indices]``.

    Each data input keeps its name but receives every observation; an int64 input
    ``indices_name`` selects the rows of the batch (``Gather`` on the first axis), so the
    data can stay on the device for the whole training. The data inputs must leave their
    first dimension free.
    """
    check_batch_axis(step.model, step.data_inputs)
    model = load_model(step.model)
    graph = model.graph
    b = StepBuilder(graph, default_opset(model))
    indices = b.input(indices_name, TensorProto.INT64, ["batch"])
    renamed = {name: b.names.unique(f"{name}_batch") for name in step.data_inputs}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
    gathers = []
    for name, batch in renamed.items():
        gathers.append(helper.make_node("Gather", [name, indices], [batch], axis=0, name=batch))
    graph.node.extend(gathers)
    batches = set(renamed.values())
    graph.node.sort(key=lambda node: not batches.intersection(node.output))
    return finalize_model(model)


def resolve_weights(model: ModelProto, weights: Sequence[str] | None) -> tuple[str, ...]:
    """The weights to train: checked names, or every weight of ``get_train_initializer``
    (:func:`make_loss_model` keeps those that reach the loss)."""
    if weights is None:
        found = tuple(train_initializer_names(model))
        if not found:
            raise no_weight_error(model)
        return found
    if isinstance(weights, str):
        raise TypeError(f"weights must be a list of names, not the string {weights!r}")
    names = tuple(weights)
    if not names:
        raise ValueError("weights is empty: nothing to train")
    initializers = {init.name: init for init in model.graph.initializer}
    unknown = [n for n in names if n not in initializers]
    if unknown:
        raise ValueError(
            f"unknown weights {unknown}: the model's initializers are {sorted(initializers)}"
        )
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"weights {duplicated} are listed more than once")
    not_float = [n for n in names if initializers[n].data_type not in FLOAT_TYPES]
    if not_float:
        raise ValueError(f"weights {not_float} are not float tensors and cannot be trained")
    return names


def _fixed_inputs(features: Sequence[str], fixed: Sequence[str]) -> tuple[str, ...]:
    if isinstance(fixed, str):
        raise TypeError(f"fixed_inputs must be a list of names, not the string {fixed!r}")
    unknown = [n for n in fixed if n not in features]
    if unknown:
        raise ValueError(f"fixed inputs {unknown} are not data inputs of the model {features}")
    fixed = tuple(fixed)
    if len(fixed) == len(features):
        raise ValueError(f"every data input {list(features)} is fixed: no input takes rows")
    return fixed


def _share_batch_dim(model: ModelProto, names: Sequence[str | None]) -> None:
    """Give the first dimension of every data input one symbolic name.

    The runner slices features, labels and sample weights with the same batch indices, so
    their first dimensions are equal; saying so lets shape inference prove that the
    prediction and the label have the same shape, and the gradient then needs no run-time
    reduction of broadcast axes.
    """
    inputs = [i for i in model.graph.input if i.name in set(names) - {None}]
    dims = [i.type.tensor_type.shape.dim[0] for i in inputs if i.type.tensor_type.shape.dim]
    if any(d.HasField("dim_value") for d in dims):
        return
    symbol = next((d.dim_param for d in dims if d.dim_param), "N")
    for dim in dims:
        dim.dim_param = symbol


def _first_float_output(model: ModelProto) -> str:
    info = first_float_output(model.graph)
    if info is not None:
        return info.name
    raise ValueError(
        f"the model has no float output to put a loss on: {[o.name for o in model.graph.output]}"
    )


def _check_existing_loss(
    model: ModelProto, loss_name: str, label: str, weight_name: str | None
) -> None:
    """``ValueError`` unless ``model`` has a float output ``loss_name`` and the inputs named."""
    outputs = [o.name for o in model.graph.output]
    if loss_name not in outputs:
        raise ValueError(
            f"loss output {loss_name!r} not found among the outputs {outputs}: "
            "add one with onnxgrad.add_loss_output"
        )
    inputs = graph_inputs(model)
    for role, name in (("label", label), ("sample weight", weight_name)):
        if name is not None and name not in inputs:
            raise ValueError(f"{role} input {name!r} not found among the inputs {inputs}")
    info = next(o for o in model.graph.output if o.name == loss_name)
    if info.type.tensor_type.elem_type not in FLOAT_TYPES:
        raise ValueError(f"loss output {loss_name!r} is not a float tensor")


def _existing_loss(
    model: ModelProto, loss_name: str, label: str, weight_name: str | None
) -> ModelProto:
    """``model`` (taken over) reduced to its loss output ``loss_name``, checked by
    :func:`_check_existing_loss`, its inputs kept in their order."""
    inputs = graph_inputs(model)
    selected = select_in_place(model, outputs=[loss_name])
    kept = {i.name for i in selected.graph.input}
    for name in (label, weight_name):
        if name is not None and name not in kept:
            raise ValueError(f"the loss output {loss_name!r} does not depend on input {name!r}")
    _reorder_inputs(selected, inputs)
    if _one_element(selected.graph.output[0]):  # onnxcustom's [1, 1] loss: the scalar
        reshape_loss(selected, loss_name, ())
    return selected


def _one_element(info) -> bool:
    """Whether ``info`` declares a shape of rank >= 1 whose dims are all 1."""
    dims = info.type.tensor_type.shape.dim
    return len(dims) > 0 and all(d.HasField("dim_value") and d.dim_value == 1 for d in dims)


def _reorder_inputs(model: ModelProto, order: Sequence[str]) -> None:
    position = {name: i for i, name in enumerate(order)}
    inputs = sorted(model.graph.input, key=lambda i: position.get(i.name, len(position)))
    del model.graph.input[:]
    model.graph.input.extend(inputs)


def _check_weight_types(model: ModelProto, weights: Sequence[str]) -> None:
    """Every trained weight must feed the loss (which kept only the initializers it uses)
    and share its element type."""
    loss = model.graph.output[0]
    loss_type = loss.type.tensor_type.elem_type
    types = {init.name: init.data_type for init in model.graph.initializer}
    unused = [w for w in weights if w not in types]
    if unused:
        raise ValueError(
            f"weights {unused} do not reach the loss output {loss.name!r}: they would get no "
            "gradient, leave them out of the trained weights"
        )
    mismatched = [w for w in weights if types[w] != loss_type]
    if mismatched:
        loss_dtype = np_dtype(loss_type)
        raise ValueError(
            f"weights {mismatched} do not have the loss dtype {loss_dtype}: the trained "
            "weights must all share the element type of the loss"
        )


def _add_penalty(
    model: ModelProto, penalty: BaseLearningPenalty, weights: Sequence[str]
) -> ModelProto:
    if not isinstance(penalty, BaseLearningPenalty):
        raise TypeError(f"penalty must be a learning penalty object or None, got {penalty!r}")
    graph = model.graph
    b = StepBuilder(graph, default_opset(model))
    loss_info = graph.output[0]
    elem_type = loss_info.type.tensor_type.elem_type
    term = penalty.emit(b, weights, elem_type)
    if term is None:
        return model
    data_loss = b.names.unique(f"{loss_info.name}_data")
    rename_values(graph, {loss_info.name: data_loss})
    b.op("Add", data_loss, term, out=loss_info.name)
    return finalize_model(model)


__all__ = [
    "LossModel",
    "make_eval_step",
    "make_loss_model",
    "make_predict_model",
    "make_train_step",
    "weights_as_inputs",
    "with_batch_indices",
]
