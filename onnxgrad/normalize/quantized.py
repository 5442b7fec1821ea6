r"""onnxruntime's quantized operators lowered to standard ONNX over dequantized weights.

The quantized weights stay integer initializers, dequantized in the graph by
``DequantizeLinear`` (whose scale and zero point are its ``x_scale``/``x_zero_point``
inputs, never trained): a gradient reaches the float inputs through ``W = (q - z) s`` and
nothing reaches ``q``, ``s`` or ``z``.

- ``MatMulNBits(A, B, s, z, bias) = A W^T + bias``: ``B`` holds ``N`` rows of ``K`` codes of
  ``bits`` bits (least significant first within a byte), ``s`` one scale per row and block of
  ``block_size`` codes, ``z`` packed the same way (default ``2^{bits-1}``) or as floats.
- ``DynamicQuantizeMatMul(A, B, s, z, bias) = \hat A\, (B - z) s + bias``, ``\hat A`` the
  ``DynamicQuantizeLinear`` round trip of ``A`` (uint8, range including 0), as the kernel,
  read straight through; ``quantize_dynamic``'s ``MatMulInteger`` form likewise
  (:mod:`onnxgrad.normalize.integer_product`).
- ``QLinearMatMul`` and ``QLinearConv``: the dequantized product (with the int32 bias of
  scale ``s_x s_w``) quantized by ``y_scale``, ``y_zero_point``.
- ``com.microsoft`` ``QuantizeLinear``/``DequantizeLinear`` become the default-domain ones.
- ``DynamicQuantizeLSTM``: ``LSTM`` over the dequantized weights (the kernel's dynamic
  quantization of its input and state read straight through).
- Quantized activations get the straight-through estimator (:mod:`onnxgrad.normalize.ste`).
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper

from onnxgrad._onnx_utils import normalize_domain
from onnxgrad.normalize.integer_product import dynamic_round_trip, lowered_integer_products
from onnxgrad.normalize.lowering import Lowerer, lower_nodes, reading_only
from onnxgrad.normalize.ste import (
    integer_scale,
    lower_dynamic_quantize,
    lower_fake_quantized,
    lower_integer_product_cast,
    lower_integer_rescale,
)

MS = "com.microsoft"


def lower_matmul_nbits(lw: Lowerer) -> None:
    a, packed, scales = lw.input(0), lw.input(1), lw.input(2)
    if len(lw.node.input) > 4 and lw.input(4):
        raise lw.error("g_idx (act-order) is not supported")
    bits, block = lw.attr("bits", 4), lw.attr("block_size")
    k, n = lw.attr("K"), lw.attr("N")
    if bits not in (2, 4, 8) or not block:
        raise lw.error(f"bits={bits}, block_size={block} are not supported")
    blocks = -(-k // block)
    codes = _unpacked(lw, packed, bits, [n * blocks, block])
    weight = _dequantized_rows(lw, codes, scales, lw.input(3), bits, n * blocks)
    weight = lw.op("Reshape", weight, lw.ints([n, blocks * block]))
    if blocks * block != k:
        weight = lw.slice_last(weight, 0, k)
    t = lw.elem(a)
    if lw.elem(scales) != t or t != TensorProto.FLOAT:
        weight = lw.cast(weight, t)
    transposed = lw.op("Transpose", weight, perm=[1, 0])
    bias = lw.input(5) if len(lw.node.input) > 5 else ""
    if bias:
        lw.op("Add", lw.op("MatMul", a, transposed), bias, out=lw.output(0))
    else:
        lw.op("MatMul", a, transposed, out=lw.output(0))


def _unpacked(lw: Lowerer, packed: str, bits: int, shape: list[int]) -> str:
    """The uint8 codes of ``packed``, least significant bits first, shaped ``shape``."""
    if bits == 8:
        return lw.op("Reshape", packed, lw.ints(shape))
    per_byte = 8 // bits
    wide = lw.cast(packed, TensorProto.INT32)
    base = lw.const(1 << bits, TensorProto.INT32)
    pieces = []
    for i in range(per_byte):
        shifted = (
            wide if i == 0 else lw.op("Div", wide, lw.const(1 << (bits * i), TensorProto.INT32))
        )
        pieces.append(lw.unsqueeze(lw.op("Mod", shifted, base), [-1]))
    codes = lw.op("Concat", *pieces, axis=-1)
    return lw.cast(lw.op("Reshape", codes, lw.ints(shape)), TensorProto.UINT8)


def _dequantized_rows(lw, codes, scales, zero_points, bits, rows) -> str:
    """``(codes - z) s`` with one scale (and zero point) per row, in float32."""
    flat_scales = _flat(lw, scales, rows)
    if lw.elem(scales) != TensorProto.FLOAT:
        flat_scales = lw.cast(flat_scales, TensorProto.FLOAT)
    if not zero_points:
        zero = _constant_codes(lw, rows, 1 << (bits - 1))
        return lw.op("DequantizeLinear", codes, flat_scales, zero, axis=0)
    if lw.elem(zero_points) == TensorProto.UINT8:
        zero = _unpacked_zero_points(lw, zero_points, bits, rows)
        return lw.op("DequantizeLinear", codes, flat_scales, zero, axis=0)
    offsets = lw.op("Mul", lw.cast(_flat(lw, zero_points, rows), TensorProto.FLOAT), flat_scales)
    unit = lw.op("DequantizeLinear", codes, flat_scales, axis=0)
    return lw.op("Sub", unit, lw.unsqueeze(offsets, [1]))


def _flat(lw: Lowerer, name: str, rows: int) -> str:
    dims = lw.dims(name)
    if dims is not None and len(dims) == 1:
        return name
    return lw.op("Reshape", name, lw.ints([rows]))


def _constant_codes(lw: Lowerer, rows: int, value: int) -> str:
    return lw.builder.const(np.full(rows, value, dtype=np.uint8), "zero_point")


def _unpacked_zero_points(lw: Lowerer, packed: str, bits: int, rows: int) -> str:
    """Zero points packed ``8/bits`` to a byte, each row of blocks padded to whole bytes."""
    n = lw.attr("N")
    blocks = rows // n
    per_byte = 8 // bits
    width = -(-blocks // per_byte)
    codes = _unpacked(lw, packed, bits, [n, width * per_byte])
    if width * per_byte != blocks:
        codes = lw.slice_last(codes, 0, blocks)
    return lw.op("Reshape", codes, lw.ints([rows]))


def lower_dynamic_quantize_matmul(lw: Lowerer) -> None:
    a, b, b_scale, b_zero, bias = (lw.input(i) for i in range(5))
    a_hat = dynamic_round_trip(lw, a)
    weight = _dequantized_weight(lw, b, b_scale, b_zero)
    product = lw.op("MatMul", a_hat, weight)
    if bias:
        lw.op("Add", product, bias, out=lw.output(0))
    else:
        lw.op("Identity", product, out=lw.output(0))


def _dequantized_weight(lw: Lowerer, w: str, scale: str, zero: str, axis: int = -1) -> str:
    """``DequantizeLinear`` of ``w`` with a per-tensor or per-``axis`` scale."""
    dims = lw.dims(scale)
    per_axis = dims is not None and len(dims) == 1 and dims[0] != 1
    inputs = [w, scale, zero] if zero else [w, scale]
    if per_axis:
        return lw.op("DequantizeLinear", *inputs, axis=axis % lw.rank(w))
    if dims and len(dims) == 1:
        inputs = [lw.op("Reshape", name, lw.ints([])) for name in inputs[1:]]
        inputs = [w, *inputs]
    return lw.op("DequantizeLinear", *inputs)


def lower_qlinear_matmul(lw: Lowerer) -> None:
    a = _dequantized_weight(lw, lw.input(0), lw.input(1), lw.input(2), axis=-2)
    b = _dequantized_weight(lw, lw.input(3), lw.input(4), lw.input(5))
    product = lw.op("MatMul", a, b)
    lw.op("QuantizeLinear", product, lw.input(6), lw.input(7), out=lw.output(0))


def lower_qlinear_conv(lw: Lowerer) -> None:
    x = _dequantized_weight(lw, lw.input(0), lw.input(1), lw.input(2), axis=1)
    w = _dequantized_weight(lw, lw.input(3), lw.input(4), lw.input(5), axis=0)
    inputs = [x, w]
    if len(lw.node.input) > 8 and lw.input(8):
        scale = lw.op("Mul", integer_scale(lw, lw.input(1)), lw.input(4))
        inputs.append(lw.op("Mul", lw.cast(lw.input(8), TensorProto.FLOAT), scale))
    attrs = {a.name: _attr_value(a) for a in lw.node.attribute}
    conv = lw.op("Conv", *inputs, **attrs)
    lw.op("QuantizeLinear", conv, lw.input(6), lw.input(7), out=lw.output(0))


def _attr_value(attribute):
    return helper.get_attribute_value(attribute)


def lower_ms_quantize(lw: Lowerer) -> None:
    """The ``com.microsoft`` form, read as the default-domain operator of the same name."""
    elem = lw.elem(lw.input(2)) if lw.input(2) else TensorProto.UINT8
    if elem not in (TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32):
        raise lw.error(f"zero points of type {TensorProto.DataType.Name(elem)} are not supported")
    attrs = {"axis": lw.attr("axis", 1)}
    inputs = [name for name in lw.node.input]
    lw.op(lw.node.op_type, *inputs, out=lw.output(0), **attrs)


def lower_dynamic_quantize_lstm(lw: Lowerer) -> None:
    """``LSTM`` over the dequantized ``W`` and ``R`` (stored ``(D, I, 4H)``, ``LSTM`` wants
    ``(D, 4H, I)``). The kernel also quantizes ``X`` and each step's ``h`` dynamically; the
    lowering keeps them float, their straight-through reading."""
    inputs = [lw.input(i) for i in range(12)]
    w = _lstm_weight(lw, inputs[1], inputs[8], inputs[9])
    r = _lstm_weight(lw, inputs[2], inputs[10], inputs[11])
    attrs = {a.name: helper.get_attribute_value(a) for a in lw.node.attribute}
    lstm_inputs = [inputs[0], w, r, *inputs[3:8]]
    while lstm_inputs and not lstm_inputs[-1]:
        lstm_inputs.pop()
    outs = [lw.output(i) for i in range(3)]
    name = lw.builder._nodes.unique(f"{lw.builder.prefix}_LSTM")
    lw.builder.graph.node.append(helper.make_node("LSTM", lstm_inputs, outs, name=name, **attrs))


def _lstm_weight(lw: Lowerer, codes: str, scale: str, zero: str) -> str:
    """``(codes - z) s`` transposed to ``(D, 4H, I)``: ``DequantizeLinear`` along the
    direction axis for one scale per direction, along the gate axis for one direction."""
    dims = lw.dims(scale) or []
    if len(dims) <= 1:
        weight = lw.op("DequantizeLinear", codes, scale, zero, axis=0)
    elif dims[0] == 1:
        flat = [lw.op("Reshape", name, lw.ints([-1])) for name in (scale, zero)]
        weight = lw.op("DequantizeLinear", codes, *flat, axis=2)
    else:
        raise lw.error("per-gate scales of a bidirectional DynamicQuantizeLSTM are not supported")
    return lw.op("Transpose", weight, perm=[0, 2, 1])


#: operators that move or select elements of their first input: they commute with a
#: per-tensor dequantization ``(q - z) s``
_MOVERS = frozenset(
    {"Gather", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Expand"}
)


#: the most elements of a quantized table dequantized whole (a position-bias table, not a
#: vocabulary's embeddings, whose lookup stays dequantized after the Gather)
_SMALL_TABLE = 1 << 16


def lower_dequantize(lw: Lowerer) -> None:
    """A per-tensor ``DequantizeLinear`` of elements moved out of a small integer
    initializer (a lookup into a quantized table: ``DQ(Transpose(Gather(q)))``, T5's
    relative position bias) dequantizes the table first and moves float elements: the same
    values, and a form onnxruntime's optimizers accept in a train step (its
    ``QDQPropagationTransformer`` aborts on a train step holding ``DQ(Transpose(Gather))``
    -> ``Unsqueeze`` read by a ``Loop``, with the dequantization after the Gather too); any
    other goes to the straight-through rewrite."""
    chain = _moves_from_initializer(lw, lw.input(0))
    per_tensor = all(_one_element(lw, name) for name in lw.node.input[1:3] if name)
    if not chain or not per_tensor or not _is_small_table(lw, chain[-1].input[0]):
        lower_fake_quantized(lw)
        return
    attrs = {a.name: helper.get_attribute_value(a) for a in lw.node.attribute}
    moved = lw.op("DequantizeLinear", chain[-1].input[0], *lw.node.input[1:], **attrs)
    for step in reversed(chain):
        out = lw.output(0) if step is chain[0] else None
        attrs = {a.name: helper.get_attribute_value(a) for a in step.attribute}
        moved = lw.op(step.op_type, moved, *step.input[1:], out=out, **attrs)
        lw.superseded.add(id(step))


def _moves_from_initializer(lw: Lowerer, name: str) -> list:
    """The element-moving nodes from an integer initializer to ``name``, last first (empty
    when ``name`` is not such a chain's end)."""
    chain = []
    node = lw.producers.get(name)
    while node is not None and node.op_type in _MOVERS and not node.domain:
        chain.append(node)
        node = lw.producers.get(node.input[0])
    source = chain[-1].input[0] if chain else ""
    if node is not None or source not in lw.initializers:
        return []
    return chain


def _is_small_table(lw: Lowerer, name: str) -> bool:
    dims = lw.dims(name)
    return dims is not None and int(np.prod(dims)) <= _SMALL_TABLE


def _one_element(lw: Lowerer, name: str) -> bool:
    dims = lw.dims(name)
    return dims is not None and all(d == 1 for d in dims)


#: what MatMulNBits' lowering reads; ``accuracy_level`` (the kernel's accumulation
#: precision) has the dequantized-float product as its straight-through reading
_NBITS = {"K", "N", "bits", "block_size", "accuracy_level"}

QUANTIZED_LOWERINGS = {
    (MS, "MatMulNBits"): reading_only(lower_matmul_nbits, _NBITS, {"weight_prepacked": 0}),
    (MS, "DynamicQuantizeMatMul"): lower_dynamic_quantize_matmul,
    ("", "QLinearMatMul"): lower_qlinear_matmul,
    ("", "QLinearConv"): lower_qlinear_conv,
    (MS, "QLinearConv"): lower_qlinear_conv,
    (MS, "QuantizeLinear"): lower_ms_quantize,
    (MS, "DequantizeLinear"): lower_ms_quantize,
    (MS, "DynamicQuantizeLSTM"): lower_dynamic_quantize_lstm,
}

#: The straight-through rewrites, run after the lowerings above (whose QuantizeLinear and
#: DequantizeLinear nodes they read too).
STRAIGHT_THROUGH = {
    ("", "DequantizeLinear"): lower_dequantize,
    ("", "Cast"): lower_integer_product_cast,
    ("", "DynamicQuantizeLinear"): lower_dynamic_quantize,
    ("", "Mul"): lower_integer_rescale,
}


#: The operators without which no straight-through rewrite applies: the ``Cast`` and ``Mul``
#: ones only rewrite what reads a ``DynamicQuantizeLinear``.
STRAIGHT_THROUGH_SOURCES = frozenset({("", "DequantizeLinear"), ("", "DynamicQuantizeLinear")})


def lowered_quantized(model: ModelProto) -> ModelProto:
    """``model`` with onnxruntime's quantized operators lowered (module docstring)."""
    lowered = lowered_integer_products(lower_nodes(model, QUANTIZED_LOWERINGS))
    if not any(
        (normalize_domain(n.domain), n.op_type) in STRAIGHT_THROUGH_SOURCES
        for n in lowered.graph.node
    ):
        return lowered  # a float model: not one node (each inferred anew) to rewrite
    return lower_nodes(lowered, STRAIGHT_THROUGH)
