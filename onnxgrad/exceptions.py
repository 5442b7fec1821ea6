"""Exceptions raised by onnxgrad."""


class ConvergenceError(RuntimeError):
    """Training diverged: the loss or a weight became non-finite."""
