"""A classifier estimator: original class labels in and out, probabilities, accuracy.

:class:`OrtGradientClassifier` trains a model whose output holds one column per class
(probabilities or logits, as its loss says) or a single column for the positive class of a
binary problem. It encodes the labels ``y`` (numbers, strings...) as ``0..C-1`` in the
order of :attr:`classes_` (sorted, as scikit-learn), so column ``k`` of the output is the
class ``classes_[k]``.
"""

from __future__ import annotations

import numpy as np

from onnxgrad.graph.loss_table import LOGITS
from onnxgrad.training.estimators.optimizers import OrtGradientForwardBackwardOptimizer


class OrtGradientClassifier(OrtGradientForwardBackwardOptimizer):
    """:class:`OrtGradientForwardBackwardOptimizer` for classification.

    The parameters are those of :class:`OrtGradientForwardBackwardOptimizer`;
    ``learning_loss`` defaults to ``'cross_entropy'`` (the output holds probabilities, as a
    converted scikit-learn classifier's); use ``'cross_entropy_logits'`` for logits,
    ``'log'``/``'log_logits'`` for a single column. :meth:`score` is the (weighted)
    accuracy, as scikit-learn's classifiers; :meth:`losses` stays the per-sample loss.

    Fitted attributes besides the regressor's: :attr:`classes_`, :attr:`n_classes_`.
    """

    _stratify = True

    def __init__(
        self,
        model_onnx,
        weights_to_train=None,
        loss_output_name="loss",
        max_iter=100,
        batch_size=10,
        learning_rate="SGD",
        device="cpu",
        warm_start=False,
        verbose=0,
        validation_every=0.1,
        learning_loss="cross_entropy",
        weight_name=None,
        learning_penalty=None,
        exc=True,
        output=None,
        random_state=None,
        backend="onnx",
        intra_op_num_threads=None,
        early_stopping=False,
        validation_fraction=0.1,
        n_iter_no_change=10,
        tol=1e-4,
    ):
        super().__init__(
            model_onnx,
            weights_to_train=weights_to_train,
            loss_output_name=loss_output_name,
            max_iter=max_iter,
            batch_size=batch_size,
            learning_rate=learning_rate,
            device=device,
            warm_start=warm_start,
            verbose=verbose,
            validation_every=validation_every,
            learning_loss=learning_loss,
            weight_name=weight_name,
            learning_penalty=learning_penalty,
            exc=exc,
            output=output,
            random_state=random_state,
            backend=backend,
            intra_op_num_threads=intra_op_num_threads,
            early_stopping=early_stopping,
            validation_fraction=validation_fraction,
            n_iter_no_change=n_iter_no_change,
            tol=tol,
        )

    def __sklearn_tags__(self):
        from sklearn.utils import ClassifierTags

        tags = super().__sklearn_tags__()
        tags.estimator_type = "classifier"
        tags.classifier_tags = ClassifierTags()
        return tags

    # -- fitting ----------------------------------------------------------------------------
    def fit(self, X, y, sample_weight=None, X_val=None, y_val=None, use_numpy=False, feeds=None):
        """Train on the labels ``y`` of any type (see
        :meth:`OrtGradientForwardBackwardOptimizer.fit`); :attr:`classes_` are the sorted
        distinct labels of ``y`` (kept by a warm start)."""
        if not (self.warm_start and self.__sklearn_is_fitted__()):
            self._set_classes(np.unique(_labels(y)))
        y_val = None if y_val is None else self._encode(y_val, "y_val")
        return super().fit(
            X, self._encode(y), sample_weight, X_val, y_val, use_numpy=use_numpy, feeds=feeds
        )

    def partial_fit(self, X, y, classes=None, sample_weight=None, feeds=None):
        """One epoch; the first call needs ``classes``, every label ``y`` may take."""
        if not self.__sklearn_is_fitted__() or classes is not None:
            if classes is None:
                raise ValueError("classes must be given on the first call to partial_fit")
            classes = np.unique(_labels(classes))
            if self.__sklearn_is_fitted__() and not np.array_equal(classes, self.classes_):
                raise ValueError(f"classes={classes} differ from classes_={self.classes_}")
            self._set_classes(classes)
        return super().partial_fit(X, self._encode(y), sample_weight, feeds=feeds)

    def _set_classes(self, classes: np.ndarray) -> None:
        if len(classes) < 2:
            raise ValueError(f"y holds a single class {classes}: a classifier needs two")
        self.classes_ = classes
        self.n_classes_ = len(classes)

    def _encode(self, y, what: str = "y") -> np.ndarray:
        """``y`` as indices into :attr:`classes_`; a label not among them is refused."""
        labels = _labels(y)
        index = np.clip(np.searchsorted(self.classes_, labels), 0, len(self.classes_) - 1)
        unknown = self.classes_[index] != labels
        if unknown.any():
            raise ValueError(
                f"{what} holds the label {labels[np.flatnonzero(unknown)[0]].item()!r}, not "
                f"among the classes {self.classes_.tolist()}"
            )
        return index.astype(np.int64)

    def _checked_data(self, graphs, X, y, sample_weight, suffix=""):
        if graphs.n_classes is not None and self.n_classes_ != graphs.n_classes:
            _column_mismatch(self.classes_, graphs.output, graphs.n_classes)
        return super()._checked_data(graphs, X, y, sample_weight, suffix)

    def _validation_score(self, arrays) -> float:
        proba = self._probabilities(arrays[0])
        return float(np.mean(proba.argmax(axis=1) == arrays[1].reshape(-1)))

    # -- prediction -------------------------------------------------------------------------
    def predict_proba(self, X, feeds=None) -> np.ndarray:
        """Probabilities ``[N, C]`` in float64, column ``k`` for ``classes_[k]``: the output
        itself for a probabilities loss, its softmax (sigmoid for one column) for a logits
        loss; a single column ``p`` becomes ``[1 - p, p]``. Rows the model computed as a
        distribution (summing to 1 up to its rounding, :data:`ROUNDED_SUM`) are divided by
        their float64 sum, so they sum to 1 within 1e-15 as scikit-learn's metrics expect."""
        self._check_fitted()
        return self._probabilities(X, feeds)

    def predict_log_proba(self, X, feeds=None) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.log(self.predict_proba(X, feeds))

    def predict(self, X, feeds=None) -> np.ndarray:
        """The most probable class of each row, among :attr:`classes_` (ties: the first)."""
        proba = self.predict_proba(X, feeds)
        return self.classes_[proba[:, : self.n_classes_].argmax(axis=1)]

    def score(self, X, y, sample_weight=None, feeds=None) -> float:
        """The (weighted) accuracy of :meth:`predict` on ``(X, y)``."""
        right = self.predict(X, feeds) == _labels(y)
        return float(np.average(right, weights=sample_weight))

    def losses(self, X, y, sample_weight=None, feeds=None) -> np.ndarray:
        self._check_fitted()
        return super().losses(X, self._encode(y), sample_weight, feeds)

    def _probabilities(self, X, feeds=None) -> np.ndarray:
        values = self._output_values(X, feeds)
        if values.shape[1] not in (1, self.n_classes_):
            _column_mismatch(self.classes_, self.graphs_.output, values.shape[1])
        logits = self.learning_loss_.spec.prediction == LOGITS
        if values.shape[1] == 1:
            p = 1 / (1 + np.exp(-values)) if logits else values
            return np.hstack([1 - p, p])
        if not logits:
            return _renormalised(values)
        shifted = np.exp(values - values.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)


#: How far from 1 the row sums of a float32 or float16 model's probabilities may be and still
#: be a distribution up to rounding (a float16 softmax of a few classes is off by ~1e-3).
ROUNDED_SUM = 1e-2


def _renormalised(probabilities: np.ndarray) -> np.ndarray:
    """``P / sum_k P[:, k]`` when every row of ``P`` is non-negative and sums to 1 within
    :data:`ROUNDED_SUM`; any other output is returned unchanged (it is no distribution, and
    fit has warned about it)."""
    sums = probabilities.sum(axis=1, keepdims=True)
    if probabilities.min(initial=0.0) < 0 or not np.all(np.abs(sums - 1) <= ROUNDED_SUM):
        return probabilities
    return probabilities / sums


def _column_mismatch(classes: np.ndarray, output: str | None, columns: int) -> None:
    """One column per class (or a single one for two classes), else a ``ValueError``."""
    raise ValueError(
        f"y has {len(classes)} classes {classes.tolist()}, the model output "
        f"{output or '(the first float output)'!r} has {columns} columns: it needs one per "
        "class (or one column for two classes)"
    )


def _labels(y) -> np.ndarray:
    """Labels as a vector: ``[N]`` or ``[N, 1]``."""
    array = np.asarray(y)
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise ValueError(f"class labels must have shape [N] or [N, 1], got {array.shape}")
    return array


__all__ = ["OrtGradientClassifier"]
