r"""Spectral transforms: STFT and DFT, lowered to framing, windowing and a product by the
DFT basis.

With ``x`` the signal ``[B, N, C]`` (``C = 1`` real, ``C = 2`` complex; ``[B, N]`` real),
frame step ``s``, window ``w`` of length ``L`` (all ones without one) and ``K`` bins
(``L // 2 + 1`` when ``onesided``, else ``L``), frame ``f`` and bin ``k``:

.. math:: Y[b, f, k] = \sum_{n < L} x[b, f s + n]\, w[n]\, e^{-2 \pi i k n / L}

a framing (a ``Gather`` of the positions ``f s + n``), a product by ``w`` and a ``MatMul``
by the real basis of the DFT (:func:`_dft_basis`). The engine differentiates that
composition: the signal's gradient is the product of the output gradient by the transposed
(conjugate) basis, windowed and overlap-added back into the signal (the ``Gather``'s
scatter-add); the window's is the sum over batches and frames of each frame times that
product. Sizes may be known at run time only (the signal's length, the frame step, the frame
length); the signal's rank and last dimension must be known.

DFT along an axis fed at run time, and the real inverse of half a spectrum (irfft), take
the transposed transform instead: a DFT of the output gradient along the same axis
(:func:`_dft_transposed`).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._lowering import Lowering
from onnxgrad.derivative.autodiff.rules._nn_helpers import unsupported
from onnxgrad.derivative.autodiff.rules._shape_helpers import reshape_to


@register("STFT", since=17)
def stft_grad(b, node, grads, needs):
    """The gradient of the signal and the window through the lowered STFT (module doc)."""
    signal, step, window = node.inputs[0], node.inputs[1], node.input(2)
    sample = _sample_shape(b, node)
    low = Lowering(b, node)
    static = _static_frame_length(b, node)
    length = low.ints(static) if static is not None else _frame_length(low, node)
    samples = low.op("Gather", low.op("Shape", signal), low.ints(1), axis=0)
    hop = low.op("Cast", step, to=TensorProto.INT64)
    frames = low.op("Add", low.op("Div", low.op("Sub", samples, length), hop), low.ints(1))
    starts = low.op("Unsqueeze", low.op("Mul", _range(low, frames), hop), low.ints([1]))
    offsets = low.op("Unsqueeze", _range(low, length), low.ints([0]))
    positions = low.op("Add", starts, offsets)  # [F, L]
    framed = low.op("Gather", signal, positions, axis=1)  # [B, F, L, C] or [B, F, L]
    if window is not None:
        shaped = low.op("Reshape", window, low.ints([-1, *[1] * len(sample)]))
        framed = low.op("Mul", framed, shaped)
    rows = low.op("Reshape", framed, low.ints([0, 0, -1]))
    onesided = node.attr("onesided", 1)
    basis = _dft_basis(low, length, static, sample[0] if sample else 1, onesided)
    spectrum = low.op("MatMul", rows, basis)
    low.op("Reshape", spectrum, low.ints([0, 0, -1, 2]), output=node.outputs[0])
    return low.gradients(grads, [needs[0], False, len(needs) > 2 and needs[2], False])


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


def _static_frame_length(b, node) -> int | None:
    """``L`` when the window's shape or a constant ``frame_length`` gives it."""
    window, frame_length = node.input(2), node.input(3)
    shape = None if window is None else b.static_shape(window)
    if shape is not None and len(shape) == 1:
        return shape[0]
    value = None if frame_length is None or window is not None else b.constant_value(frame_length)
    return None if value is None else int(np.asarray(value).reshape(()))


def _frame_length(low: Lowering, node) -> str:
    """``L`` as a 0-D int64 computed at run time: the window's length, else ``frame_length``."""
    window, frame_length = node.input(2), node.input(3)
    if window is not None:
        return low.op("Squeeze", low.op("Shape", window), low.ints([0]))
    if frame_length is None:
        raise unsupported(node, "neither a window nor a frame_length")
    return low.op("Cast", low.op("Reshape", frame_length, low.ints([])), to=TensorProto.INT64)


def _range(low: Lowering, count: str) -> str:
    return low.op("Range", low.ints(0), count, low.ints(1))


def _dft_basis(
    low: Lowering, length: str, static: int | None, channels: int, onesided, inverse=0
) -> str:
    r"""``[L C, 2 K]``: row ``n C + c`` (sample ``n``, its real or imaginary part ``c``),
    column ``2 k + p`` (bin ``k``, real or imaginary part ``p``) of the DFT over the reals,
    :math:`z_n e^{-i\theta} = (\Re z \cos\theta + \Im z \sin\theta) + i (\Im z
    \cos\theta - \Re z \sin\theta)`, :math:`\theta = 2\pi k n / L` (the inverse:
    :math:`e^{+i\theta} / L`). A constant computed in float64 when ``L`` is static, else the
    ``DFT`` of the identity matrix (exact in the signal's type; onnxruntime has no float64
    ``Cos``)."""
    if static is not None:
        bins = static // 2 + 1 if onesided else static
        angle = 2 * np.pi * (np.outer(np.arange(static), np.arange(bins)) % static) / static
        sign, scale = (1.0, 1.0 / static) if inverse else (-1.0, 1.0)
        real = low.const(scale * np.stack([np.cos(angle), sign * np.sin(angle)], axis=-1))
    else:
        square = low.op("Concat", *[low.op("Unsqueeze", length, low.ints([0]))] * 2, axis=0)
        zeros = low.op(
            "ConstantOfShape", square, value=numpy_helper.from_array(np.zeros(1, low.dtype))
        )
        identity = low.op("Unsqueeze", low.op("EyeLike", zeros), low.ints([-1]))  # [L, L, 1]
        attrs = {"onesided": onesided, "inverse": inverse}
        if low.opset >= 20:
            real = low.op("DFT", identity, "", low.ints(1), **attrs)
        else:
            real = low.op("DFT", identity, axis=1, **attrs)
    if channels == 1:
        return low.op("Flatten", real, axis=1)  # [L, K, 2] -> [L, 2 K]
    swapped = low.op("Gather", real, low.ints([1, 0]), axis=2)
    imaginary = low.op("Mul", swapped, low.const([-1.0, 1.0]))  # i (a + i b) = -b + i a
    rows = [low.op("Unsqueeze", r, low.ints([1])) for r in (real, imaginary)]
    return low.op("Flatten", low.op("Concat", *rows, axis=1), axis=2)  # [2 L, 2 K]


@register("DFT", since=17)
def dft_grad(b, node, grads, needs):
    """DFT along ``axis`` lowered as STFT's frames are: the axis moved before the last (real
    and imaginary parts), cut or zero-padded to ``dft_length``, a ``MatMul`` by the basis,
    the axis moved back. An axis fed at run time, an irfft, or an input whose rank or last
    dimension is not known take :func:`_dft_transposed`."""
    x = node.inputs[0]
    shape = b.shape(x)
    if shape is not None and len(shape) < 3:
        raise unsupported(node, f"an input of shape {shape} (the gradient needs [..., 1 or 2])")
    rank = None if shape is None else len(shape)
    axis = _dft_axis(b, node, rank)
    irfft = node.attr("inverse", 0) and node.attr("onesided", 0)
    if axis is None or irfft or shape is None or shape[-1] not in (1, 2):
        return _dft_transposed(b, node, grads, needs, axis)
    low = Lowering(b, node)
    perm = [*(i for i in range(rank - 1) if i != axis), axis, rank - 1]
    moved = x if axis == rank - 2 else low.op("Transpose", x, perm=perm)
    static, length = _dft_length(b, low, node, moved, shape[axis], rank)
    if node.input(1) is not None:
        moved = _cut_or_padded(low, moved, length, rank)
    rows = low.op("Reshape", moved, low.ints([0] * (rank - 2) + [-1]))
    onesided, inverse = node.attr("onesided", 0), node.attr("inverse", 0)
    basis = _dft_basis(low, length, static, shape[-1], onesided, inverse)
    spectrum = low.op("MatMul", rows, basis)
    target = node.outputs[0] if axis == rank - 2 else None
    shaped = low.op("Reshape", spectrum, low.ints([0] * (rank - 2) + [-1, 2]), output=target)
    if target is None:
        back = [perm.index(i) for i in range(rank)]
        low.op("Transpose", shaped, perm=back, output=node.outputs[0])
    return low.gradients(grads, [needs[0], *[False] * (len(needs) - 1)])


def _dft_axis(b, node, rank: int | None) -> int | None:
    """The transformed axis: the attribute (default 1) before opset 20, then a constant
    input (default -2); None for an axis known at run time only."""
    if b.opset < 20:
        axis = node.attr("axis", 1)
    elif node.input(2) is None:
        axis = -2
    else:
        value = b.constant_value(node.input(2))
        if value is None:
            return None
        axis = int(np.asarray(value).reshape(()))
    if rank is None:
        if axis < 0:
            raise unsupported(node, f"axis {axis} of an input of unknown rank")
        return axis
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank - 1:
        raise unsupported(node, f"axis {axis} of a rank-{rank} input")
    return axis


def _dft_length(b, low: Lowering, node, moved: str, size, rank: int):
    """``(L or None, L as a 0-D int64)``: ``dft_length``, else the axis's size."""
    given = node.input(1)
    value = None if given is None else b.constant_value(given)
    if value is not None:
        static = int(np.asarray(value).reshape(()))
        return static, low.ints(static)
    if given is not None:
        scalar = low.op("Reshape", given, low.ints([]))
        return None, low.op("Cast", scalar, to=TensorProto.INT64)
    if isinstance(size, int):
        return size, low.ints(size)
    return None, low.op("Gather", low.op("Shape", moved), low.ints(rank - 2), axis=0)


def _cut_or_padded(low: Lowering, moved: str, length: str, rank: int) -> str:
    """``moved`` cut or zero-padded to ``length`` along its axis ``rank - 2``."""
    end = low.op("Unsqueeze", length, low.ints([0]))
    cut = low.op("Slice", moved, low.ints([0]), end, low.ints([rank - 2]))
    size = low.op("Gather", low.op("Shape", cut), low.ints([rank - 2]), axis=0)
    extra = low.op("Max", low.op("Sub", end, size), low.ints([0]))
    pads = low.op("Concat", low.ints([0] * (2 * rank - 2)), extra, low.ints([0]), axis=0)
    return low.op("Pad", cut, pads)


def _dft_transposed(b, node, grads, needs, axis: int | None):
    r"""The input's gradient as a DFT of the output's, along the same axis (an input fed at
    run time too), for a length-``n`` transform ``F`` (:math:`F_{kj} = e^{-2\pi i k j / n}`,
    symmetric, :math:`F^H = n F^{-1}`) with Hermitian weights :math:`w_k = 2` but
    :math:`w_0 = w_{n/2} = 1` on the ``n // 2 + 1`` bins of a half spectrum:

    * ``y = F x``: :math:`\bar x = n F^{-1} \bar y`; one-sided (the first bins), the same
      with :math:`\bar y` zero-padded to ``n`` bins (by the DFT's ``dft_length``);
    * ``y = F^{-1} x``: :math:`\bar x = F \bar y / n`; one-sided (irfft, real ``y``), as
      :math:`\mathrm{irfft}_n(Z)_j = \frac1n \sum_k w_k \Re(Z_k e^{2\pi i k j / n})`:
      :math:`\bar x = (w / n)\, \mathrm{rfft}_n(\bar y)`;

    the real part where ``x`` is real (its last dimension 1); where ``dft_length`` cuts or
    zero-pads the input to ``n`` values (``n // 2 + 1`` bins for an irfft), the transpose
    pads or cuts back."""
    x, (g,) = node.inputs[0], grads
    shape = b.shape(x)
    inverse, onesided = node.attr("inverse", 0), node.attr("onesided", 0)
    rank = len(shape) if shape is not None else b.op("Size", b.op("Shape", x))
    last = None if shape is None else shape[-1]
    axis_input = None if b.opset < 20 else _axis_input(b, node, axis)
    static, n = _transform_length(b, node, shape, rank, axis, axis_input, onesided and inverse)
    scale = b.op("Cast", n, to=b.dtype(g))
    axis_attrs = {"axis": node.attr("axis", 1)} if b.opset < 20 else {}
    axis_args = [axis_input] if axis_input is not None else []
    where = (rank, axis, axis_input)
    weights = _hermitian_weights(b, static, n, g, *where) if onesided and inverse else None

    def dft(value, **attrs):
        return b.op("DFT", value, n, *axis_args, **axis_attrs, **attrs)

    if weights is not None:
        grad = b.mul(dft(g, onesided=1), b.op("Div", weights, scale))
    elif inverse:
        grad = b.op("Div", dft(g), scale)
    else:
        grad = b.mul(dft(g, inverse=1), scale)  # a half spectrum zero-padded to n bins
    if node.input(1) is not None:
        grad = _fitted_along(b, grad, _length_along(b, x, *where), *where)
    if last != 2:  # the real part of a real input's gradient
        size = b.ints([1]) if last == 1 else b.op("Shape", x, start=-1)
        grad = b.op("Slice", grad, b.ints([0]), size, b.ints([-1]))
    if node.input(1) is not None:  # x's shape, which inference loses through the Pad
        grad = reshape_to(b, grad, b.op("Shape", x), x)
    return [grad if needs[0] else None, *[None] * (len(needs) - 1)]


def _axis_input(b, node, axis: int | None) -> str:
    """The axis as a 0-D int64 (the node's own input where it is fed at run time)."""
    if axis is None:
        return b.op("Reshape", node.input(2), b.ints([]))
    return b.ints(axis)


def _rank_value(b, rank: int | str) -> str:
    """The rank as a 0-D int64: a constant, or ``rank`` itself computed at run time."""
    return b.ints(rank) if isinstance(rank, int) else rank


def _position(b, rank: int | str, axis: int | None, axis_input: str | None) -> str:
    """The transformed axis as a 0-D int64 in ``[0, rank)``."""
    if axis is not None:
        return b.ints(axis)
    return b.op("Mod", axis_input, _rank_value(b, rank))


def _transform_length(
    b, node, shape, rank, axis, axis_input, irfft: bool
) -> tuple[int | None, str]:
    """``(n or None, n as a 0-D int64)``: ``dft_length``, else the input's length along the
    axis (``2 (K - 1)`` for an irfft of ``K`` bins); a constant wherever it is known when
    building."""
    given = node.input(1)
    value = None if given is None else b.constant_value(given)
    size = None if axis is None or shape is None else shape[axis]
    static = (
        int(np.asarray(value).reshape(()))
        if value is not None
        else (2 * (size - 1) if irfft else size)
        if given is None and isinstance(size, int)
        else None
    )
    if static is not None:
        return static, b.ints(static)
    if given is not None:
        return None, b.op("Cast", b.op("Reshape", given, b.ints([])), to=TensorProto.INT64)
    position = _position(b, rank, axis, axis_input)
    size = b.op("Gather", b.op("Shape", node.inputs[0]), position, axis=0)
    return None, b.op("Mul", b.op("Sub", size, b.ints(1)), b.ints(2)) if irfft else size


def _unsqueezed(b, scalar: str) -> str:
    return b.op("Unsqueeze", scalar, b.ints([0]))


def _length_along(b, x: str, rank: int | str, axis, axis_input) -> str:
    """``x``'s length along the transformed axis, ``[1]`` int64."""
    position = _unsqueezed(b, _position(b, rank, axis, axis_input))
    return b.op("Gather", b.op("Shape", x), position, axis=0)


def _fitted_along(b, value: str, size: str, rank: int | str, axis, axis_input) -> str:
    """``value`` cut or zero-padded along the transformed axis to ``size`` (``[1]``); the
    pads a full ``2 rank`` vector, with which shape inference keeps the rank."""
    position = _position(b, rank, axis, axis_input)
    axes = _unsqueezed(b, position)
    cut = b.op("Slice", value, b.ints([0]), size, axes)
    have = b.op("Gather", b.op("Shape", cut), axes, axis=0)
    extra = b.op("Max", b.op("Sub", size, have), b.ints([0]))
    rank = _rank_value(b, rank)
    slots = b.op("Range", b.ints(0), b.op("Mul", rank, b.ints(2)), b.ints(1))
    at_end = b.op("Equal", slots, b.op("Add", position, rank))
    return b.op("Pad", cut, b.op("Where", at_end, extra, b.ints([0])))


def _hermitian_weights(b, static, n: str, like: str, rank: int | str, axis, axis_input) -> str:
    """``w_k = 2 - [k = 0] - [2 k = n]`` for ``k < n // 2 + 1``, shaped to broadcast along
    the transformed axis of a rank-``rank`` value (a constant where ``n`` and the axis are
    known when building)."""
    if static is not None and axis is not None and isinstance(rank, int):
        k = np.arange(static // 2 + 1)
        weights = 2.0 - (k == 0) - (2 * k == static)
        return b.const(weights.reshape([-1 if a == axis else 1 for a in range(rank)]), like=like)
    bins = b.op("Add", b.op("Div", n, b.ints(2)), b.ints(1))
    k = b.op("Range", b.ints(0), bins, b.ints(1))
    first = b.op("Cast", b.op("Equal", k, b.ints(0)), to=b.dtype(like))
    middle = b.op("Cast", b.op("Equal", b.op("Mul", k, b.ints(2)), n), to=b.dtype(like))
    weights = b.op("Sub", b.op("Sub", b.const(2.0, like=like), first), middle)
    at_axis = b.op(
        "Equal",
        b.op("Range", b.ints(0), _rank_value(b, rank), b.ints(1)),
        _position(b, rank, axis, axis_input),
    )
    shape = b.op("Where", at_axis, _unsqueezed(b, bins), b.ints([1]))
    return b.op("Reshape", weights, shape)
