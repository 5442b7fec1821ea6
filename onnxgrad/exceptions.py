"""Exceptions raised by onnxgrad."""


class ConvergenceError(RuntimeError):
    """Training diverged: the loss or a weight became non-finite."""


class ConvergenceWarning(RuntimeWarning):
    """Training diverged with ``exc=False``: the weights of the last finite epoch are kept
    (onnxcustom's ``training.excs.ConvergenceWarning``)."""


class BrokenDistributionError(RuntimeError):
    """Training turned a classifier's probabilities into rows that are not distributions."""


class NotFittedError(ValueError, AttributeError):
    """An estimator was used before ``fit``. With scikit-learn installed, the error raised
    is also a ``sklearn.exceptions.NotFittedError`` (see :func:`not_fitted_error`)."""


_NOT_FITTED: list[type[NotFittedError]] = []


def not_fitted_error() -> type[NotFittedError]:
    """:class:`NotFittedError`, made a subclass of scikit-learn's too where it is installed
    (scikit-learn imported on the first error, never before)."""
    if not _NOT_FITTED:
        try:
            from sklearn.exceptions import NotFittedError as SklearnNotFittedError
        except ImportError:
            _NOT_FITTED.append(NotFittedError)
        else:
            _NOT_FITTED.append(type("NotFittedError", (NotFittedError, SklearnNotFittedError), {}))
    return _NOT_FITTED[0]
