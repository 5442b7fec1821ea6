"""Rule table entries: MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool (1-D to 3-D,
strides 1 and 2, pads, dilations, ceil_mode, count_include_pad, auto_pad, storage_order, the
Indices output), RoiAlign (avg and max, both coordinate modes, rois partly outside),
LpPool, GlobalLpPool (against a numpy oracle: no runtime computes it in
float64) and the 1-D pooling PyTorch exports as
Unsqueeze + 2-D pool + Squeeze.

Inputs are distinct random values, so every window has a single maximum. The onnx reference
evaluator fails on ceil_mode with asymmetric pads or strides above 2, and computes
GlobalMaxPool of 2-D inputs only: cases avoid those.
"""

from dataclasses import replace

import numpy as np
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from tests.derivative.autodiff.gradcheck import OpCase

rng = np.random.default_rng(4)


def r(*shape):
    return rng.standard_normal(shape)


# the top-left 3x3 block is zero: the 2x2 windows inside it give y = 0 (gradient 0 there),
# those that overlap it reach zeros through |x|^(p-1) = 0
ZERO_WINDOWS = r(1, 2, 4, 5)
ZERO_WINDOWS[:, :, :3, :3] = 0.0


class GlobalLpPool(OpRun):
    """``(sum over the spatial axes of |x|^p)^(1/p)``, keeping them as size 1."""

    op_domain = ""

    def _run(self, x, p=2):
        axes = tuple(range(2, x.ndim))
        return ((np.sum(np.abs(x) ** p, axis=axes, keepdims=True) ** (1.0 / p)).astype(x.dtype),)


def with_global_lp_pool(model):
    return ReferenceEvaluator(model, new_ops=[GlobalLpPool])


def global_lp_pool(id, x, opset=18, **attrs):
    return OpCase(
        "GlobalLpPool",
        {"X": x},
        attrs,
        opset=opset,
        evaluator=with_global_lp_pool,
        id=f"GlobalLpPool-{id}",
    )


def pool(op_type, id, shape, opset=18, **attrs):
    return OpCase(op_type, {"X": r(*shape)}, attrs, opset=opset, id=f"{op_type}-{id}")


def max_pool_with_indices(id, shape, opset=18, **attrs):
    """A MaxPool whose Indices output exists but is not a graph output."""

    def graph(inputs, outputs):
        return [helper.make_node("MaxPool", inputs, [*outputs, "indices"], **attrs)]

    return OpCase("MaxPool", {"X": r(*shape)}, opset=opset, graph=graph, id=f"MaxPool-{id}")


def torch_1d(op_type, id, shape, kernel, stride, opset=18, **attrs):
    """PyTorch's 1-D pooling export: Unsqueeze(2) -> 2-D pool with a (1, k) window -> Squeeze."""

    def graph(inputs, outputs):
        pool = helper.make_node(
            op_type, ["x4"], ["y4"], kernel_shape=[1, kernel], strides=[1, stride], **attrs
        )
        if opset < 13:
            return [
                helper.make_node("Unsqueeze", inputs, ["x4"], axes=[2]),
                pool,
                helper.make_node("Squeeze", ["y4"], outputs, axes=[2]),
            ]
        return [
            helper.make_node("Constant", [], ["axes"], value_ints=[2]),
            helper.make_node("Unsqueeze", [inputs[0], "axes"], ["x4"]),
            pool,
            helper.make_node("Squeeze", ["y4", "axes"], outputs),
        ]

    return OpCase(op_type, {"X": r(*shape)}, opset=opset, graph=graph, id=f"{op_type}-{id}")


CASES = [
    pool("MaxPool", "1d-stride1-opset13", (2, 2, 7), kernel_shape=[3], opset=13),
    pool("MaxPool", "1d-stride2-pads-opset11", (2, 2, 8), kernel_shape=[3], strides=[2],
         pads=[1, 1], opset=11),
    pool("MaxPool", "2d-stride2-pads-ceil-opset13", (1, 2, 6, 7), kernel_shape=[3, 3],
         strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, opset=13),
    pool("MaxPool", "2d-disjoint-opset13", (1, 2, 4, 6), kernel_shape=[2, 2], strides=[2, 2],
         opset=13),
    pool("MaxPool", "2d-dilation2-opset15", (1, 2, 6, 6), kernel_shape=[2, 2], strides=[1, 2],
         dilations=[2, 2], pads=[1, 0, 1, 1], opset=15),
    pool("MaxPool", "2d-dilation2-stride1", (1, 1, 6, 7), kernel_shape=[2, 3],
         dilations=[2, 1], pads=[1, 1, 1, 1], opset=21),
    pool("MaxPool", "2d-unit-kernel-axis", (1, 2, 6, 4), kernel_shape=[3, 1]),
    pool("MaxPool", "2d-same-upper", (1, 2, 7, 6), kernel_shape=[3, 3], strides=[2, 2],
         auto_pad="SAME_UPPER"),
    pool("MaxPool", "2d-unit-steps-same-lower", (1, 2, 5, 6), kernel_shape=[2, 3],
         auto_pad="SAME_LOWER", opset=18),
    max_pool_with_indices("2d-indices-output", (1, 2, 6, 5), kernel_shape=[3, 2],
                          strides=[2, 2]),
    max_pool_with_indices("2d-storage-order-column", (1, 2, 5, 6), kernel_shape=[2, 3],
                          strides=[2, 1], storage_order=1),
    pool("MaxPool", "3d", (1, 2, 4, 4, 3), kernel_shape=[2, 2, 2], strides=[2, 1, 2],
         pads=[1, 0, 0, 0, 1, 1]),
    pool("MaxPool", "3d-stride1-opset13", (1, 1, 4, 3, 4), kernel_shape=[2, 1, 2], opset=13),
    pool("MaxPool", "3d-unit-steps", (1, 2, 4, 3, 4), kernel_shape=[2, 2, 2], opset=16),
    # the reference evaluator fails on 3-D max pools with pads: onnxruntime is the oracle
    replace(pool("MaxPool", "3d-unit-steps-pads", (2, 1, 3, 4, 3), kernel_shape=[2, 3, 2],
                 pads=[1, 1, 0, 0, 1, 1]), evaluator="onnxruntime"),
    replace(pool("MaxPool", "3d-unit-steps-same-lower", (1, 1, 3, 4, 4), kernel_shape=[3, 2, 2],
                 auto_pad="SAME_LOWER", opset=21), evaluator="onnxruntime"),
    pool("AveragePool", "1d-stride1-opset13", (2, 2, 7), kernel_shape=[3], opset=13),
    pool("AveragePool", "1d-stride2-pads-include-opset11", (2, 2, 8), kernel_shape=[3],
         strides=[2], pads=[1, 1], count_include_pad=1, opset=11),
    pool("AveragePool", "2d-ceil-pads-exclude", (1, 2, 6, 7), kernel_shape=[3, 3],
         strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
    pool("AveragePool", "2d-ceil-include-overflow", (1, 1, 8, 6), kernel_shape=[3, 3],
         strides=[2, 2], ceil_mode=1, count_include_pad=1, opset=13),
    pool("AveragePool", "2d-dilation-include", (1, 2, 6, 5), kernel_shape=[2, 2],
         dilations=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1, opset=19),
    pool("AveragePool", "2d-dilation-stride-exclude", (1, 2, 7, 6), kernel_shape=[2, 2],
         dilations=[2, 1], strides=[2, 1], pads=[1, 1, 1, 1], opset=21),
    pool("AveragePool", "2d-same-lower", (1, 2, 7, 6), kernel_shape=[3, 3], strides=[2, 2],
         auto_pad="SAME_LOWER"),
    pool("AveragePool", "2d-valid", (1, 2, 7, 6), kernel_shape=[3, 2], strides=[2, 2],
         auto_pad="VALID"),
    pool("AveragePool", "3d-include", (1, 2, 4, 5, 5), kernel_shape=[2, 2, 2],
         strides=[2, 1, 2], pads=[1, 0, 0, 0, 1, 1], count_include_pad=1),
    pool("GlobalAveragePool", "2d", (2, 3, 3, 4)),
    pool("GlobalAveragePool", "1d-opset11", (2, 3, 5), opset=11),
    pool("GlobalAveragePool", "3d", (1, 2, 2, 3, 2), opset=21),
    pool("GlobalMaxPool", "2d", (2, 3, 3, 4)),
    pool("GlobalMaxPool", "2d-opset11", (1, 2, 5, 2), opset=11),
    torch_1d("AveragePool", "torch-1d-export", (2, 3, 8), 3, 2),
    torch_1d("MaxPool", "torch-1d-export", (2, 3, 8), 3, 1, opset=13),
    torch_1d("AveragePool", "torch-1d-export-opset11", (1, 2, 7), 2, 1, opset=11),
    pool("LpPool", "2d-default-p", (1, 2, 5, 4), kernel_shape=[2, 2], opset=11),
    global_lp_pool("2d-default-p", r(2, 3, 3, 4)),
    global_lp_pool("1d-p1-opset11", r(1, 2, 5), opset=11, p=1),
    global_lp_pool("3d-p3", r(1, 2, 2, 3, 2), opset=21, p=3),  # onnxruntime 1.32 lacks v22
    global_lp_pool("zero-plane", ZERO_WINDOWS[:, :, :3, :3] + [[[[0.0]]], [[[1.0]]]]),
    pool("LpPool", "2d-p3-strides-pads", (1, 2, 6, 5), kernel_shape=[3, 2], strides=[2, 1],
         pads=[1, 0, 1, 1], p=3),
    pool("LpPool", "1d-p1-dilation", (2, 1, 7), kernel_shape=[2], dilations=[2], p=1,
         opset=22),
    pool("LpPool", "2d-same-upper-ceil", (1, 1, 5, 6), kernel_shape=[3, 3], strides=[2, 2],
         auto_pad="SAME_UPPER", opset=18),
    *[
        OpCase("LpPool", {"X": ZERO_WINDOWS}, {"kernel_shape": [2, 2], "p": p}, opset=18,
               id=f"LpPool-zero-windows-p{p}")
        for p in (1, 2, 3)
    ],
]  # fmt: skip


def max_unpool(id, x_shape, pooled_shape, opset=18, output_shape=None, check_ort=True):
    """MaxUnpool of ``X`` at the Indices of a MaxPool (2x2, stride 2) of a constant ``P``,
    flattened (shape inference does not read ``output_shape``)."""

    def graph(inputs, outputs):
        x, p = inputs[:2]
        extra = (
            []
            if output_shape is None
            else [helper.make_node("Constant", [], ["out_shape"], value_ints=output_shape)]
        )
        unpool_inputs = [x, "indices", *([] if output_shape is None else ["out_shape"])]
        return [
            helper.make_node("MaxPool", [p], ["pooled", "indices"], kernel_shape=[2, 2],
                             strides=[2, 2]),
            *extra,
            helper.make_node("MaxUnpool", unpool_inputs, ["unpooled"], kernel_shape=[2, 2],
                             strides=[2, 2]),
            helper.make_node("Constant", [], ["flat"], value_ints=[-1]),
            helper.make_node("Reshape", ["unpooled", "flat"], outputs),
        ]  # fmt: skip

    return OpCase(
        "MaxUnpool", {"X": r(*x_shape), "P": r(*pooled_shape)}, opset=opset, graph=graph,
        constants=("P",), check_ort=check_ort, id=f"MaxUnpool-{id}",
    )  # fmt: skip


# with output_shape, onnx's test data and reference evaluator read the indices in the
# inferred shape and pad at the end; onnxruntime reads them in output_shape
CASES += [
    max_unpool("2d", (1, 2, 2, 3), (1, 2, 4, 6), opset=13),
    max_unpool(
        "2d-output-shape", (2, 1, 2, 2), (2, 1, 4, 4), output_shape=[2, 1, 5, 5], check_ort=False
    ),
    max_unpool("2d-batch", (2, 3, 1, 2), (2, 3, 2, 4), opset=22),
]


def roi_align(id, x, rois, batch, opset=22, **attrs):
    """Random rois (sampling points off the pixel grid); some reach outside the image."""
    inputs = {"X": r(*x), "rois": np.asarray(rois, dtype=float),
              "batch_indices": np.asarray(batch, dtype=np.int64)}  # fmt: skip
    return OpCase("RoiAlign", inputs, attrs, opset=opset, dynamic_shapes=False,
                  id=f"RoiAlign-{id}")  # fmt: skip


ROIS = [[0.31, 0.63, 4.17, 3.74], [-1.61, 2.23, 2.93, 6.37], [3.13, -0.43, 6.87, 2.47]]
# RoiAlign: the engine differentiates its lowering (gradients of X and the rois)
CASES += [
    roi_align("avg-half-pixel", (2, 2, 5, 6), ROIS, [0, 1, 1], output_height=2,
              output_width=3, sampling_ratio=2),
    roi_align("max-output-half-pixel-scale", (1, 3, 6, 5), ROIS[:2], [0, 0], mode="max",
              coordinate_transformation_mode="output_half_pixel", spatial_scale=0.8,
              output_height=3, output_width=2, sampling_ratio=1),
    # RoiAlign-10 samples as output_half_pixel (onnxruntime; the reference uses half_pixel)
    replace(roi_align("avg-opset11", (2, 1, 4, 5), ROIS, [1, 0, 1], opset=11, output_height=2,
                      output_width=2, sampling_ratio=3), evaluator="onnxruntime"),
    roi_align("degenerate-roi-output-half-pixel", (1, 1, 5, 5), [[2.2, 1.3, 2.6, 1.1]], [0],
              coordinate_transformation_mode="output_half_pixel", output_height=2,
              output_width=2, sampling_ratio=2),
]  # fmt: skip
