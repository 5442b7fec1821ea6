"""The one table of training losses, read by every entry point.

:func:`onnxgrad.add_loss_output`, the loss objects of :mod:`onnxgrad.training.step.losses`,
the estimators' ``learning_loss`` and the commands ``onnxgrad add-loss --score`` and
``onnxgrad train --loss`` all resolve a name here: a name has one formula, one kind of
prediction and one label kind. The reduction is a separate, explicit option
(:data:`REDUCTIONS`, default :data:`DEFAULT_REDUCTION`) with the same default everywhere.

========================  =============  ====================================================
name                      prediction     pointwise loss ``e`` (``d = f - y``)
========================  =============  ====================================================
``squared_error``         values         ``d^2`` per element
``absolute_error``        values         ``|d|`` per element
``elastic``               values         ``l1_weight |d| + l2_weight d^2`` per element
``log``                   probabilities  ``-(y log p + (1 - y) log(1 - p))``, ``y`` in {0, 1}
``log_logits``            logits         the same with ``p = sigmoid(s)``
``cross_entropy``         probabilities  ``-log p_y``, ``y`` in ``0..C-1``
``cross_entropy_logits``  logits         ``-log softmax(z)_y``
========================  =============  ====================================================

``'sum'``, the default, is ``sum_i w_i sum_j e_ij`` (the seeds' ``add_loss_output``, whose
graph ends in ``ReduceSum``); ``'mean'`` is ``sum_i w_i mean_j e_ij / sum_i w_i``, the mean
over every element without sample weights (scikit-learn's ``mean_squared_error`` and
``log_loss``, torch's ``reduction='mean'``), so a learning rate does not depend on the batch
size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from onnxgrad.graph import _scores
from onnxgrad.graph._scores import REDUCTIONS, check_reduction

#: the reduction every entry point uses unless told otherwise
DEFAULT_REDUCTION = "sum"

#: prediction kinds: what the loss expects the model output to be
VALUES, PROBABILITIES, LOGITS = "values", "probabilities", "logits"


@dataclass(frozen=True)
class LossSpec:
    """One row of the table."""

    name: str
    #: builder ``(builder, prediction, label, **options) -> pointwise loss``
    build: Callable[..., str] = field(repr=False)
    #: ``'values'``, ``'probabilities'`` or ``'logits'``
    prediction: str
    #: keyword options with their defaults
    options: Mapping[str, Any]
    formula: str

    @property
    def classification(self) -> bool:
        """Labels are int64 class indices (``[N]`` or ``[N, 1]``), not values shaped like
        the prediction."""
        return self.prediction != VALUES

    def checked_options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        unexpected = sorted(set(given) - set(self.options))
        if "probabilities" in unexpected:
            raise TypeError(
                f"loss {self.name!r} takes no option 'probabilities': the prediction kind is in "
                "the name, 'cross_entropy' on probabilities, 'cross_entropy_logits' on logits"
            )
        if unexpected:
            raise TypeError(
                f"loss {self.name!r} takes no options {unexpected}; it accepts "
                f"{sorted(self.options)}"
            )
        return {**self.options, **given}


_EPS = {"eps": None}

LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("squared_error", _scores.squared_error, VALUES, {}, "(f - y)^2"),
        LossSpec("absolute_error", _scores.absolute_error, VALUES, {}, "|f - y|"),
        LossSpec(
            "elastic",
            _scores.elastic,
            VALUES,
            {"l1_weight": 0.5, "l2_weight": 0.5},
            "l1_weight |f - y| + l2_weight (f - y)^2",
        ),
        LossSpec("log", _scores.binary_log, PROBABILITIES, _EPS, "-(y log p + (1 - y) log(1 - p))"),
        LossSpec(
            "log_logits",
            _scores.binary_log_logits,
            LOGITS,
            {},
            "-(y log sigmoid(s) + (1 - y) log sigmoid(-s))",
        ),
        LossSpec("cross_entropy", _scores.cross_entropy, PROBABILITIES, _EPS, "-log p_y"),
        LossSpec(
            "cross_entropy_logits",
            _scores.cross_entropy_logits,
            LOGITS,
            {},
            "-log softmax(z)_y",
        ),
    )
}

#: other spellings accepted by every entry point
ALIASES: dict[str, str] = {
    "square_error": "squared_error",
    "l2": "squared_error",
    "mse": "squared_error",
    "absolute": "absolute_error",
    "l1": "absolute_error",
    "mae": "absolute_error",
    "neg_log": "log_logits",
    "log_loss": "log",
    "binary_cross_entropy": "log",
    "sigmoid_log": "log_logits",
    "binary_cross_entropy_logits": "log_logits",
    "softmax_cross_entropy": "cross_entropy_logits",
}

#: every accepted name, canonical ones first
LOSS_NAMES: tuple[str, ...] = (*LOSSES, *ALIASES)


def resolve_loss(name: str, what: str = "loss") -> LossSpec:
    """The row of ``name`` (a canonical name or an alias), or a ``ValueError`` listing them
    (``what`` names the argument in the message)."""
    if not isinstance(name, str):
        raise TypeError(f"a loss name must be a string, got {type(name).__name__}")
    canonical = ALIASES.get(name, name)
    if canonical not in LOSSES:
        raise ValueError(
            f"unknown {what} {name!r}, expected one of {list(LOSSES)} "
            f"(aliases: {', '.join(f'{a}={c}' for a, c in ALIASES.items())})"
        )
    return LOSSES[canonical]


__all__ = [
    "ALIASES",
    "DEFAULT_REDUCTION",
    "LOGITS",
    "LOSSES",
    "LOSS_NAMES",
    "PROBABILITIES",
    "REDUCTIONS",
    "VALUES",
    "LossSpec",
    "check_reduction",
    "resolve_loss",
]
