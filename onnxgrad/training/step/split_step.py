"""A train step in two graphs, gradient then update, for data-parallel training.

The fused step (:mod:`onnxgrad.training.step.train_step`) applies the update inside the graph
that computes the gradient; data-parallel training must sum the ranks' gradients in
between (:mod:`onnxgrad.training.running.distributed`), so the step is split there:

* the gradient graph: data and weights -> ``dL/dW`` of the data loss (no penalty), ``L``;
* the update graph (``'flat'`` layout): ``W``, the reduced gradients ``G``, the optimizer
  state, the learning rate -> ``W'``, ``S'``, ``P(W)``, with the penalty's gradient added
  once, after the reduction: ``W' = update(W, G + dP/dW, S, lr)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
from onnx import ModelProto, helper

from onnxgrad._entries import normalizing
from onnxgrad._onnx_utils import ModelLike, default_opset, finalize_model, np_dtype
from onnxgrad.derivative import DerivativeOptions, onnx_derivative
from onnxgrad.derivative.recompute import TRAINING_RECOMPUTE
from onnxgrad.training.step._builder import StepBuilder, inline_model
from onnxgrad.training.step.composition import (
    LossModel,
    checked_learning_rate,
    loss_gradient,
    make_loss_model,
)
from onnxgrad.training.step.learning_rate import BaseLearningRate
from onnxgrad.training.step.losses import BaseLearningLoss, SquareLearningLoss
from onnxgrad.training.step.penalties import BaseLearningPenalty, NoLearningPenalty
from onnxgrad.training.step.train_step import TrainStep, append_update


@dataclass(frozen=True)
class SplitStep(TrainStep):
    """A train step in two graphs, for an all-reduce between them.

    :attr:`gradient`: data inputs and weights -> ``<weight>_grad`` for each weight (the
    data loss only), then the loss. :attr:`model` (the :class:`TrainStep` part, ``'flat'``
    layout): the update, whose inputs :attr:`gradients` receive the reduced gradients; it
    adds the penalty's gradient, and its :attr:`~TrainStep.loss` output is the penalty.
    """

    gradient: ModelProto | None = None
    #: the update graph's inputs fed with the reduced gradients, in the order of the weights
    gradients: tuple[str, ...] = ()
    #: the loss's reduction over a batch, ``'sum'`` or ``'mean'`` (None: a loss the model
    #: computes, told apart on the data by
    #: :func:`onnxgrad.training.running.distributed.probe_reduction`)
    reduction: str | None = None

    @property
    def gradient_model(self) -> LossModel:
        """The gradient graph with its data roles."""
        return LossModel(
            self.gradient, self.features, self.label, self.sample_weight, "", self.weights
        )


@normalizing
def make_split_step(
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
    layout: str = "flat",
    fixed_inputs: Sequence[str] = (),
    recompute: str | Sequence[str] | None = TRAINING_RECOMPUTE,
) -> SplitStep:
    """The train step of :func:`~onnxgrad.training.make_train_step` (same arguments) split
    into a gradient graph and an update graph; the update runs on the flat weight vector."""
    if layout != "flat":
        raise ValueError(f"a split step updates the flat weight vector, not layout {layout!r}")
    learning_rate = checked_learning_rate(learning_rate)
    lm = make_loss_model.normalized(
        model,
        loss,
        weights=weights,
        output=output,
        loss_output_name=loss_output_name,
        label_name=label_name,
        weight_name=weight_name,
        fixed_inputs=fixed_inputs,
    )
    gradient = loss_gradient(lm, backend, recompute)
    typed = {i.name: i for i in gradient.graph.input}
    elem_type = gradient.graph.output[len(lm.weights)].type.tensor_type.elem_type
    shapes = {w: tuple(d.dim_value for d in typed[w].type.tensor_type.shape.dim) for w in typed}
    penalty = penalty if penalty is not None else NoLearningPenalty()
    opset = default_opset(gradient)
    update, gradients = _update_model(lm.weights, shapes, elem_type, opset, penalty)
    roles = {"features": lm.features, "label": lm.label, "sample_weight": lm.sample_weight}
    step = append_update(update, roles, lm.weights, learning_rate, "flat")
    values = {f.name: getattr(step, f.name) for f in fields(TrainStep)}
    reduction = None if loss is None else loss.reduction
    return SplitStep(**values, gradient=gradient, gradients=gradients, reduction=reduction)


def _update_model(weights, shapes, elem_type: int, opset: int, penalty: BaseLearningPenalty):
    """The update's input half: ``(W, G) -> (G + dP/dW, P(W))`` as a gradient graph
    :func:`append_update` extends; returns it and the names of the ``G`` inputs."""
    graph = helper.make_graph([], "update", [], [])
    b = StepBuilder(graph, opset)
    for w in weights:
        graph.input.append(helper.make_tensor_value_info(w, elem_type, list(shapes[w])))
    reduced = [b.input(f"{w}_reduced", elem_type, list(shapes[w])) for w in weights]
    penalty_grad = _penalty_gradient(penalty, weights, shapes, elem_type, opset)
    if penalty_grad is None:
        grads = [b.op("Identity", g) for g in reduced]
        value = b.const(np.zeros((), dtype=np_dtype(elem_type)), elem_type, "penalty")
    else:
        produced = inline_model(b, penalty_grad, {w: w for w in weights})
        names = [o.name for o in penalty_grad.graph.output]
        grads = [b.op("Add", g, produced[n]) for g, n in zip(reduced, names)]
        value = b.op("Identity", produced[names[-1]], out=b.names.unique("penalty"))
    for w, g in zip(weights, grads):
        graph.output.append(helper.make_tensor_value_info(g, elem_type, list(shapes[w])))
    graph.output.append(helper.make_tensor_value_info(value, elem_type, []))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return finalize_model(model), tuple(reduced)


def _penalty_gradient(penalty, weights, shapes, elem_type: int, opset: int) -> ModelProto | None:
    """``W -> (dP/dW..., P(W))``, or None without a penalty."""
    zeros = [
        helper.make_tensor(w, elem_type, list(shapes[w]), np.zeros(shapes[w]).ravel().tolist())
        for w in weights
    ]
    graph = helper.make_graph([], "penalty", [], [], zeros)
    value = penalty.emit(StepBuilder(graph, opset), weights, elem_type)
    if value is None:
        return None
    graph.output.append(helper.make_tensor_value_info(value, elem_type, []))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    options = DerivativeOptions.FillGrad | DerivativeOptions.KeepOutputs
    return onnx_derivative(model, weights=list(weights), inputs=[], options=options)


__all__ = ["SplitStep", "make_split_step"]
