"""Rule table entries: Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Concat, Split, Expand,
Tile, Range, DepthToSpace, SpaceToDepth, Pad, Resize, Col2Im."""

import numpy as np
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.ops.op_resize import Resize as _ReferenceResize

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(2)


def r(*shape):
    return rng.standard_normal(shape)


def i64(*values):
    return np.array(values, dtype=np.int64)


def _split_with_unused_output(inputs, outputs):
    """Split into three pieces, the middle one unused: its gradient is a symbolic zero."""
    return [
        helper.make_node("Split", inputs, [outputs[0], "unused", outputs[1]], axis=1),
    ]


def _squeeze_all_then_flatten(inputs, outputs):
    """Squeeze without axes, flattened: with unknown dims the squeezed rank is unknown and a
    graph output needs a rank."""
    shape = helper.make_tensor("flat", 7, [1], [-1])
    return [
        helper.make_node("Squeeze", inputs, ["squeezed"]),
        helper.make_node("Constant", [], ["flat"], value=shape),
        helper.make_node("Reshape", ["squeezed", "flat"], outputs),
    ]


def _resize(x_shape, opset=13, scales=None, sizes=None, id="", roi=None, **attrs):
    """A Resize case; float32 ``scales`` come from a Constant node (the harness casts float
    inputs to the case's dtype, and Resize wants float scales)."""
    inputs = {"x": r(*x_shape)}
    if sizes is not None:
        inputs["sizes"] = np.array(sizes, dtype=np.int64)

    def graph(names, outputs):
        nodes, scale_name, roi_name = [], "", ""
        if roi is not None:
            value = helper.make_tensor("roi", 1, [len(roi)], roi)
            nodes.append(helper.make_node("Constant", [], ["roi"], value=value))
            roi_name = "roi"
        if scales is not None:
            value = helper.make_tensor("scales", 1, [len(scales)], scales)
            nodes.append(helper.make_node("Constant", [], ["scales"], value=value))
            scale_name = "scales"
        resize_inputs = [names[0], roi_name, scale_name, *names[1:]]
        return [*nodes, helper.make_node("Resize", resize_inputs, outputs, **attrs)]

    return OpCase("Resize", inputs, attrs, opset=opset, graph=graph, id=f"Resize-{id}")


class _OnnxruntimeResize(_ReferenceResize):
    """Resize as onnxruntime's CPU kernel runs it: ``x`` copied unchanged when the output
    shape equals ``x``'s, whatever the scales and roi (the reference evaluator samples
    there); otherwise the same sampling as the reference evaluator. Named ``Resize`` so
    that it replaces the reference evaluator's kernel."""

    op_domain = ""

    def _run(self, X, *args, **kwargs):
        (y,) = super()._run(X, *args, **kwargs)
        return (X.copy(),) if y.shape == X.shape else (y,)


_OnnxruntimeResize.__name__ = "Resize"


def onnxruntime_resize(model):
    """A float64 evaluator whose Resize follows onnxruntime (which has no float64 Resize):
    the forward of the cases below is checked against onnxruntime itself in
    ``test_rules_extra.py``."""
    return ReferenceEvaluator(model, new_ops=[_OnnxruntimeResize])


def _resize_as_onnxruntime(x_shape, **kwargs):
    """A Resize case whose forward and gradient graphs run with onnxruntime's Resize."""
    case = _resize(x_shape, **kwargs)
    case.evaluator = onnxruntime_resize
    return case


# fmt: off
RESHAPE = [
    OpCase("Reshape", {"x": r(2, 3, 2), "shape": i64(3, -1)}, opset=13, id="Reshape-13"),
    OpCase("Reshape", {"x": r(2, 3, 2), "shape": i64(0, 6)}, opset=14, id="Reshape-copy-dim"),
    OpCase("Reshape", {"x": r(2, 6), "shape": i64(4, 3)}, {"allowzero": 1}, opset=21,
           id="Reshape-allowzero"),
    OpCase("Reshape", {"x": r(0, 3), "shape": i64(3, 0)}, {"allowzero": 1}, opset=14,
           id="Reshape-allowzero-empty"),
    OpCase("Reshape", {"x": r(2, 0, 3), "shape": i64(0, 2, 3)}, {"allowzero": 1}, opset=21,
           id="Reshape-allowzero-zero-dim"),
    OpCase("Flatten", {"x": r(2, 3, 2)}, {"axis": 2}, opset=13, id="Flatten-axis2"),
    OpCase("Flatten", {"x": r(2, 3, 2)}, {"axis": 0}, opset=21, id="Flatten-axis0"),
    OpCase("Flatten", {"x": r(2, 3, 2)}, {"axis": -1}, opset=13, id="Flatten-axis-neg"),
    OpCase("Transpose", {"x": r(2, 3, 4)}, {"perm": [1, 2, 0]}, opset=13, id="Transpose-perm"),
    OpCase("Transpose", {"x": r(2, 3, 4)}, opset=21, id="Transpose-reverse"),
    OpCase("Squeeze", {"x": r(2, 1, 3, 1)}, {"axes": [1, -1]}, opset=11, id="Squeeze-attr"),
    OpCase("Squeeze", {"x": r(2, 1, 3, 1), "axes": i64(-1)}, opset=13, id="Squeeze-input"),
    OpCase("Squeeze", {"x": r(1, 3, 1)}, opset=21, graph=_squeeze_all_then_flatten,
           id="Squeeze-all"),
    OpCase("Unsqueeze", {"x": r(2, 3)}, {"axes": [0, 3]}, opset=12, id="Unsqueeze-attr"),
    OpCase("Unsqueeze", {"x": r(2, 3), "axes": i64(-1, 1)}, opset=13, id="Unsqueeze-input"),
    OpCase("Unsqueeze", {"x": r(), "axes": i64(0)}, opset=21, id="Unsqueeze-scalar"),
]

def _concat_of_squeezed(axis):
    """``Concat(Squeeze(a), Squeeze(b))`` flattened: with dynamic shapes the ranks are unknown."""

    def graph(inputs, outputs):
        a, b = inputs
        return [
            helper.make_node("Squeeze", [a], ["a_squeezed"]),
            helper.make_node("Squeeze", [b], ["b_squeezed"]),
            helper.make_node("Concat", ["a_squeezed", "b_squeezed"], ["joined"], axis=axis),
            helper.make_node("Constant", [], ["flat"], value_ints=[-1]),
            helper.make_node("Reshape", ["joined", "flat"], outputs),
        ]

    return graph


CONCAT_SPLIT = [
    OpCase("Concat", {"a": r(2, 3, 2), "b": r(2, 3, 3)}, opset=13, graph=_concat_of_squeezed(-1),
           id="Concat-unknown-rank-negative-axis"),
    OpCase("Concat", {"a": r(2, 3, 2), "b": r(2, 2, 2)}, opset=18, graph=_concat_of_squeezed(1),
           id="Concat-unknown-rank"),
    OpCase("Concat", {"a": r(2, 1, 2), "b": r(2, 3, 2), "c": r(2, 2, 2)}, {"axis": 1}, opset=13,
           id="Concat-axis1"),
    OpCase("Concat", {"a": r(2, 2), "b": r(2, 3)}, {"axis": -1}, opset=18, constants=("a",),
           id="Concat-one-needed"),
    OpCase("Concat", {"a": r(2, 3), "b": r(1, 3), "c": r(2, 3)}, {"axis": 0}, opset=11,
           id="Concat-opset11"),
    OpCase("Concat", {"a": r(2, 3)}, {"axis": 0}, opset=13, id="Concat-single"),
    OpCase("Split", {"x": r(2, 5)}, {"axis": 1, "split": [2, 3]}, opset=11, n_outputs=2,
           id="Split-attr"),
    OpCase("Split", {"x": r(6, 2), "split": i64(1, 2, 3)}, opset=13, n_outputs=3,
           id="Split-input"),
    OpCase("Split", {"x": r(2, 6)}, {"axis": -1, "num_outputs": 3}, opset=18, n_outputs=3,
           id="Split-num-outputs"),
    OpCase("Split", {"x": r(2, 7)}, {"axis": 1, "num_outputs": 3}, opset=18, n_outputs=3,
           id="Split-uneven"),
    OpCase("Split", {"x": r(2, 6)}, opset=13, n_outputs=2, graph=_split_with_unused_output,
           id="Split-unused-output"),
]

EXPAND_TILE = [
    OpCase("Expand", {"x": r(3, 1), "shape": i64(2, 3, 4)}, opset=13, id="Expand-broadcast"),
    OpCase("Expand", {"x": r(2, 3), "shape": i64(1, 1)}, opset=21, id="Expand-noop-shape"),
    OpCase("Tile", {"x": r(2, 1, 3), "repeats": i64(2, 3, 1)}, opset=13, id="Tile-13"),
    OpCase("Tile", {"x": r(2, 3), "repeats": i64(1, 1)}, opset=21, id="Tile-identity"),
]

DEPTH_SPACE = [
    OpCase("DepthToSpace", {"x": r(1, 8, 2, 3)}, {"blocksize": 2}, opset=13,
           id="DepthToSpace-DCR"),
    OpCase("DepthToSpace", {"x": r(2, 4, 2, 2)}, {"blocksize": 2, "mode": "CRD"}, opset=13,
           id="DepthToSpace-CRD"),
    OpCase("DepthToSpace", {"x": r(1, 9, 2, 1)}, {"blocksize": 3, "mode": "CRD"}, opset=21,
           id="DepthToSpace-CRD-block3"),
    OpCase("SpaceToDepth", {"x": r(1, 2, 4, 6)}, {"blocksize": 2}, opset=13, id="SpaceToDepth"),
    # SpaceToDepth has a mode from opset 28, which onnxruntime does not run yet
    OpCase("SpaceToDepth", {"x": r(1, 2, 4, 6)}, {"blocksize": 2, "mode": "CRD"}, opset=28,
           check_ort=False, id="SpaceToDepth-CRD"),
    OpCase("SpaceToDepth", {"x": r(2, 3, 6, 3)}, {"blocksize": 3, "mode": "DCR"}, opset=28,
           check_ort=False, id="SpaceToDepth-DCR-opset28"),
]

PAD = [
    OpCase("Pad", {"x": r(2, 3), "pads": i64(1, 0, 2, 3), "value": np.array(0.5)}, opset=13,
           id="Pad-constant-value"),
    OpCase("Pad", {"x": r(2, 3), "pads": i64(0, 1, 1, 0)}, opset=11, id="Pad-opset11"),
    OpCase("Pad", {"x": r(2, 3, 2), "pads": i64(1, 2), "value": None, "axes": i64(-2)},
           opset=18, id="Pad-axes"),
    OpCase("Pad", {"x": r(2, 3), "pads": i64(1, 2, 0, 2)}, {"mode": "reflect"}, opset=18,
           id="Pad-reflect"),
    OpCase("Pad", {"x": r(2, 3), "pads": i64(2, 0, 1, 3)}, {"mode": "edge"}, opset=16,
           id="Pad-edge"),
    OpCase("Pad", {"x": r(2, 3), "pads": i64(1, 1, 0, 2)}, {"mode": "wrap"}, opset=19,
           id="Pad-wrap"),
    OpCase("Pad", {"x": r(3, 2, 2), "pads": i64(1, 2), "value": None, "axes": i64(0)},
           {"mode": "edge"}, opset=21, id="Pad-edge-axes"),
    OpCase("Pad", {"x": r(2, 4, 5), "pads": i64(0, 3, 1, 0, 2, 4)}, {"mode": "reflect"},
           opset=13, id="Pad-reflect-opset13"),
    OpCase("Pad", {"x": r(3, 1, 4), "pads": i64(2, 1, 0, 1, 3, 2)}, {"mode": "edge"},
           opset=11, id="Pad-edge-opset11"),
    # negative pads crop first (onnx's reference refuses them: onnxruntime is the oracle)
    OpCase("Pad", {"x": r(2, 6), "pads": i64(0, 1, 0, -1)}, {"mode": "edge"}, opset=17,
           evaluator="onnxruntime", id="Pad-edge-shift"),
    OpCase("Pad", {"x": r(3, 7), "pads": i64(-1, 2, 0, -2)}, {"mode": "reflect"}, opset=18,
           evaluator="onnxruntime", id="Pad-reflect-crop"),
]

RESIZE = [
    _resize((1, 2, 2, 3), scales=[1, 1, 2, 2], mode="nearest", id="nearest-up2"),
    _resize((1, 1, 4, 4), sizes=[1, 1, 3, 3], roi=[0, 0, 0.2, 0.3, 1, 1, 1.2, 0.8],
            mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
            extrapolation_value=2.5, id="linear-tf-crop-and-resize"),
    _resize((1, 2, 3, 4), scales=[2.0, 1.5], roi=[-0.2, 0.1, 0.9, 1.3], axes=[2, 3],
            mode="cubic", coordinate_transformation_mode="tf_crop_and_resize", opset=18,
            id="cubic-tf-crop-and-resize-axes"),
    _resize((2, 3, 4), scales=[1, 1, 1.5], roi=[0, 0, -0.1, 1, 1, 1.2], mode="nearest",
            coordinate_transformation_mode="tf_crop_and_resize", opset=16,
            id="nearest-tf-crop-and-resize-grid"),
    _resize((1, 1, 3, 4), scales=[1, 1, 1.5, 0.75], mode="nearest", nearest_mode="floor",
            coordinate_transformation_mode="asymmetric", id="nearest-fractional"),
    _resize((2, 1, 3, 2), scales=[1, 1, 2, 1.5], mode="linear",
            coordinate_transformation_mode="half_pixel", id="linear-half-pixel"),
    _resize((1, 2, 3, 3), sizes=[1, 2, 5, 4], mode="cubic",
            coordinate_transformation_mode="align_corners", id="cubic-sizes"),
    _resize((3, 4), scales=[2, 0.5], mode="linear", id="linear-2d"),
    _resize((1, 1, 2, 2, 3), scales=[1, 1, 2, 1.5, 2], mode="linear", opset=18,
            coordinate_transformation_mode="pytorch_half_pixel", id="linear-3d-spatial"),
    _resize((1, 2, 6, 4), scales=[0.5, 0.5], mode="linear", antialias=1, axes=[2, 3], opset=18,
            id="linear-antialias-axes"),
    _resize((1, 1, 4, 3), sizes=[2, 5], mode="cubic", axes=[2, 3], opset=18, exclude_outside=1,
            cubic_coeff_a=-0.5, id="cubic-sizes-axes"),
    _resize((1, 1, 3, 3), scales=[1, 1, 1.6, 2.4], mode="nearest", opset=19,
            coordinate_transformation_mode="half_pixel_symmetric",
            nearest_mode="round_prefer_ceil", id="nearest-symmetric"),
    _resize((1, 2, 3, 2), scales=[2, 1.5, 1.5, 2], mode="nearest", opset=18,
            id="nearest-every-axis"),
    _resize((1, 1, 3, 4), sizes=[4, 4], axes=[2, 3], mode="nearest", opset=18,
            keep_aspect_ratio_policy="not_larger", id="nearest-keep-aspect-ratio"),
    _resize((2, 3, 2), scales=[1, 1, 2.5], mode="nearest", opset=16,
            coordinate_transformation_mode="align_corners", id="nearest-align-corners"),
]
#: a scale != 1 on an axis that keeps its size (6 * 1.1 -> 6) is still sampled there by
#: onnxruntime, unless the whole output shape equals x's (a copy)
RESIZE_KEPT_SIZE = [
    _resize_as_onnxruntime((1, 1, 3, 6), scales=[1, 1, 2, 1.1], mode="nearest",
                           coordinate_transformation_mode="asymmetric", nearest_mode="floor",
                           id="kept-size-nearest-asymmetric"),
    _resize_as_onnxruntime((1, 1, 3, 6), scales=[1, 1, 2, 1.1], mode="linear",
                           coordinate_transformation_mode="asymmetric",
                           id="kept-size-linear-asymmetric"),
    _resize_as_onnxruntime((1, 2, 4, 5), scales=[1, 1, 0.5, 1.1], mode="linear",
                           coordinate_transformation_mode="half_pixel",
                           id="kept-size-linear-half-pixel"),
    _resize_as_onnxruntime((1, 1, 4, 5), scales=[1, 1, 1.5, 1.15], mode="nearest",
                           coordinate_transformation_mode="half_pixel",
                           nearest_mode="round_prefer_ceil", id="kept-size-nearest-half-pixel"),
    _resize_as_onnxruntime((2, 1, 3, 7), scales=[1, 1, 2, 1.1], mode="linear",
                           coordinate_transformation_mode="pytorch_half_pixel",
                           id="kept-size-linear-pytorch-half-pixel"),
    _resize_as_onnxruntime((1, 1, 3, 5), scales=[1, 1, 2, 1.1], mode="cubic",
                           coordinate_transformation_mode="pytorch_half_pixel",
                           id="kept-size-cubic-pytorch-half-pixel"),
    _resize_as_onnxruntime((1, 1, 3, 5), scales=[2, 1.1], axes=[2, 3], mode="linear",
                           opset=18, coordinate_transformation_mode="half_pixel",
                           id="kept-size-linear-axes"),
    _resize_as_onnxruntime((1, 1, 3, 5), scales=[1, 1, 2, 1.1], mode="nearest", opset=16,
                           coordinate_transformation_mode="pytorch_half_pixel",
                           nearest_mode="floor", id="kept-size-nearest-pytorch-half-pixel"),
    _resize_as_onnxruntime((1, 6, 3, 4), scales=[1, 1.1, 2, 1], mode="nearest",
                           id="kept-size-nearest-channel-axis"),
    _resize_as_onnxruntime((1, 6, 3, 2), scales=[1, 1.1, 2, 1], mode="linear",
                           coordinate_transformation_mode="asymmetric",
                           id="kept-size-linear-nhwc"),
    _resize_as_onnxruntime((1, 1, 4, 6), scales=[1, 1, 1.1, 1.1], mode="nearest",
                           coordinate_transformation_mode="asymmetric", nearest_mode="floor",
                           id="same-shape-nearest-copies"),
    _resize_as_onnxruntime((1, 1, 4, 6), scales=[1, 1, 1.1, 1.1], mode="linear",
                           coordinate_transformation_mode="half_pixel",
                           id="same-shape-linear-copies"),
    _resize_as_onnxruntime((1, 1, 4, 6), scales=[1, 1, 1.2, 1.1], mode="linear",
                           coordinate_transformation_mode="tf_crop_and_resize",
                           roi=[0, 0, 0.1, 0.2, 1, 1, 0.9, 0.95],
                           id="same-shape-linear-crop-copies"),
]
# fmt: on

#: a float Range: ``start`` and ``delta`` move every element, ``limit`` only the length
RANGE = [
    OpCase(
        "Range",
        {"start": np.array(1.3), "limit": np.array(9.7), "delta": np.array(1.9)},
        opset=11,
        id="Range-float",
    ),
    OpCase(
        "Range",
        {"start": np.array(2.0), "limit": np.array(-3.1), "delta": np.array(-0.7)},
        opset=11,
        id="Range-float-descending",
    ),
]

CASES = RESHAPE + CONCAT_SPLIT + EXPAND_TILE + DEPTH_SPACE + PAD + RESIZE + RESIZE_KEPT_SIZE
CASES += RANGE

SECOND_ORDER_IDS = {
    "Reshape-13", "Flatten-axis-neg", "Transpose-perm", "Squeeze-input", "Unsqueeze-input",
    "Concat-axis1", "Expand-broadcast", "Tile-13", "DepthToSpace-DCR", "DepthToSpace-CRD",
    "SpaceToDepth", "Pad-constant-value", "Pad-axes", "Pad-reflect", "Resize-nearest-up2",
    "Resize-nearest-every-axis", "Resize-linear-half-pixel", "Resize-cubic-sizes-axes",
}  # fmt: skip
SECOND_ORDER = [second_order(case) for case in CASES if case.id in SECOND_ORDER_IDS]
assert len(SECOND_ORDER) == len(SECOND_ORDER_IDS), "a second-order id names no case"
CASES += SECOND_ORDER


def _col2im_runtime_shapes(inputs, outputs):
    """Col2Im whose image and block shapes are computed in the graph."""
    x, image, block = inputs
    return [
        helper.make_node("Identity", [image], ["image_shape"]),
        helper.make_node("Abs", [block], ["block_shape"]),
        helper.make_node("Col2Im", [x, "image_shape", "block_shape"], outputs, strides=[2, 1]),
    ]


# fmt: off
CASES += [
    OpCase("Col2Im", {"x": r(1, 4, 16), "image": i64(5, 5), "block": i64(2, 2)}, opset=18,
           id="Col2Im-2d"),
    OpCase("Col2Im", {"x": r(2, 6, 6), "image": i64(5, 6), "block": i64(1, 3)},
           {"strides": [2, 2], "dilations": [1, 2], "pads": [1, 0, 0, 1]}, opset=21,
           id="Col2Im-strides-dilations-pads"),
    OpCase("Col2Im", {"x": r(1, 8, 12), "image": i64(3, 3, 2), "block": i64(2, 2, 2)},
           {"pads": [0, 1, 0, 0, 0, 1]}, opset=18, id="Col2Im-3d"),
    OpCase("Col2Im", {"x": r(1, 4, 6), "image": i64(4, 4), "block": i64(2, -2)}, opset=18,
           graph=_col2im_runtime_shapes, id="Col2Im-runtime-shapes"),
]
# fmt: on
