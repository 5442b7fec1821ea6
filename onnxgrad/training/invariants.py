"""After training: a classifier's probabilities must still be probabilities.

An output the loss reads as probabilities (``loss.spec.prediction == 'probabilities'``)
with several columns is a distribution per row: ``p_ij >= 0`` and ``sum_j p_ij = 1``. The
lowerings and the default weights keep that by construction (see
:mod:`onnxgrad.graph.weight_roles`); training a constant named explicitly (the 1 of
``1 - p``) can still break it. A fit that ends with rows no longer summing to 1 (within
:data:`TOLERANCE`), where the starting model's rows did, raises
:class:`~onnxgrad.exceptions.BrokenDistributionError` instead of returning a wrong model.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

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


def check_still_a_distribution(estimator, X) -> None:
    """Raise when a fitted estimator's probabilities output stopped being a distribution
    (see the module docstring); a model whose rows did not sum to 1 before training (a
    warning said so) is left alone."""
    loss = estimator.graphs_.loss
    if loss is None or loss.spec.prediction != PROBABILITIES or estimator.graphs_.output is None:
        return
    rows = X[:_ROWS]
    values = estimator._output_values(rows)
    if values.shape[1] < 2 or distribution_error(values) <= TOLERANCE:
        return
    before = _initial_values(estimator, rows)
    if distribution_error(before) > TOLERANCE:
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


def _initial_values(estimator, rows: np.ndarray) -> np.ndarray:
    """The output on ``rows`` with the weights the model started with."""
    from onnxgrad._onnx_utils import load_model
    from onnxgrad.graph.ml_lowering import lowered_if_needed
    from onnxgrad.graph.select import select_model_inputs_outputs

    model = lowered_if_needed(load_model(estimator.model_onnx))
    model = select_model_inputs_outputs(model, outputs=[estimator.graphs_.output])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (values,) = session.run(None, {estimator.predictor_.data_inputs[0]: rows})
    return np.asarray(values, dtype=np.float64).reshape(len(rows), -1)
