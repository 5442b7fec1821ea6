"""Training losses: objects naming a row of the loss table for the estimators.

Each object resolves to one name of :mod:`onnxgrad.graph.loss_table` and appends it with
:func:`onnxgrad.add_loss_output`: same formula, same prediction kind, same reduction
(``'sum'`` by default, ``sum_i w_i sum_j e_ij``, as the seeds; ``'mean'``,
``sum_i w_i mean_j e_ij / sum_i w_i``, makes a learning rate independent of the batch size).
"""

from __future__ import annotations

from typing import Any

from onnx import ModelProto

from onnxgrad._onnx_utils import finalize_model
from onnxgrad.graph import add_loss_output
from onnxgrad.graph.loss_table import (
    DEFAULT_REDUCTION,
    LossSpec,
    check_reduction,
    resolve_loss,
)
from onnxgrad.graph.select import select_in_place
from onnxgrad.training.step._params import ParamsMixin


class BaseLearningLoss(ParamsMixin):
    """A loss of the table put on one float output of a model."""

    reduction: str = DEFAULT_REDUCTION

    @property
    def loss_name(self) -> str:
        """The canonical name in :mod:`onnxgrad.graph.loss_table`."""
        raise NotImplementedError

    @property
    def spec(self) -> LossSpec:
        return resolve_loss(self.loss_name)

    @property
    def classification(self) -> bool:
        """Whether labels are int64 class indices (else floats shaped like the prediction)."""
        return self.spec.classification

    def score_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`onnxgrad.add_loss_output` for this loss."""
        return {}

    @staticmethod
    def select(class_name, **kwargs) -> BaseLearningLoss:
        """The seeds' factory: a loss object (returned as is), a class name or a name of the
        loss table (the seeds' ``'square_error'``, ``'elastic_error'``, ``'neglog'``,
        ``'logloss'`` included) built with ``kwargs``."""
        if isinstance(class_name, BaseLearningLoss):
            return class_name
        classes = {
            cls.__name__: cls
            for cls in (
                SquareLearningLoss,
                AbsoluteLearningLoss,
                ElasticLearningLoss,
                NegLogLearningLoss,
                CrossEntropyLearningLoss,
            )
        }
        if class_name in classes:
            return classes[class_name](**kwargs)
        name = _SEED_NAMES.get(class_name, class_name)
        cls, params = _BY_NAME[resolve_loss(name, "learning_loss").name]
        return cls(**{**params, **kwargs})

    def build(
        self,
        model: ModelProto,
        output: str,
        loss_name: str,
        label_name: str,
        weight_name: str | None,
    ) -> ModelProto:
        """``model`` (normalised: :func:`onnxgrad.normalize.normalized_model`) reduced to one
        scalar output ``loss_name``, the loss of ``output``.

        ``label_name`` (and ``weight_name``) become inputs; the model's other outputs go.
        ``model`` is taken over (rewritten, not copied: its weights are not duplicated).
        """
        model = add_loss_output.normalized(
            model,
            score_name=self.loss_name,
            loss_name=loss_name,
            label_name=label_name,
            weight_name=weight_name,
            output_index=output,
            reduction=check_reduction(self.reduction),
            **self.score_options(),
        )
        model = select_in_place(model, outputs=[loss_name])
        return finalize_model(model)


class _NamedLoss(BaseLearningLoss):
    _name = ""

    def __init__(self, reduction: str = DEFAULT_REDUCTION):
        self.reduction = reduction

    @property
    def loss_name(self) -> str:
        return self._name


class SquareLearningLoss(_NamedLoss):
    """``squared_error``: ``e_ik = (f(x_i)_k - y_ik)^2``."""

    _name = "squared_error"


class AbsoluteLearningLoss(_NamedLoss):
    """``absolute_error``: ``e_ik = |f(x_i)_k - y_ik|``."""

    _name = "absolute_error"


class ElasticLearningLoss(BaseLearningLoss):
    """``elastic``: ``e_ik = l1_weight |d_ik| + l2_weight d_ik^2`` with ``d = f(x) - y``."""

    loss_name = "elastic"

    def __init__(
        self, l1_weight: float = 0.5, l2_weight: float = 0.5, reduction: str = DEFAULT_REDUCTION
    ):
        self.l1_weight = l1_weight
        self.l2_weight = l2_weight
        self.reduction = reduction

    def score_options(self) -> dict[str, Any]:
        return {"l1_weight": self.l1_weight, "l2_weight": self.l2_weight}


class NegLogLearningLoss(BaseLearningLoss):
    """Binary log loss ``e_i = -(y_i log p_i + (1 - y_i) log(1 - p_i))``, ``y_i`` in {0, 1}.

    ``probability_function='sigmoid'`` (the seeds' default): the output holds raw scores,
    one column, ``p = sigmoid(f(x))``: the table's ``log_logits``, computed stably without
    clipping. ``None``: the output holds the probability of class 1, or the two columns
    ``[1 - p, p]`` of a converted classifier, clipped to ``[eps, 1 - eps]`` (default
    ``1e-5``, the seeds'; ``None``: the dtype's machine epsilon): the table's ``log``.
    """

    def __init__(
        self,
        eps: float | None = 1e-5,
        probability_function: str | None = "sigmoid",
        reduction: str = DEFAULT_REDUCTION,
    ):
        self.eps = eps
        self.probability_function = probability_function
        self.reduction = reduction

    @property
    def loss_name(self) -> str:
        return _kind_name(self.probability_function, "sigmoid", "log_logits", "log")

    def score_options(self) -> dict[str, Any]:
        return {"eps": self.eps} if self.loss_name == "log" else {}


class CrossEntropyLearningLoss(BaseLearningLoss):
    """Multi-class log loss ``e_i = -log p_{i, y_i}``, ``y_i`` an int64 class index.

    ``probability_function='softmax'`` (default, as :class:`NegLogLearningLoss`'s
    ``'sigmoid'``): the output holds logits, ``log p = LogSoftmax(f(x))``: the table's
    ``cross_entropy_logits``. ``None``: the output holds probabilities, clipped to
    ``[eps, 1 - eps]``: the table's ``cross_entropy``.
    """

    def __init__(
        self,
        eps: float | None = None,
        probability_function: str | None = "softmax",
        reduction: str = DEFAULT_REDUCTION,
    ):
        self.eps = eps
        self.probability_function = probability_function
        self.reduction = reduction

    @property
    def loss_name(self) -> str:
        return _kind_name(
            self.probability_function, "softmax", "cross_entropy_logits", "cross_entropy"
        )

    def score_options(self) -> dict[str, Any]:
        return {"eps": self.eps} if self.loss_name == "cross_entropy" else {}


def _kind_name(function: str | None, logits_function: str, logits: str, probabilities: str):
    if function not in (logits_function, None):
        raise ValueError(
            f"unknown probability_function {function!r}, expected {logits_function!r} or None"
        )
    return logits if function == logits_function else probabilities


#: the seeds' loss names that are not names of the table
_SEED_NAMES = {"elastic_error": "elastic", "neglog": "log_logits", "logloss": "log_logits"}

#: canonical table name -> (class, constructor arguments); a name clips as the table does
#: (``eps=None``), the class keeps the seeds' ``eps=1e-5``
_BY_NAME: dict[str, tuple[type[BaseLearningLoss], dict[str, Any]]] = {
    "squared_error": (SquareLearningLoss, {}),
    "absolute_error": (AbsoluteLearningLoss, {}),
    "elastic": (ElasticLearningLoss, {}),
    "log": (NegLogLearningLoss, {"probability_function": None, "eps": None}),
    "log_logits": (NegLogLearningLoss, {"probability_function": "sigmoid"}),
    "cross_entropy": (CrossEntropyLearningLoss, {"probability_function": None}),
    "cross_entropy_logits": (CrossEntropyLearningLoss, {"probability_function": "softmax"}),
}


def select_learning_loss(loss, reduction: str | None = None) -> BaseLearningLoss:
    """A fresh loss object from a name of the loss table (aliases included) or a copy of a
    loss object; ``reduction`` overrides the object's (default: ``'sum'``)."""
    if isinstance(loss, BaseLearningLoss):
        params = loss.get_params(deep=False)
    elif isinstance(loss, str):
        cls, params = _BY_NAME[resolve_loss(loss, "learning_loss").name]
        loss = cls
    else:
        raise TypeError(f"learning_loss must be a name or a loss object, got {loss!r}")
    if reduction is not None:
        params = {**params, "reduction": check_reduction(reduction)}
    result = (loss if isinstance(loss, type) else type(loss))(**params)
    check_reduction(result.reduction)
    return result


__all__ = [
    "AbsoluteLearningLoss",
    "BaseLearningLoss",
    "CrossEntropyLearningLoss",
    "ElasticLearningLoss",
    "NegLogLearningLoss",
    "SquareLearningLoss",
    "select_learning_loss",
]
