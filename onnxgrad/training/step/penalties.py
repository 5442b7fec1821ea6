"""Weight penalties added to the training loss."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxgrad.training.step._builder import StepBuilder
from onnxgrad.training.step._params import ParamsMixin


class BaseLearningPenalty(ParamsMixin):
    """A penalty ``P(W)`` on the trained weights, added to the mean loss."""

    def emit(self, b: StepBuilder, weights: Sequence[str], elem_type: int) -> str | None:
        """Nodes computing ``P(W)`` as a scalar of ``elem_type``; ``None`` for no penalty."""
        raise NotImplementedError

    @staticmethod
    def select(class_name, **kwargs) -> BaseLearningPenalty:
        """The seeds' factory: a penalty object (returned as is), ``None`` or ``'penalty'``
        (no penalty, :class:`NoLearningPenalty`), ``'elastic'`` (:class:`ElasticLearningPenalty`)
        or a class name, built with ``kwargs``."""
        if isinstance(class_name, BaseLearningPenalty):
            return class_name
        classes = {
            None: NoLearningPenalty,
            "penalty": NoLearningPenalty,
            "elastic": ElasticLearningPenalty,
            "NoLearningPenalty": NoLearningPenalty,
            "ElasticLearningPenalty": ElasticLearningPenalty,
        }
        if class_name not in classes:
            raise ValueError(f"unknown penalty {class_name!r}, expected one of {list(classes)}")
        return classes[class_name](**kwargs)


class NoLearningPenalty(BaseLearningPenalty):
    """No penalty."""

    def emit(self, b, weights, elem_type):
        return None


class ElasticLearningPenalty(BaseLearningPenalty):
    """``P(W) = sum_w l1 sum|w| + l2 sum w^2`` over every trained weight tensor ``w``.

    Its gradient ``l1 sign(w) + 2 l2 w`` joins the loss gradient before the update.
    """

    def __init__(self, l1: float = 0.5, l2: float = 0.5):
        self.l1 = l1
        self.l2 = l2

    def emit(self, b, weights, elem_type):
        for name in ("l1", "l2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        terms = []
        for weight in weights:
            if self.l1:
                absolute = b.reduce_sum(b.op("Abs", weight))
                terms.append(b.op("Mul", b.const(self.l1, elem_type, "l1"), absolute))
            if self.l2:
                squares = b.reduce_sum(b.op("Mul", weight, weight))
                terms.append(b.op("Mul", b.const(self.l2, elem_type, "l2"), squares))
        if not terms:
            return None
        return terms[0] if len(terms) == 1 else b.op("Sum", *terms)


def select_learning_penalty(penalty) -> BaseLearningPenalty:
    """``None`` -> :class:`NoLearningPenalty`; a penalty object is copied."""
    if penalty is None:
        return NoLearningPenalty()
    if isinstance(penalty, BaseLearningPenalty):
        return type(penalty)(**penalty.get_params(deep=False))
    raise TypeError(f"learning_penalty must be None or a penalty object, got {penalty!r}")


__all__ = [
    "BaseLearningPenalty",
    "ElasticLearningPenalty",
    "NoLearningPenalty",
    "select_learning_penalty",
]
