r"""``Conv`` and ``Col2Im`` for the float64 reference, computed as one product per kernel
offset instead of onnx's element loops (``Col2Im`` visits every output index in Python:
two thirds of basic-pitch's front-end test, three quarters of a second derivative of a
strided ``Conv``).

:data:`CONV_OPS` go to ``ReferenceEvaluator(..., new_ops=...)``.

For a kernel offset ``k`` (one index per spatial axis) the input window it meets at every
output position is a strided slice of the padded input,

    window_k[n, c, o] = x_pad[n, c, o * stride + k * dilation],

so ``Conv`` is ``y[n, m, o] = b[m] + sum_k sum_c W[m, c, k] window_k[n, c, o]`` (per group), and
``Col2Im``, its adjoint, adds each block column back where ``window_k`` reads, as
``ConvTranspose`` adds ``sum_c x[n, c, i] W[c, m, k]`` at ``i * stride + k * dilation`` (less
the begin pads). Each falls back to onnx's implementation where an attribute leaves that
form (``auto_pad`` SAME, an ``output_shape``).
"""

from __future__ import annotations

import itertools

import numpy as np
from onnx.reference.ops.op_col2im import Col2Im as _ReferenceCol2Im
from onnx.reference.ops.op_conv import Conv as _ReferenceConv
from onnx.reference.ops.op_conv_transpose import ConvTranspose as _ReferenceConvTranspose


def _window(k, dilations, strides, outputs) -> tuple:
    """The index of ``window_k`` in a ``[N, C, *spatial]`` array: the positions
    ``k d + i s`` for ``i`` below the output size, along each spatial axis."""
    axes = (
        slice(k[d] * dilations[d], k[d] * dilations[d] + strides[d] * (outputs[d] - 1) + 1,
              strides[d])
        for d in range(len(k))
    )  # fmt: skip
    return (slice(None), slice(None), *axes)


def _outputs(sizes, kernel, dilations, pads, strides) -> list[int]:
    """The output size along each spatial axis."""
    rank = len(sizes)
    return [
        (sizes[d] + pads[d] + pads[d + rank] - (kernel[d] - 1) * dilations[d] - 1) // strides[d] + 1
        for d in range(rank)
    ]


class Conv(_ReferenceConv):
    op_domain = ""

    def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None,
             kernel_shape=None, pads=None, strides=None):  # fmt: skip
        if auto_pad not in (None, "NOTSET", "VALID") or X.ndim < 3:
            return super()._run(X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides)
        rank = X.ndim - 2
        kernel = list(W.shape[2:])
        dilations = list(dilations or [1] * rank)
        strides = list(strides or [1] * rank)
        pads = [0] * (2 * rank) if auto_pad == "VALID" or not pads else list(pads)
        groups = group or 1
        outputs = _outputs(X.shape[2:], kernel, dilations, pads, strides)
        padded = np.pad(X, [(0, 0), (0, 0)] + [(pads[d], pads[d + rank]) for d in range(rank)])
        n, channels = X.shape[:2]
        m = W.shape[0]
        grouped_w = W.reshape(groups, m // groups, channels // groups, *kernel)
        y = np.zeros((n, groups, m // groups, *outputs), dtype=np.result_type(X, W))
        for k in itertools.product(*(range(size) for size in kernel)):
            window = padded[_window(k, dilations, strides, outputs)]
            window = window.reshape(n, groups, channels // groups, *outputs)
            y += np.einsum("ngc...,gmc->ngm...", window, grouped_w[(Ellipsis, *k)])
        y = y.reshape(n, m, *outputs)
        if B is not None:
            y += B.reshape((1, m) + (1,) * rank)
        return (y.astype(X.dtype),)


class Col2Im(_ReferenceCol2Im):
    op_domain = ""

    def _run(self, data, image_shape, block_shape, dilations=None, pads=None, strides=None):
        sizes = [int(s) for s in image_shape]
        kernel = [int(s) for s in block_shape]
        rank = len(sizes)
        dilations = list(dilations or [1] * rank)
        strides = list(strides or [1] * rank)
        pads = list(pads or [0] * (2 * rank))
        outputs = _outputs(sizes, kernel, dilations, pads, strides)
        n = data.shape[0]
        channels = data.shape[1] // int(np.prod(kernel))
        columns = data.reshape(n, channels, *kernel, *outputs)
        blocks = (slice(None),) * rank
        padded = np.zeros(
            (n, channels, *(sizes[d] + pads[d] + pads[d + rank] for d in range(rank))),
            dtype=data.dtype,
        )
        for k in itertools.product(*(range(size) for size in kernel)):
            padded[_window(k, dilations, strides, outputs)] += columns[(Ellipsis, *k, *blocks)]
        inside = tuple(slice(pads[d], pads[d] + sizes[d]) for d in range(rank))
        return (padded[(slice(None), slice(None), *inside)],)


class ConvTranspose(_ReferenceConvTranspose):
    op_domain = ""

    def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None, kernel_shape=None,
             output_padding=None, output_shape=None, pads=None, strides=None):  # fmt: skip
        if auto_pad not in (None, "NOTSET", "VALID") or output_shape is not None or X.ndim < 3:
            return super()._run(X, W, B, auto_pad, dilations, group, kernel_shape,
                                output_padding, output_shape, pads, strides)  # fmt: skip
        rank = X.ndim - 2
        kernel = list(W.shape[2:])
        dilations = list(dilations or [1] * rank)
        strides = list(strides or [1] * rank)
        pads = [0] * (2 * rank) if auto_pad == "VALID" or not pads else list(pads)
        extra = list(output_padding or [0] * rank)
        groups = group or 1
        n, channels, *sizes = X.shape
        m = W.shape[1] * groups
        full = [strides[d] * (sizes[d] - 1) + (kernel[d] - 1) * dilations[d] + 1 + extra[d]
                for d in range(rank)]  # fmt: skip
        y = np.zeros((n, groups, m // groups, *full), dtype=np.result_type(X, W))
        grouped_x = X.reshape(n, groups, channels // groups, *sizes)
        grouped_w = W.reshape(groups, channels // groups, m // groups, *kernel)
        for k in itertools.product(*(range(size) for size in kernel)):
            where = _window(k, dilations, strides, sizes)
            y[(slice(None), *where)] += np.einsum(
                "ngc...,gcm->ngm...", grouped_x, grouped_w[(Ellipsis, *k)]
            )
        y = y.reshape(n, m, *full)
        if B is not None:
            y += B.reshape((1, m) + (1,) * rank)
        inside = tuple(slice(pads[d], full[d] - pads[d + rank]) for d in range(rank))
        return (y[(slice(None), slice(None), *inside)].astype(X.dtype),)


#: the replacements, for ``ReferenceEvaluator(model, new_ops=CONV_OPS)``
CONV_OPS = [Conv, ConvTranspose, Col2Im]
