"""Rule table entries: Conv and ConvTranspose (1-D to 3-D, strides, pads, auto_pad, dilations,
groups 1 / 2 / depthwise, output_padding, output_shape, with and without bias).

The onnx reference evaluator computes grouped ConvTranspose only with one input and one
output channel per group and without bias, so grouped ConvTranspose cases are depthwise without
bias. Cases name ``kernel_shape``: without it, shape inference cannot give the output a rank
when the kernel's shape is unknown (the dynamic runs), and the harness needs that rank; the
``flat`` cases follow the convolution with a Reshape to exercise kernels known only at run time.
"""

import numpy as np
from onnx import helper

from tests.derivative.autodiff.gradcheck import OpCase

rng = np.random.default_rng(3)


def r(*shape):
    return rng.standard_normal(shape)


def conv(id, x, w, bias=True, opset=18, **attrs):
    inputs = {"X": r(*x), "W": r(*w)}
    if bias:
        inputs["B"] = r(w[0])
    attrs.setdefault("kernel_shape", list(w[2:]))
    return OpCase("Conv", inputs, attrs, opset=opset, id=f"Conv-{id}")


def conv_transpose(id, x, w, bias=True, opset=18, **attrs):
    inputs = {"X": r(*x), "W": r(*w)}
    if bias:
        inputs["B"] = r(w[1] * attrs.get("group", 1))
    attrs.setdefault("kernel_shape", list(w[2:]))
    return OpCase("ConvTranspose", inputs, attrs, opset=opset, id=f"ConvTranspose-{id}")


def flat(op_type, id, x, w, opset=18, **attrs):
    """``Reshape(op(X, W), [-1])``: no ``kernel_shape``, the output rank is still inferable."""

    def graph(inputs, outputs):
        return [
            helper.make_node(op_type, inputs, ["conv"], **attrs),
            helper.make_node("Constant", [], ["flat_shape"], value_ints=[-1]),
            helper.make_node("Reshape", ["conv", "flat_shape"], outputs),
        ]

    inputs = {"X": r(*x), "W": r(*w)}
    return OpCase(op_type, inputs, attrs, opset=opset, id=f"{op_type}-{id}", graph=graph)


CASES = [
    conv("1d", (2, 3, 7), (4, 3, 3), opset=13),
    conv("1d-stride3-remainder-opset11", (1, 2, 10), (2, 2, 2), strides=[3], opset=11),
    conv("1d-group2-stride2-dilation2", (1, 4, 9), (2, 2, 2), group=2, strides=[2],
         dilations=[2], pads=[1, 0]),
    conv("1d-channels16-stride2", (1, 16, 5), (2, 16, 2), strides=[2], pads=[1, 0]),
    conv("1d-group2-channels32", (1, 32, 3), (4, 16, 2), group=2, pads=[0, 1], bias=False),
    conv("2d-pointwise-stride2", (2, 3, 3, 2), (4, 3, 1, 1), strides=[2, 1], opset=13),
    conv("2d-stride2-pads-uneven", (1, 2, 6, 5), (3, 2, 3, 3), strides=[2, 2],
         pads=[1, 1, 1, 1]),
    conv("2d-dilation-asymmetric-pads", (1, 2, 7, 6), (2, 2, 2, 2), dilations=[2, 1],
         pads=[0, 1, 1, 0], opset=21),
    conv("2d-group2", (1, 4, 5, 5), (4, 2, 3, 3), group=2, strides=[2, 1], pads=[1, 0, 0, 1]),
    conv("2d-depthwise", (1, 3, 5, 6), (3, 1, 3, 3), group=3, pads=[1, 1, 1, 1]),
    conv("2d-depthwise-stride2", (2, 2, 5, 5), (2, 1, 3, 2), group=2, strides=[2, 2],
         bias=False),
    conv("2d-depthwise-multiplier", (1, 2, 6, 5), (4, 1, 2, 3), group=2, strides=[2, 1]),
    conv("2d-same-upper", (1, 2, 7, 6), (2, 2, 3, 3), auto_pad="SAME_UPPER", strides=[2, 2]),
    conv("2d-same-lower", (1, 1, 6, 5), (2, 1, 2, 2), auto_pad="SAME_LOWER", strides=[2, 2],
         opset=13),
    conv("2d-valid-kernel-shape", (1, 2, 5, 6), (2, 2, 2, 3), auto_pad="VALID",
         kernel_shape=[2, 3], bias=False),
    flat("Conv", "2d-group2-flat", (1, 4, 5, 4), (2, 2, 2, 3), group=2, strides=[2, 1],
         pads=[0, 1, 1, 0]),
    flat("Conv", "2d-same-lower-flat", (1, 2, 5, 4), (2, 2, 2, 3), auto_pad="SAME_LOWER",
         strides=[2, 1]),
    # 16+ channels on a small output area: the kernel gradient by patches (im2col by one Conv)
    conv("2d-channels16-patches-stride2-pads", (2, 16, 5, 6), (3, 16, 3, 2), strides=[2, 2],
         pads=[1, 0, 1, 1]),
    conv("2d-channels16-patches-dilation", (1, 16, 6, 5), (2, 16, 2, 2), dilations=[2, 1],
         pads=[0, 1, 1, 0], bias=False),
    conv("2d-channels16-patches-pointwise-stride2", (2, 16, 4, 3), (2, 16, 1, 1),
         strides=[2, 2]),
    conv("1d-channels16-patches-same-upper", (1, 16, 7), (2, 16, 3), auto_pad="SAME_UPPER",
         strides=[2]),
    conv("3d-channels16-patches", (1, 16, 3, 3, 2), (2, 16, 2, 2, 1), pads=[1, 0, 0, 0, 1, 0]),
    conv("3d", (1, 2, 4, 4, 3), (2, 2, 2, 2, 2), strides=[2, 1, 1], pads=[1, 0, 0, 0, 1, 1]),
    conv_transpose("1d", (2, 3, 4), (3, 2, 3), opset=13),
    conv_transpose("1d-channels16-stride2-opset11", (1, 2, 3), (2, 16, 2), strides=[2],
                   bias=False, opset=11),
    conv_transpose("2d-stride2-pads-output-padding", (1, 2, 3, 3), (2, 3, 3, 3),
                   strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 0]),
    conv_transpose("2d-stride2-dilation2", (1, 2, 3, 2), (2, 2, 2, 2), strides=[2, 2],
                   dilations=[2, 2], bias=False),
    conv_transpose("2d-depthwise-stride2", (1, 3, 3, 4), (3, 1, 3, 3), group=3,
                   strides=[2, 2], pads=[1, 0, 0, 1], bias=False),
    conv_transpose("2d-output-shape", (1, 2, 3, 3), (2, 2, 3, 3), strides=[2, 2],
                   output_shape=[7, 7], opset=21),
    # one beyond the full 7 x 7 output along each axis: the appended row and column hold B
    conv_transpose("2d-output-shape-beyond-full", (1, 2, 3, 3), (2, 2, 3, 3), strides=[2, 3],
                   output_shape=[8, 10], opset=21),
    conv_transpose("2d-output-shape-beyond-full-same-lower", (1, 1, 3, 2), (1, 2, 2, 3),
                   strides=[3, 2], output_shape=[9, 6], auto_pad="SAME_LOWER"),
    conv_transpose("2d-same-upper", (1, 2, 3, 3), (2, 1, 3, 3), strides=[2, 2],
                   auto_pad="SAME_UPPER"),
    flat("ConvTranspose", "2d-flat", (1, 2, 3, 2), (2, 2, 3, 2), strides=[2, 2],
         pads=[1, 0, 0, 1], output_padding=[1, 1]),
    conv_transpose("2d-channels16-patches", (1, 3, 3, 2), (3, 16, 2, 3), strides=[2, 1],
                   pads=[1, 0, 0, 1]),
    conv_transpose("3d", (1, 2, 2, 2, 2), (2, 1, 2, 2, 2), strides=[2, 1, 2],
                   pads=[0, 1, 0, 0, 0, 1]),
]  # fmt: skip
