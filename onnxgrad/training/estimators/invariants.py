"""After training: a classifier's probabilities must still be probabilities.

An output the loss reads as probabilities (``loss.spec.prediction == 'probabilities'``)
with several columns is a distribution per row: ``p_ij >= 0`` and ``sum_j p_ij = 1``. The
lowerings and the default weights keep that by construction (see
:mod:`onnxgrad.graph.weight_roles`); training a constant named explicitly (the 1 of
``1 - p``) can still break it. A fit that ends with rows no longer summing to 1 (within
:data:`TOLERANCE`), where they did when it started, raises
:class:`~onnxgrad.exceptions.BrokenDistributionError` instead of returning a wrong model.
"""

from __future__ import annotations

import numpy as np

from onnxgrad.exceptions import BrokenDistributionError
from onnxgrad.graph.loss_table import PROBABILITIES

#: how far from 1 a row's sum (and below 0 or above 1 a probability) may drift
TOLERANCE = 1e-4
#: rows checked
_ROWS = 256


def distribution_error(values: np.ndarray) -> float:
    """``max_i |sum_j p_ij - 1|``, or how far a value lies outside ``[0, 1]``, if larger."""
    outside = np.maximum(values - 1, -values).max(initial=0.0)
    return float(max(np.abs(values.sum(axis=1) - 1).max(initial=0.0), outside))


def probabilities_error(estimator, X) -> float | None:
    """:func:`distribution_error` of the probabilities output on the first rows of ``X``
    with the estimator's current weights; ``None`` unless its loss reads probabilities
    from an output of several columns."""
    loss = estimator.graphs_.loss
    if loss is None or loss.spec.prediction != PROBABILITIES or estimator.graphs_.output is None:
        return None
    values = estimator._output_values(X[:_ROWS])
    return distribution_error(values) if values.shape[1] > 1 else None


def check_still_a_distribution(estimator, X, before: float | None) -> None:
    """Raise when a fit turned probabilities rows into something else: ``before`` is
    :func:`probabilities_error` before the fit (a model whose rows did not sum to 1 then,
    which a warning reported, is left alone)."""
    if before is None or before > TOLERANCE:
        return
    values = estimator._output_values(X[:_ROWS])
    if distribution_error(values) <= TOLERANCE:
        return
    sums = values.sum(axis=1)
    raise BrokenDistributionError(
        f"after training, the rows of output {estimator.graphs_.output!r} are no longer "
        f"probabilities (row sums from {sums.min():.4g} to {sums.max():.4g}, values from "
        f"{values.min():.4g} to {values.max():.4g}; they summed to 1 before): training "
        f"{list(estimator.runner_.step.weights)} does not keep the model's normalisation "
        "(a constant of its post-processing is among them, or its columns have separate "
        "parameters); train fewer weights (weights_to_train) or put the loss on logits"
    )
