"""What a gradient graph returns: :class:`DerivativeOptions`."""

from __future__ import annotations

from enum import IntFlag


class DerivativeOptions(IntFlag):
    """Flags of :func:`onnxgrad.onnx_derivative` (onnxcustom's names).

    * ``Zero``: one extra input ``<output>_grad`` per model output, the gradient flowing back
      into that output; the original outputs are dropped.
    * ``KeepOutputs``: the original outputs are returned too, after the gradients.
    * ``FillGrad``: no ``<output>_grad`` inputs; each output gradient is ones of the output's
      shape, i.e. the graph computes the gradient of ``sum(outputs)``. Alone or with
      ``KeepOutputs``.
    * ``KeepYieldOp``: ORT backend only, the raw graph with its ``YieldOp`` placeholders.
    * ``Loss``: the model already ends in a scalar loss (``loss=`` names it, ``label=`` the
      label input); the result returns the gradients and the loss.
    """

    Zero = 0
    KeepYieldOp = 1
    KeepOutputs = 2
    FillGrad = 4
    Loss = 8


def check_options(options: DerivativeOptions | int, backend: str) -> DerivativeOptions:
    """Validate a combination of flags, raising ``ValueError`` that names the conflict."""
    try:
        options = DerivativeOptions(options)
    except ValueError:
        raise ValueError(f"unknown DerivativeOptions value {options!r}") from None
    if DerivativeOptions.KeepYieldOp in options:
        if backend != "ort":
            raise ValueError("DerivativeOptions.KeepYieldOp is only available with backend='ort'")
        if options != DerivativeOptions.KeepYieldOp:
            raise ValueError("DerivativeOptions.KeepYieldOp cannot be combined with other options")
    if DerivativeOptions.Loss in options and DerivativeOptions.FillGrad in options:
        raise ValueError(
            "DerivativeOptions.Loss already seeds the loss gradient with 1: drop FillGrad"
        )
    return options
