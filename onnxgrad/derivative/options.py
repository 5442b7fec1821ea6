"""What a gradient graph returns: :class:`DerivativeOptions`."""

from __future__ import annotations

from enum import IntFlag

from onnxgrad.normalize.ste import QUANTIZED_ACTIVATIONS

__all__ = ["QUANTIZED_ACTIVATIONS", "DerivativeOptions", "check_options"]


class DerivativeOptions(IntFlag):
    """Flags of :func:`onnxgrad.onnx_derivative` (onnxcustom's names).

    * ``Zero``: one extra input ``<output>_grad`` per differentiated output (every float
      output, or those of ``outputs=``), the gradient flowing back into that output; the
      original outputs are dropped.
    * ``KeepOutputs``: the original outputs are returned too, after the gradients.
    * ``FillGrad``: no ``<output>_grad`` inputs; each output gradient is ones of the output's
      shape, i.e. the graph computes the gradient of the sum of the differentiated outputs
      (mind a classifier's probabilities: their sum is 1, pick one column with ``Zero``
      instead). Alone or with
      ``KeepOutputs``.
    * ``KeepYieldOp``: ORT backend only, the raw graph with its ``YieldOp`` placeholders.
    * ``Loss``: the model already ends in a scalar loss (``loss=`` names it, ``label=`` the
      label input); the result returns the gradients and the loss.

    Quantized activations are no flag: ``quantized_activations=`` of
    :func:`onnxgrad.onnx_derivative` (and of the training entries) chooses between the
    straight-through estimator (``"straight_through"``, default) and the derivative of the
    deployed file itself (``"exact"``), :data:`QUANTIZED_ACTIVATIONS`.
    """

    Zero = 0
    KeepYieldOp = 1
    KeepOutputs = 2
    FillGrad = 4
    Loss = 8


def check_options(options: DerivativeOptions | int, backend: str) -> DerivativeOptions:
    """Validate a combination of flags, raising ``ValueError`` that names the conflict."""
    if isinstance(options, bool) or not isinstance(options, int):
        raise TypeError(f"options must be DerivativeOptions flags, got {options!r}")
    known = sum(DerivativeOptions)
    if options < 0 or options & ~known:
        raise ValueError(
            f"unknown DerivativeOptions bits in {options!r}: the flags are "
            + ", ".join(f"{flag.name}={flag.value}" for flag in DerivativeOptions if flag)
        )
    options = DerivativeOptions(options)
    if DerivativeOptions.KeepYieldOp in options:
        if backend != "ort":
            raise ValueError("DerivativeOptions.KeepYieldOp is only available with backend='ort'")
        if options != DerivativeOptions.KeepYieldOp:
            raise ValueError("DerivativeOptions.KeepYieldOp cannot be combined with other options")
    if DerivativeOptions.Loss in options and DerivativeOptions.FillGrad in options:
        raise ValueError(
            "DerivativeOptions.Loss already seeds the loss gradient with 1: drop FillGrad"
        )
    if backend == "ort" and options == DerivativeOptions.Loss | DerivativeOptions.KeepOutputs:
        raise ValueError(
            "backend='ort' returns only the loss with DerivativeOptions.Loss; "
            "KeepOutputs needs backend='onnx'"
        )
    return options
