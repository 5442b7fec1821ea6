"""Early stopping as scikit-learn's MLP: the no-improvement rule and the held-out rows."""

from __future__ import annotations

import math

import numpy as np


class NoImprovement:
    """Counts the epochs whose score does not beat the best by ``tol``.

    After each epoch's score ``s``: the count grows when ``s < best + tol`` and restarts at
    0 otherwise; ``best = max(best, s)``. Training stops once the count exceeds
    ``n_iter_no_change``.
    """

    def __init__(self, tol: float, n_iter_no_change: int):
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.best = -np.inf
        self.count = 0

    def update(self, score: float) -> bool:
        """Record ``score``; True when it is the best so far."""
        self.count = self.count + 1 if score < self.best + self.tol else 0
        improved = score > self.best
        if improved:
            self.best = score
        return improved

    @property
    def should_stop(self) -> bool:
        return self.count > self.n_iter_no_change


def validation_rows(
    classes: np.ndarray | None, n: int, fraction: float, rng: np.random.Generator
) -> np.ndarray:
    """Sorted indices of ``ceil(fraction * n)`` rows drawn by ``rng``; given ``classes``,
    drawn per class in proportion (each class keeps at least one training row)."""
    if classes is None:
        size = min(max(1, math.ceil(fraction * n)), n - 1)
        return np.sort(rng.permutation(n)[:size])
    held = []
    flat = classes.reshape(len(classes), -1)[:, 0]
    for value in np.unique(flat):
        rows = np.flatnonzero(flat == value)
        size = min(math.ceil(fraction * len(rows)), len(rows) - 1)
        held.append(rng.permutation(rows)[:size])
    return np.sort(np.concatenate(held))
