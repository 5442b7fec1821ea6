"""The reference's product-per-offset ``Conv`` and ``Col2Im`` equal onnx's own
implementations (the element loops they replace) on strided, dilated, padded and grouped
1-D to 3-D cases."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference.ops.op_col2im import Col2Im as OnnxCol2Im
from onnx.reference.ops.op_conv import Conv as OnnxConv
from onnx.reference.ops.op_conv_transpose import ConvTranspose as OnnxConvTranspose

from tests.derivative.reference_conv import Col2Im, Conv, ConvTranspose

CASES = [
    # spatial sizes, kernel, dilations, strides, pads, groups
    ((9,), (3,), (1,), (1,), (0, 0), 1),
    ((11,), (4,), (2,), (3,), (1, 2), 2),
    ((7, 6), (3, 2), (1, 2), (2, 1), (1, 0, 2, 1), 1),
    ((6, 7), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 4),
    ((5, 4, 6), (2, 3, 2), (2, 1, 1), (1, 2, 2), (0, 1, 1, 1, 0, 0), 2),
]


def _call(op, *args, **attributes):
    return op._run(object.__new__(op), *args, **attributes)[0]


@pytest.mark.parametrize(("sizes", "kernel", "dilations", "strides", "pads", "groups"), CASES)
def test_conv_equals_onnx_reference(sizes, kernel, dilations, strides, pads, groups):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, *sizes))
    w = rng.standard_normal((6 if groups != 4 else 4, 4 // groups, *kernel))
    b = rng.standard_normal(w.shape[0])
    attributes = {"dilations": dilations, "group": groups, "pads": pads, "strides": strides}
    expected = _call(OnnxConv, x, w, b, kernel_shape=kernel, **attributes)
    got = _call(Conv, x, w, b, kernel_shape=kernel, **attributes)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("sizes", "kernel", "dilations", "strides", "pads", "groups"), CASES)
def test_col2im_equals_onnx_reference(sizes, kernel, dilations, strides, pads, groups):
    rng = np.random.default_rng(1)
    rank = len(sizes)
    blocks = [
        (sizes[d] + pads[d] + pads[d + rank] - (kernel[d] - 1) * dilations[d] - 1) // strides[d] + 1
        for d in range(rank)
    ]
    data = rng.standard_normal((2, 3 * int(np.prod(kernel)), int(np.prod(blocks))))
    arguments = (data, np.array(sizes), np.array(kernel))
    attributes = {"dilations": dilations, "pads": pads, "strides": strides}
    expected = _call(OnnxCol2Im, *arguments, **attributes)
    got = _call(Col2Im, *arguments, **attributes)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("sizes", "kernel", "dilations", "strides", "pads", "groups"), CASES)
def test_conv_transpose_equals_onnx_reference_or_is_conv_adjoint(
    sizes, kernel, dilations, strides, pads, groups
):
    """Against onnx's ``ConvTranspose`` with one group (its grouped case raises); with
    groups, as the adjoint of the ``Conv`` above: ``<ConvT(x, W), y> = <x, Conv(y, W)>``."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, *sizes))
    w = rng.standard_normal((4, 3, *kernel))
    attributes = {"dilations": dilations, "group": groups, "pads": pads, "strides": strides}
    if groups == 1:
        b = rng.standard_normal(3)
        extra = [min(s, d) - 1 for s, d in zip(strides, dilations)]  # below both
        both = {**attributes, "kernel_shape": kernel, "output_padding": extra}
        expected = _call(OnnxConvTranspose, x, w, b, **both)
        np.testing.assert_allclose(_call(ConvTranspose, x, w, b, **both), expected, rtol=1e-12)
        return
    transposed = _call(ConvTranspose, x, w, None, **attributes)
    y = rng.standard_normal(transposed.shape)
    back = _call(Conv, y, w, None, **attributes)
    assert back.shape == x.shape
    np.testing.assert_allclose(np.sum(transposed * y), np.sum(x * back), rtol=1e-12)
