r"""The reference of a straight-through gradient: a quantized file whose activation rounding is
frozen at one point, written with onnx's helpers only (nothing of onnxgrad).

The straight-through estimator differentiates ``\hat x = round(x)`` as ``x`` inside the
quantization range: it is the derivative of ``clip(x) + r_0``, the residual
``r_0 = \hat x_0 - clip(x_0)`` held at its value at the point ``x_0``. That file computes
what the quantized file computes at ``x_0`` (same downstream evaluation point), so its
finite differences there are the straight-through gradient:

- ``DequantizeLinear(QuantizeLinear(x, s, z))`` of an activation becomes
  ``Clip(x, (q_{min} - 1/2 - z) s, (q_{max} + 1/2 - z) s) + r_0``: the estimator passes
  the gradient where the rounded code is in range (PyTorch's fake quantization too);
- ``MatMulInteger`` / ``ConvInteger`` of ``DynamicQuantizeLinear(x) = (q, s, z)`` read
  ``x / s_0 + r_0`` (``r_0 = q_0 - z_0 - x_0 / s_0``) instead of ``q - z``, and ``s`` is
  ``s_0`` everywhere (the range of ``x``, held; nothing is clipped); an older
  ``quantize_dynamic``'s int32 bias added to the accumulator is added as a float.

A ``ReLU`` has its mask frozen at the point too (:func:`_masked`), a ``MaxPool`` its
choice among tied values (:func:`_selected`). Weights stay as they
are: their dequantization is exact.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_RANGES = {TensorProto.UINT8: (0, 255), TensorProto.INT8: (-128, 127)}
_PRODUCTS = ("MatMulInteger", "ConvInteger")


def with_frozen_rounding(
    model: onnx.ModelProto, feeds: dict, masks_from: onnx.ModelProto | None = None
) -> onnx.ModelProto:
    """A copy of ``model`` whose activation rounding is a constant residual, taken at
    ``feeds`` (module docstring); its ReLU masks are those of the same-named nodes of
    ``masks_from`` (a float16 conversion of ``model``) when given."""
    graph = model.graph
    constants = _constant_values(graph)
    dynamic = {n.output[0]: n for n in graph.node if n.op_type == "DynamicQuantizeLinear"}
    quantized = {
        n.output[0]: n
        for n in graph.node
        if n.op_type == "QuantizeLinear" and n.input[0] not in constants
    }
    sites = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in quantized]
    wanted = [q.input[0] for q in quantized.values()] + [d.output[0] for d in sites]
    wanted += list(quantized)
    wanted += [name for n in dynamic.values() for name in (n.input[0], *n.output)]
    wanted += [n.input[0] for n in graph.node if n.op_type == "Relu"]
    at = _intermediates(model, feeds, wanted)
    at.update(_max_positions(model, feeds))
    if masks_from is not None:
        at.update(_relu_inputs_by_node(model, masks_from, feeds))
    moved = _moved_codes(graph, dynamic)
    static_moved = _moved_codes(graph, quantized)
    dequantized_moved = {
        static_moved[n.input[0]]
        for n in graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in static_moved
    }
    nodes, floated = [], set()
    for node in graph.node:
        if node.op_type in _PRODUCTS and node.input[0] in dynamic:
            nodes.extend(_float_product(node, dynamic[node.input[0]], at, constants))
            floated.add(node.output[0])
        elif node.op_type in _PRODUCTS and node.input[0] in moved:
            nodes.extend(_float_moved_product(node, constants))
            floated.add(node.output[0])
        elif node.op_type == "Concat" and node.output[0] in moved:
            nodes.extend(_float_concat(node, moved, dynamic))
        elif node.op_type == "Concat" and static_moved.get(node.output[0]) in dequantized_moved:
            quantize = quantized[static_moved[node.output[0]]]
            nodes.extend(_float_concat(node, static_moved, quantized, quantize))
        elif node.op_type == "Pad" and node.output[0] in moved:
            nodes.extend(_float_pad(node))
        elif node.op_type == "Pad" and static_moved.get(node.output[0]) in dequantized_moved:
            nodes.extend(_float_pad(node, quantized[static_moved[node.output[0]]]))
        elif node.op_type == "QuantizeLinear" and node.output[0] in dequantized_moved:
            nodes.extend(_clipped_codes(node, constants, at))
        elif node.op_type == "DequantizeLinear" and node.input[0] in static_moved:
            nodes.append(helper.make_node("Identity", [node.input[0]], [node.output[0]]))
        elif node.op_type == "DequantizeLinear" and node.input[0] in moved:
            nodes.extend(_float_dequantized(node))
        elif node.op_type == "Add" and floated.intersection(node.input):
            nodes.extend(_float_sum(node, floated))
            floated.add(node.output[0])
        elif node.op_type == "DynamicQuantizeLinear":
            nodes.extend(_const(name, at[name]) for name in node.output[1:])
            if any(node.output[0] == m for m in moved.values()):
                nodes.extend(_float_codes(node, at))
        elif node.op_type == "DequantizeLinear" and node.input[0] in quantized:
            nodes.extend(_clipped(node, quantized[node.input[0]], constants, at))
        elif node.op_type == "Relu":
            nodes.extend(_masked(node, at[node.input[0]]))
        elif _is_plain_max_pool(node):
            nodes.extend(_selected(node, at[_positions(node)]))
        else:
            nodes.append(node)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    del copy.graph.value_info[:]
    return copy


def _constant_values(graph) -> dict[str, np.ndarray]:
    values = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute[0].name == "value":
            values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return values


def _intermediates(model, feeds, names) -> dict[str, np.ndarray]:
    """The values of ``names`` when onnxruntime runs ``model`` (unoptimized) on ``feeds``."""
    import onnxruntime as ort

    if not names:
        return {}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    unique = list(dict.fromkeys(names))
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in unique)
    del probe.graph.value_info[:]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(probe.SerializeToString(), options, ["CPUExecutionProvider"])
    return dict(zip(unique, session.run(None, feeds), strict=True))


def _is_plain_max_pool(node) -> bool:
    return node.op_type == "MaxPool" and len([o for o in node.output if o]) == 1


def _positions(node) -> str:
    return f"{node.output[0]}_positions"


def _max_positions(model, feeds) -> dict[str, np.ndarray]:
    """The flat input positions each ``MaxPool`` takes its maximum from, when onnxruntime
    runs ``model`` on ``feeds`` (the first of tied values: rounded values tie often)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    pools = [n for n in probe.graph.node if _is_plain_max_pool(n)]
    for node in pools:
        del node.output[1:]
        node.output.append(_positions(node))
    return _intermediates(probe, feeds, [_positions(n) for n in pools])


def _relu_inputs_by_node(model, other, feeds) -> dict[str, np.ndarray]:
    """The inputs of ``other``'s ReLU nodes, in float32, under the input names of
    ``model``'s nodes of the same names."""
    ours = {n.name: n.input[0] for n in model.graph.node if n.op_type == "Relu"}
    theirs = {n.name: n.input[0] for n in other.graph.node if n.name in ours}
    values = _intermediates(other, feeds, list(theirs.values()))
    return {ours[name]: values[x].astype(np.float32) for name, x in theirs.items()}


def _const(name: str, value) -> onnx.NodeProto:
    tensor = numpy_helper.from_array(np.asarray(value), name)
    return helper.make_node("Constant", [], [name], value=tensor)


#: operators that move codes without changing them (a quantized activation reshaped into an
#: image before a ``ConvInteger``: Segformer's reduced keys); ``Concat`` reads codes at every
#: input, the others at input 0
_MOVES = frozenset(
    {
        "Transpose",
        "Reshape",
        "Unsqueeze",
        "Squeeze",
        "Flatten",
        "Identity",
        "Slice",
        "Gather",
        "Expand",
        "Tile",
        "Concat",
        "Pad",
        "DepthToSpace",
        "SpaceToDepth",
    }
)


def _moved_codes(graph, dynamic) -> dict[str, str]:
    """``{name: codes}``: the outputs of moves of the codes ``DynamicQuantizeLinear`` makes."""
    moved: dict[str, str] = {}
    for node in graph.node:
        sources = node.input if node.op_type == "Concat" else node.input[:1]
        found = [moved.get(name, name) for name in sources if name in dynamic or name in moved]
        if node.op_type in _MOVES and found:
            moved[node.output[0]] = found[0]
    return moved


def _float_constant(constant: str, name: str, quantize=None) -> tuple[list, str]:
    """Constant codes ``c`` (``''``: 0) as floats named after ``name``, or dequantized,
    ``(c - z) s``, by ``quantize``'s parameters; returns the nodes and the float's name."""
    if constant:
        made = [helper.make_node("Cast", [constant], [f"{name}_c"], to=TensorProto.FLOAT)]
    else:
        made = [_const(f"{name}_c", np.array(0.0, np.float32))]
    if quantize is None:
        return made, f"{name}_c"
    made += [
        helper.make_node("Cast", [quantize.input[2]], [f"{name}_z"], to=TensorProto.FLOAT),
        helper.make_node("Sub", [f"{name}_c", f"{name}_z"], [f"{name}_cz"]),
        helper.make_node("Mul", [f"{name}_cz", quantize.input[1]], [f"{name}_v"]),
    ]
    return made, f"{name}_v"


def _float_pad(node, quantize=None) -> list[onnx.NodeProto]:
    """A ``Pad`` of float codes: its integer constant as a float (:func:`_float_constant`)."""
    constant = node.input[2] if len(node.input) > 2 else ""
    made, value = _float_constant(constant, node.output[0], quantize)
    padded = onnx.NodeProto()
    padded.CopyFrom(node)
    del padded.input[2:]
    padded.input.append(value)
    padded.input.extend(node.input[3:])
    return [*made, padded]


def _float_concat(node, moved, sources, quantize=None) -> list[onnx.NodeProto]:
    """A ``Concat`` of float codes and constant ones, the constants as floats
    (:func:`_float_constant`)."""
    made, inputs = [], []
    for index, name in enumerate(node.input):
        if name in moved or name in sources:
            inputs.append(name)
            continue
        nodes, value = _float_constant(name, f"{node.output[0]}_{index}", quantize)
        made += nodes
        inputs.append(value)
    joined = onnx.NodeProto()
    joined.CopyFrom(node)
    del joined.input[:]
    joined.input.extend(inputs)
    return [*made, joined]


def _clipped_codes(quantize, constants, at) -> list[onnx.NodeProto]:
    """Codes moved before their (per-tensor) dequantization, replaced by their dequantized
    value ``Clip(x, low, high) + r_0`` under their name: the moves then carry floats and the
    ``DequantizeLinear`` becomes an ``Identity``."""
    codes = quantize.output[0]
    scale = float(np.asarray(constants[quantize.input[1]]).reshape(-1)[0])
    has_zero = len(quantize.input) > 2 and quantize.input[2]
    zero_point = np.asarray(constants[quantize.input[2]]).reshape(-1)[0] if has_zero else 0
    value = (at[codes].astype(np.float64) - float(zero_point)) * scale
    probe = helper.make_node("DequantizeLinear", [codes, *quantize.input[1:]], [f"{codes}_y"])
    return _clipped(probe, quantize, constants, {**at, f"{codes}_y": value}, out=codes)


def _float_codes(quantize, at) -> list[onnx.NodeProto]:
    """The codes as floats, ``x / s_0 + r_0`` (``r_0 = q_0 - x_0 / s_0``), under their name,
    for the moves that read them."""
    x, (codes, scale, _) = quantize.input[0], quantize.output
    residual = (at[codes].astype(np.float32) - at[x] / at[scale]).astype(np.float32)
    return [
        _const(f"{codes}_r0", residual),
        helper.make_node("Div", [x, scale], [f"{codes}_xs"]),
        helper.make_node("Add", [f"{codes}_xs", f"{codes}_r0"], [codes]),
    ]


def _float_dequantized(node) -> list[onnx.NodeProto]:
    """``(q - z) s`` of moved float codes (one scale: ``DynamicQuantizeLinear``'s)."""
    name = node.output[0]
    codes, scale, zero = node.input[0], node.input[1], node.input[2]
    return [
        helper.make_node("Cast", [zero], [f"{name}_z"], to=TensorProto.FLOAT),
        helper.make_node("Sub", [codes, f"{name}_z"], [f"{name}_c"]),
        helper.make_node("Mul", [f"{name}_c", scale], [name]),
    ]


def _float_moved_product(node, constants) -> list[onnx.NodeProto]:
    """``node`` over its moved float codes minus their zero point, and ``W - z_W``."""
    name = node.output[0]
    made = [
        helper.make_node("Cast", [node.input[2]], [f"{name}_za"], to=TensorProto.FLOAT),
        helper.make_node("Sub", [node.input[0], f"{name}_za"], [f"{name}_a"]),
    ]
    return made + _float_weight_product(node, constants)


def _float_product(node, quantize, at, constants):
    """``node`` over ``x / s_0 + r_0`` and the float weight ``W - z_W``."""
    name = node.output[0]
    x, (codes, scale, zero) = quantize.input[0], quantize.output
    centred = at[codes].astype(np.float32) - at[zero].astype(np.float32)
    residual = (centred - at[x] / at[scale]).astype(np.float32)
    made = [
        _const(f"{name}_s0", at[scale]),
        _const(f"{name}_r0", residual),
        helper.make_node("Div", [x, f"{name}_s0"], [f"{name}_xs"]),
        helper.make_node("Add", [f"{name}_xs", f"{name}_r0"], [f"{name}_a"]),
    ]
    return made + _float_weight_product(node, constants)


def _float_weight_product(node, constants) -> list[onnx.NodeProto]:
    """The float ``MatMul`` or ``Conv`` of ``<output>_a`` and ``W - z_W``."""
    name = node.output[0]
    made = [helper.make_node("Cast", [node.input[1]], [f"{name}_w"], to=TensorProto.FLOAT)]
    weight = f"{name}_w"
    if len(node.input) > 3 and node.input[3]:
        made.append(helper.make_node("Cast", [node.input[3]], [f"{name}_z"], to=1))
        zero_w = f"{name}_z"
        if node.op_type == "ConvInteger":  # one zero point per output channel: (M, 1, ...)
            rank = np.ndim(constants[node.input[1]])
            made += _per_output_channel(rank, zero_w, f"{name}_zr")
            zero_w = f"{name}_zr"
        made.append(helper.make_node("Sub", [weight, zero_w], [f"{name}_wc"]))
        weight = f"{name}_wc"
    float_op = "MatMul" if node.op_type == "MatMulInteger" else "Conv"
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    made.append(helper.make_node(float_op, [f"{name}_a", weight], [name], **attributes))
    return made


def _float_sum(node, floated: set[str]) -> list[onnx.NodeProto]:
    """An older ``quantize_dynamic``'s int32 bias added to the integer accumulator, now a
    float product: the bias cast to float (its codes held at the point)."""
    made, inputs = [], []
    for name in node.input:
        if name in floated:
            inputs.append(name)
            continue
        made.append(helper.make_node("Cast", [name], [f"{name}_as_float"], to=TensorProto.FLOAT))
        inputs.append(f"{name}_as_float")
    sum_node = onnx.NodeProto()
    sum_node.CopyFrom(node)
    sum_node.ClearField("input")
    sum_node.input.extend(inputs)
    return [*made, sum_node]


def _per_output_channel(rank: int, values: str, output: str) -> list[onnx.NodeProto]:
    """``values`` (one per output channel) reshaped to ``(M, 1, ...)`` of the kernel's
    ``rank`` (1-D, 2-D or 3-D kernels), at any opset."""
    return [
        _const(f"{output}_shape", np.array([-1] + [1] * (rank - 1), np.int64)),
        helper.make_node("Reshape", [values, f"{output}_shape"], [output]),
    ]


def _clipped(dequantize, quantize, constants, at, out=None):
    """``Clip(x, low, high) + r_0`` in place of the pair (written to ``out``, else the
    pair's output)."""
    scales = np.asarray(constants[quantize.input[1]]).reshape(-1)
    if scales.size != 1:
        raise NotImplementedError(f"{quantize.name}: a per-axis activation scale")
    has_zero = len(quantize.input) > 2 and quantize.input[2]
    zero_point = constants[quantize.input[2]] if has_zero else np.zeros((), np.uint8)
    elem = helper.np_dtype_to_tensor_dtype(zero_point.dtype)
    zero = float(np.asarray(zero_point).reshape(-1)[0])
    qmin, qmax = _RANGES[elem]
    largest = float(np.finfo(np.float32).max)  # a -3.4e38 mask fill calibrated in
    low, high = (
        np.clip((q - zero) * float(scales[0]), -largest, largest) for q in (qmin - 0.5, qmax + 0.5)
    )
    x, y = quantize.input[0], dequantize.output[0]
    residual = (at[y] - np.clip(at[x], low, high)).astype(np.float32)
    return [
        _const(f"{y}_low", np.array(low, np.float32)),
        _const(f"{y}_high", np.array(high, np.float32)),
        _const(f"{y}_r0", residual),
        helper.make_node("Clip", [x, f"{y}_low", f"{y}_high"], [f"{y}_clipped"]),
        helper.make_node("Add", [f"{y}_clipped", f"{y}_r0"], [out or y]),
    ]


def _selected(pool, positions) -> list[onnx.NodeProto]:
    """``x.flat[p_0]``: a ``MaxPool`` reading rounded values meets ties (a kink) at the
    point; its choice frozen (onnxruntime's, the first), it has none."""
    name = pool.output[0]
    return [
        _const(f"{name}_p0", positions.astype(np.int64)),
        _const(f"{name}_flat", np.array([-1], np.int64)),
        helper.make_node("Reshape", [pool.input[0], f"{name}_flat"], [f"{name}_x"]),
        helper.make_node("Gather", [f"{name}_x", f"{name}_p0"], [name], axis=0),
    ]


def _masked(relu, z0):
    """``z [z_0 > 0]``: a ``ReLU`` reading rounded values meets its kink at the point itself
    (every ``|x| < s/2`` rounds to exactly 0), where finite differences give 1/2 and the
    derivative's convention (onnx's, PyTorch's) 0; its mask frozen, it has none."""
    name = relu.output[0]
    return [
        _const(f"{name}_mask", (z0 > 0).astype(z0.dtype)),
        helper.make_node("Mul", [relu.input[0], f"{name}_mask"], [name]),
    ]
