"""Training losses: which loss :func:`onnxgrad.add_loss_output` appends, made a mean.

Every loss here is the (weighted) **mean** over the batch of a per-observation loss
``l_i``, ``L = sum_i w_i l_i / sum_i w_i`` (``w_i = 1`` without sample weights), so that a
learning rate does not depend on the batch size. The formulas of ``l_i`` live in
:func:`onnxgrad.add_loss_output`; the regression scores it writes as sums are divided by
``sum_i w_i`` here.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from onnx import ModelProto, TensorProto, ValueInfoProto, helper

from onnxgrad._onnx_utils import default_opset, finalize_model, np_dtype
from onnxgrad.graph import add_loss_output, select_model_inputs_outputs
from onnxgrad.training._builder import StepBuilder, rename_values
from onnxgrad.training._inputs import tensor_dims
from onnxgrad.training._params import ParamsMixin


class BaseLearningLoss(ParamsMixin):
    """A loss put on one float output of a model (see the module docstring)."""

    #: the ``score_name`` of :func:`onnxgrad.add_loss_output`
    score_name: str = ""
    #: whether :func:`onnxgrad.add_loss_output` sums that score over the batch
    summed: bool = True
    #: whether labels are int64 class indices (else floats shaped like the prediction)
    classification: bool = False

    def score_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`onnxgrad.add_loss_output` for this loss."""
        return {}

    def prepare_output(self, model: ModelProto, output: str) -> tuple[ModelProto, str]:
        """Nodes turning ``output`` into what the score expects (e.g. probabilities)."""
        return model, output

    def build(
        self,
        model: ModelProto,
        output: str,
        loss_name: str,
        label_name: str,
        weight_name: str | None,
    ) -> ModelProto:
        """``model`` reduced to one scalar output ``loss_name``, the mean loss of ``output``.

        ``label_name`` (and ``weight_name``) become inputs; the model's other outputs go.
        """
        model, output = self.prepare_output(model, output)
        model = add_loss_output(
            model,
            score_name=self.score_name,
            loss_name=loss_name,
            label_name=label_name,
            weight_name=weight_name,
            output_index=output,
            **self.score_options(),
        )
        model = select_model_inputs_outputs(model, outputs=[loss_name])
        if self.summed:
            _divide_by_total_weight(model, loss_name, label_name, weight_name)
        return finalize_model(model)


class SquareLearningLoss(BaseLearningLoss):
    """``l_i = sum_k (f(x_i)_k - y_ik)^2`` (the sum runs over the outputs of a sample)."""

    score_name = "squared_error"


class AbsoluteLearningLoss(BaseLearningLoss):
    """``l_i = sum_k |f(x_i)_k - y_ik|``."""

    score_name = "absolute_error"


class ElasticLearningLoss(BaseLearningLoss):
    """``l_i = sum_k l1_weight |d_ik| + l2_weight d_ik^2`` with ``d = f(x) - y``."""

    score_name = "elastic"

    def __init__(self, l1_weight: float = 0.5, l2_weight: float = 0.5):
        self.l1_weight = l1_weight
        self.l2_weight = l2_weight

    def score_options(self) -> dict[str, Any]:
        return {"l1_weight": self.l1_weight, "l2_weight": self.l2_weight}


class NegLogLearningLoss(BaseLearningLoss):
    """Binary log loss ``l_i = -(y_i log p_i + (1 - y_i) log(1 - p_i))``, ``y_i`` in {0, 1}.

    ``p = sigmoid(f(x))`` with ``probability_function='sigmoid'`` (the output holds raw
    scores, one column), ``p = f(x)`` with ``None`` (a probability column, or the two
    columns ``[1 - p, p]`` of a converted classifier). ``p`` is clipped to
    ``[eps, 1 - eps]`` before the log.
    """

    score_name = "log"
    summed = False
    classification = True

    def __init__(self, eps: float = 1e-5, probability_function: str | None = "sigmoid"):
        self.eps = eps
        self.probability_function = probability_function

    def score_options(self) -> dict[str, Any]:
        return {"eps": self.eps}

    def prepare_output(self, model: ModelProto, output: str) -> tuple[ModelProto, str]:
        if self.probability_function not in ("sigmoid", None):
            raise ValueError(
                f"unknown probability_function {self.probability_function!r}, "
                "expected 'sigmoid' or None"
            )
        info = _output_info(model, output)
        columns = _columns(info)
        if self.probability_function is None and columns == 2:
            return model, output
        if columns != 1:
            raise ValueError(
                f"NegLogLearningLoss needs one column of scores or probabilities, output "
                f"{output!r} has shape {tensor_dims(info)}"
            )
        return _two_column_probabilities(model, info, self.probability_function == "sigmoid")


class CrossEntropyLearningLoss(BaseLearningLoss):
    """Multi-class log loss ``l_i = -log p_{i, y_i}``, ``y_i`` an int64 class index.

    ``p = softmax(f(x))`` over the last axis with ``probability_function='softmax'`` (the
    output holds logits), ``p = f(x)`` with ``None`` (probabilities, clipped to
    ``[eps, 1 - eps]``).
    """

    score_name = "cross_entropy"
    summed = False
    classification = True

    def __init__(self, eps: float = 1e-7, probability_function: str | None = "softmax"):
        self.eps = eps
        self.probability_function = probability_function

    def score_options(self) -> dict[str, Any]:
        if self.probability_function not in ("softmax", None):
            raise ValueError(
                f"unknown probability_function {self.probability_function!r}, "
                "expected 'softmax' or None"
            )
        return {"eps": self.eps, "probabilities": self.probability_function is None}


_BY_NAME = {
    "square_error": SquareLearningLoss,
    "squared_error": SquareLearningLoss,
    "absolute_error": AbsoluteLearningLoss,
    "elastic": ElasticLearningLoss,
    "log": NegLogLearningLoss,
    "neg_log": NegLogLearningLoss,
    "cross_entropy": CrossEntropyLearningLoss,
}


def select_learning_loss(loss) -> BaseLearningLoss:
    """A fresh loss object from a name (see ``_BY_NAME``) or a copy of a loss object."""
    if isinstance(loss, BaseLearningLoss):
        return type(loss)(**loss.get_params(deep=False))
    if isinstance(loss, str):
        if loss not in _BY_NAME:
            raise ValueError(f"unknown learning_loss {loss!r}, expected one of {sorted(_BY_NAME)}")
        return _BY_NAME[loss]()
    raise TypeError(f"learning_loss must be a name or a loss object, got {loss!r}")


def _divide_by_total_weight(
    model: ModelProto, loss_name: str, label_name: str, weight_name: str | None
) -> None:
    """Rename the producer of ``loss_name`` and append ``loss = sum / sum_i w_i``.

    With sample weights the divisor is ``max(sum_i w_i, tiny)`` (``tiny`` the smallest
    normal number of the dtype): a batch whose weights are all zero has the loss 0 and a
    zero gradient instead of ``0 / 0``.
    """
    graph = model.graph
    b = StepBuilder(graph, default_opset(model))
    total = b.names.unique(f"{loss_name}_sum")
    rename_values(graph, {loss_name: total})
    elem_type = graph.output[0].type.tensor_type.elem_type
    if weight_name is not None:
        tiny = b.const(ml_dtypes.finfo(np_dtype(elem_type)).tiny, elem_type, "tiny")
        b.op("Div", total, b.op("Max", b.reduce_sum(weight_name), tiny), out=loss_name)
        return
    label = next(i for i in graph.input if i.name == label_name)
    per_sample = _static_size(tensor_dims(label)[1:])
    if per_sample is None:
        zero = b.const(np.array([0], dtype=np.int64), TensorProto.INT64, "first_axis")
        count = b.op("Gather", b.op("Shape", label_name), zero, axis=0)
        b.op("Div", total, b.op("Cast", b.op("Squeeze", count, zero), to=elem_type), out=loss_name)
        return
    # N = size(label) / per_sample, so loss = per_sample * sum / size(label)
    size = b.op("Cast", b.op("Size", label_name), to=elem_type)
    if per_sample != 1:
        total = b.op("Mul", total, b.const(per_sample, elem_type, "per_sample"))
    b.op("Div", total, size, out=loss_name)


def _static_size(dims: list) -> int | None:
    if not all(isinstance(d, int) and d > 0 for d in dims):
        return None
    return int(np.prod(dims, dtype=np.int64))


def _output_info(model: ModelProto, output: str) -> ValueInfoProto:
    for info in model.graph.output:
        if info.name == output:
            return info
    raise ValueError(
        f"unknown output {output!r}, the outputs are {[o.name for o in model.graph.output]}"
    )


def _columns(info: ValueInfoProto) -> int | None:
    dims = tensor_dims(info)
    if len(dims) == 1:
        return 1
    return dims[1] if len(dims) == 2 else None


def _two_column_probabilities(
    model: ModelProto, info: ValueInfoProto, sigmoid: bool
) -> tuple[ModelProto, str]:
    """Append ``[1 - p, p]`` (``p = sigmoid(output)`` or the output) as a new output."""
    graph = model.graph
    b = StepBuilder(graph, default_opset(model))
    elem_type = info.type.tensor_type.elem_type
    column = b.op(
        "Reshape",
        info.name,
        b.const(np.array([-1, 1], dtype=np.int64), TensorProto.INT64, "column_shape"),
    )
    p = b.op("Sigmoid", column) if sigmoid else column
    complement = b.op("Sub", b.const(1, elem_type, "one"), p)
    probabilities = b.op("Concat", complement, p, axis=1, out=b.names.unique("probabilities"))
    graph.output.append(helper.make_tensor_value_info(probabilities, elem_type, [None, 2]))
    return model, probabilities


__all__ = [
    "AbsoluteLearningLoss",
    "BaseLearningLoss",
    "CrossEntropyLearningLoss",
    "ElasticLearningLoss",
    "NegLogLearningLoss",
    "SquareLearningLoss",
    "select_learning_loss",
]
