r"""Spectral transforms: STFT, lowered to framing, windowing and a product by the DFT basis.

With ``x`` the signal ``[B, N, C]`` (``C = 1`` real, ``C = 2`` complex; ``[B, N]`` real), frame step ``s``,
window ``w`` of length ``L`` (all ones without one) and ``K`` bins (``L // 2 + 1`` when
``onesided``, else ``L``), frame ``f`` and bin ``k``:

.. math:: Y[b, f, k] = \sum_{n < L} x[b, f s + n]\, w[n]\, e^{-2 \pi i k n / L}

a framing (a ``Gather`` of the positions ``f s + n``), a product by ``w`` and a ``MatMul``
by the real basis of the DFT (``cos`` and ``sin`` of ``2 \pi k n / L``, real and imaginary
parts interleaved). The engine differentiates that composition: the signal's gradient is
the product of the output gradient by the transposed (conjugate) basis, windowed and
overlap-added back into the signal (the ``Gather``'s scatter-add); the window's is
``\sum_{b,f} \mathrm{Re}(\bar g\, \cdot)`` of the frames, the sum over frames of each frame
times the conjugate-basis gradient. The frame length and the signal's last dimension must be
static (they size the basis); the signal's length and the frame step may be known at run
time only.
"""

from __future__ import annotations

import numpy as np

from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._lowering import Lowering
from onnxgrad.derivative.autodiff.rules._nn_helpers import unsupported


def dft_basis(length: int, bins: int, channels: int) -> np.ndarray:
    """``[length * channels, 2 bins]``: row ``n C + c`` (sample ``n``, real or imaginary
    part ``c``), column ``2 k + p`` (bin ``k``, real or imaginary part ``p``) of the DFT
    ``Y_k = sum_n z_n e^{-2 pi i k n / L}`` written over the reals."""
    k, n = np.arange(bins), np.arange(length)
    angle = 2 * np.pi * (np.outer(n, k) % length) / length
    cos, sin = np.cos(angle), np.sin(angle)
    basis = np.zeros((length, channels, bins, 2))
    basis[:, 0, :, 0], basis[:, 0, :, 1] = cos, -sin
    if channels == 2:
        basis[:, 1, :, 0], basis[:, 1, :, 1] = sin, cos
    return basis.reshape(length * channels, 2 * bins)


def _frame_length(b, node) -> int:
    window, frame_length = node.input(2), node.input(3)
    shape = None if window is None else b.static_shape(window)
    if shape is not None and len(shape) == 1:
        return shape[0]
    value = None if frame_length is None else b.constant_value(frame_length)
    if value is not None and np.size(value) == 1:
        return int(np.asarray(value).reshape(()))
    raise unsupported(node, "a frame length known at run time only (it sizes the DFT basis)")


def _sample_shape(b, node) -> list[int]:
    """The shape of one sample: ``[]`` for a real signal ``[B, N]`` (which onnxruntime and
    onnx's reference accept), ``[C]`` for ``[B, N, C]``."""
    shape = b.shape(node.inputs[0])
    if shape is not None and len(shape) == 2:
        return []
    if shape is None or len(shape) != 3 or shape[-1] not in (1, 2):
        raise unsupported(
            node, f"a signal of shape {shape} (the gradient needs [batch, length, 1 or 2])"
        )
    return [shape[-1]]


@register("STFT", since=17)
def stft_grad(b, node, grads, needs):
    """The gradient of the signal and the window through the lowered STFT (module doc)."""
    signal, step, window = node.inputs[0], node.inputs[1], node.input(2)
    length, sample = _frame_length(b, node), _sample_shape(b, node)
    channels = sample[0] if sample else 1
    bins = length // 2 + 1 if node.attr("onesided", 1) else length
    low = Lowering(b, node)
    samples = low.op("Gather", low.op("Shape", signal), low.ints(1), axis=0)
    hop = low.op("Cast", step, to=7)  # int64
    frames = low.op(
        "Add", low.op("Div", low.op("Sub", samples, low.ints(length)), hop), low.ints(1)
    )
    starts = low.op("Mul", low.op("Range", low.ints(0), frames, low.ints(1)), hop)
    positions = low.op(
        "Add",
        low.op("Unsqueeze", starts, low.ints([1])),
        low.ints(np.arange(length).reshape(1, length)),
    )  # [F, L]
    framed = low.op("Gather", signal, positions, axis=1)  # [B, F, L, C] or [B, F, L]
    if window is not None:
        framed = low.op(
            "Mul", framed, low.op("Reshape", window, low.ints([length] + [1] * len(sample)))
        )
    rows = low.op("Reshape", framed, low.ints([0, 0, length * channels]))
    spectrum = low.op("MatMul", rows, low.const(dft_basis(length, bins, channels)))
    low.op("Reshape", spectrum, low.ints([0, 0, bins, 2]), output=node.outputs[0])
    return low.gradients(grads, [needs[0], False, needs[2] if len(needs) > 2 else False, False])
