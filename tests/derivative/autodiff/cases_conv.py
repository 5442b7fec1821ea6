"""Rule table entries: Conv and ConvTranspose (1-D to 3-D, strides, pads, auto_pad, dilations,
groups 1 / 2 / depthwise, output_padding, output_shape, with and without bias), DeformConv
(2-D, pads, strides, dilations, groups, offset groups, mask, bias; checked against the
reference DeformConv with its sampling coordinates in float64).

The onnx reference evaluator computes grouped ConvTranspose only with one input and one
output channel per group and without bias, so grouped ConvTranspose cases are depthwise without
bias. Cases name ``kernel_shape``: without it, shape inference cannot give the output a rank
when the kernel's shape is unknown (the dynamic runs), and the harness needs that rank; the
``flat`` cases follow the convolution with a Reshape to exercise kernels known only at run time.
"""

import numpy as np
from onnx import helper
from onnx.reference import ReferenceEvaluator

from tests.derivative.autodiff.gradcheck import OpCase
from tests.derivative.float64_reference import DeformConv, GridSample
from tests.derivative.reference_conv import CONV_OPS

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


def float64_deform_conv(model):
    return ReferenceEvaluator(model, new_ops=[GridSample, DeformConv, *CONV_OPS])


def deform_conv(id, x, w, out, mask=False, bias=False, opset=19, **attrs):
    """Random offsets (sampling points almost surely off the pixel grid, where the bilinear
    weights have kinks); some points fall outside the image."""
    n = x[0]
    groups = attrs.get("offset_group", 1)
    taps = w[2] * w[3]
    inputs = {"X": r(*x), "W": r(*w), "offset": 0.8 * r(n, 2 * groups * taps, *out)}
    if bias:
        inputs["B"] = r(w[0])
    if mask:
        inputs.setdefault("B", None)
        inputs["mask"] = rng.uniform(0.2, 1.0, (n, groups * taps, *out))
    attrs.setdefault("kernel_shape", list(w[2:]))
    return OpCase(
        "DeformConv",
        inputs,
        attrs,
        opset=opset,
        evaluator=float64_deform_conv,
        dynamic_shapes=False,
        rtol=1e-5,
        id=f"DeformConv-{id}",
    )


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
    # up to strides - 1 beyond the full output (9 x 11, 10, 9 x 8): appended outputs
    conv_transpose("2d-output-shape-beyond-full-by-strides-minus-one", (1, 2, 3, 3),
                   (2, 2, 3, 3), strides=[3, 4], output_shape=[11, 14]),
    conv_transpose("1d-output-shape-beyond-full-by-three", (1, 2, 3), (2, 3, 2), strides=[4],
                   output_shape=[13]),
    conv_transpose("2d-dilation-output-shape-beyond-full", (1, 1, 3, 3), (1, 2, 2, 2),
                   strides=[3, 3], dilations=[2, 1], output_shape=[11, 9], bias=False),
    conv_transpose("2d-same-upper", (1, 2, 3, 3), (2, 1, 3, 3), strides=[2, 2],
                   auto_pad="SAME_UPPER"),
    flat("ConvTranspose", "2d-flat", (1, 2, 3, 2), (2, 2, 3, 2), strides=[2, 2],
         pads=[1, 0, 0, 1], output_padding=[1, 1]),
    conv_transpose("2d-channels16-patches", (1, 3, 3, 2), (3, 16, 2, 3), strides=[2, 1],
                   pads=[1, 0, 0, 1]),
    conv_transpose("3d", (1, 2, 2, 2, 2), (2, 1, 2, 2, 2), strides=[2, 1, 2],
                   pads=[0, 1, 0, 0, 0, 1]),
]  # fmt: skip

# DeformConv: the engine differentiates its lowering (gradients of X, W, offsets, B, mask)
CASES += [
    deform_conv("basic", (1, 1, 4, 4), (1, 1, 2, 2), (3, 3)),
    deform_conv("pads-strides-dilations-bias", (1, 2, 5, 4), (2, 2, 2, 2), (3, 4),
                pads=[1, 1, 1, 1], strides=[2, 1], dilations=[1, 2], bias=True),
    deform_conv("groups-offset-groups-mask", (2, 4, 4, 3), (2, 2, 2, 1), (3, 3),
                group=2, offset_group=2, mask=True),
    deform_conv("mask-bias-opset22", (1, 2, 3, 3), (3, 2, 2, 2), (2, 2), mask=True,
                bias=True, opset=22),
]  # fmt: skip
