r"""Fed adapters folded into a quantized weight once per run, quantized again in the graph.

For a weight the deployed model reads as ``DequantizeLinear(q, s_q, z_q)`` (QDQ) or as
``quantize_dynamic``'s ``MatMulInteger(x_q, q, x_z, z_q)`` times ``s_q`` (one group per
tensor, or one per index of ``axis``: per column for ``MatMulInteger``),
:func:`requantized_weight_nodes` computes, from the adapters ``A`` and ``B`` fed at run time,

    W' = (q - z_q) s_q + s A B,
    lo = min(min_g W', 0),  hi = max(max_g W', 0)          (per group g),
    symmetric (z kept):  s' = max(hi / (q_max - z), lo / (q_min - z)),
                         (q_min: 2 z - q_max where the deployed codes never reach the type's lowest)
    asymmetric:          s' = (hi - lo) / (q_max - q_min),  z' = clip(round(q_min - lo / s'))
    q' = QuantizeLinear(W', s', z')                          (saturating, half to even)

exactly the rule ``merge_lora(..., quantized="requantize")`` applies with numpy
(:mod:`onnxgrad.graph.requantize`), here in float32: the same codes but where ``W' / s'``
lands within float32 rounding of a half step. The deployed operators then read ``q'``,
``s'`` and ``z'``: the product's pattern is unchanged and onnxruntime still fuses it
(``QLinearMatMul``, ``QGemm``, ``MatMulIntegerToFloat``, ``DynamicQuantizeMatMul``) over
codes that are no longer constants. The cost is ``K N r`` plus a few passes over ``K x N``
per run, whatever the number of rows. A reader quantizing the QDQ weight again
(``DQ(Q(W, s_2, z_2))``) gets ``s_2``, ``z_2`` widened to ``W'``'s range where it leaves theirs,
as the merge does.

A ``MatMulNBits`` weight (``b``-bit blocks of ``K``, packed) gets the same rule per block from
:func:`requantized_nbits_nodes`, its codes unpacked and packed again in ``int32``: about
twenty passes over ``K x N``, so over 4-bit weights it pays only for thousands of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import default_opset, reduce_axes_are_input
from onnxgrad.graph.deployed_products import Product, weight_products
from onnxgrad.graph.requantize import (
    integer_product_scale,
    kept_zero_point,
    symmetric_code_range,
)


def requantized_weight_nodes(
    model: ModelProto, product: Product, adapter: dict, names, node_names
) -> list[NodeProto]:
    """The nodes computing ``q', s', z'`` (module docstring) from ``adapter``'s fed ``A``
    and ``B`` for ``product``, a QDQ weight (its ``DequantizeLinear`` rewired to read them)
    or ``quantize_dynamic``'s ``MatMulInteger`` (its codes and zero point, and the ``Mul``
    by the weight's scale). The nodes read only initializers and graph inputs: the caller
    puts them first. ``ValueError`` naming the weight for a blocked ``DequantizeLinear``, a
    scale or zero point that is not an initializer or that another node reads too."""
    graph = model.graph
    reader = next(n for n in graph.node if n.name == product.reader)
    weight = product.weight
    if product.kind == "MatMulInteger":
        scale_name = integer_product_scale(model, product)
        zero_name = reader.input[3] if len(reader.input) > 3 else ""
        axis, attributes = 1, []
        scale_reader = _only_reader(graph, scale_name, weight)
    else:
        if any(a.name == "block_size" and a.i for a in reader.attribute):
            raise ValueError(f"weight {weight!r}: a blocked DequantizeLinear is not re-quantized")
        scale_name, zero_name = [*reader.input[1:], ""][:2]
        axis = next((a.i for a in reader.attribute if a.name == "axis"), 1)
        attributes = list(reader.attribute)
    inits = {init.name: init for init in graph.initializer}
    if scale_name not in inits or (zero_name and zero_name not in inits):
        raise ValueError(f"weight {weight!r}: its scale or zero point is not an initializer")
    base = _Base(
        numpy_helper.to_array(inits[weight]),
        numpy_helper.to_array(inits[scale_name]),
        numpy_helper.to_array(inits[zero_name]) if zero_name else None,
        axis % len(inits[weight].dims),
    )
    build = _Builder(f"{weight}_lora", base.scale.dtype, names, node_names)
    dequantized = build.node("DequantizeLinear", [weight, scale_name, zero_name])
    build.nodes[-1].attribute.extend(attributes or [helper.make_attribute("axis", base.axis)])
    values = build.node("Add", [dequantized, _delta(build, product, adapter)])
    codes, step, zero = _quantized_again(build, base, values, default_opset(model))
    if product.kind == "DequantizeLinear":
        merged = build.node("DequantizeLinear", [codes, step, zero])
        build.nodes[-1].attribute.extend(attributes or [helper.make_attribute("axis", base.axis)])
        _widened_requantizations(model, build, weight, merged)
    if product.kind == "MatMulInteger":
        reader.input[1] = codes
        while len(reader.input) < 4:
            reader.input.append("")
        reader.input[3] = zero
        scale_reader.input[list(scale_reader.input).index(scale_name)] = step
    else:
        del reader.input[:]
        reader.input.extend([codes, step, zero])
    return build.nodes


def requantized_nbits_nodes(
    model: ModelProto, product: Product, adapter: dict, names, node_names
) -> list[NodeProto]:
    r"""The nodes computing, from ``adapter``'s fed ``A`` and ``B``, the packed codes, the
    scales and (where the node has them) the zero points of ``W' = W + s A B`` that
    ``merge_lora(..., quantized="requantize")`` writes for ``product``, a ``MatMulNBits``
    (``b`` bits, blocks of ``block_size`` along ``K`` of each of the ``N`` rows of
    ``W^T``, codes packed ``8 / b`` to a byte, least significant first):

        codes = (p // 2^{b i}) mod 2^b,   W'^T = (codes - z) s + s_A (A B)^T   (0 past K)
        per block: the rule of the module docstring with ``q_min = 0``, ``q_max = 2^b - 1``
        (symmetric about ``2^{b-1}`` where the node has no zero points or they all are),
        p' = sum_i codes'_i 2^{b i}

    in ``int32`` (``Div``, ``Mod``, ``ReduceSum``: no bitwise operator needed). The node
    then reads ``p'``, ``s'`` and ``z'``; onnxruntime runs ``MatMulNBits`` over codes
    computed at run time (1.19.2 and 1.32). ``ValueError`` naming the weight for a node with
    ``g_idx``, float zero points, or codes, scales or zero points another node reads."""
    graph = model.graph
    reader = next(n for n in graph.node if n.name == product.reader)
    weight = product.weight
    inputs = [*reader.input, "", ""][:5]
    attributes = {a.name: helper.get_attribute_value(a) for a in reader.attribute}
    bits, block = attributes.get("bits", 4), attributes["block_size"]
    k, n = attributes["K"], attributes["N"]
    inits = {init.name: init for init in graph.initializer}
    zero_name = inputs[3]
    if inputs[4]:
        raise ValueError(f"MatMulNBits weight {weight!r}: a g_idx is not re-quantized")
    for name in filter(None, inputs[1:4]):
        if name not in inits or sum(name in node.input for node in graph.node) != 1:
            raise ValueError(f"MatMulNBits weight {weight!r}: {name!r} is not its own initializer")
    if zero_name and inits[zero_name].data_type != TensorProto.UINT8:
        raise ValueError(f"MatMulNBits weight {weight!r}: float zero points are not re-quantized")
    blocks, levels, middle = -(-k // block), 1 << bits, 1 << (bits - 1)
    build = _Builder(f"{weight}_lora", np.float32, names, node_names, default_opset(model))
    packed = _Packing(build, bits)
    codes = packed.unpacked(weight, (n, blocks, block))
    fixed = not zero_name
    if zero_name:
        zeros = _unpacked_rows(inits[zero_name], bits, n)[:, :blocks]
        fixed = bool(np.all(zeros == middle))
    zero = build.constant(middle) if fixed else build.array(zeros[..., None].astype(np.float32))
    scale_dtype = numpy_helper.to_array(inits[inputs[2]]).dtype
    scales = build.node("Reshape", [inputs[2], build.shape((n, blocks, 1))])
    if scale_dtype != np.float32:
        scales = build.node("Cast", [scales], to=TensorProto.FLOAT)
    values = build.node("Mul", [build.node("Sub", [codes, zero]), scales])
    delta = _blocked_delta(build, product, adapter, (n, blocks, block))
    values = build.node("Add", [values, delta])
    if blocks * block > k:  # the padding past K holds zeros, whatever its codes were
        inside = (np.arange(blocks * block) < k).astype(np.float32).reshape(1, blocks, block)
        values = build.node("Mul", [values, build.array(inside)])
    axis, kept = _block_axis(values, build)
    lo = build.node("Min", [build.node("ReduceMin", axis, **kept), build.constant(0)])
    hi = build.node("Max", [build.node("ReduceMax", axis, **kept), build.constant(0)])
    if fixed:
        up = build.node("Div", [hi, build.constant(levels - 1 - middle)])
        step = build.node("Max", [up, build.node("Div", [lo, build.constant(-middle)])])
    else:
        step = build.node("Div", [build.node("Sub", [hi, lo]), build.constant(levels - 1)])
    positive = build.node("Greater", [step, build.constant(0.0)])
    step = build.node("Where", [positive, step, build.constant(1.0)])
    new_scales = build.node("Cast", [step], to=helper.np_dtype_to_tensor_dtype(scale_dtype))
    if scale_dtype != np.float32:
        step = build.node("Cast", [new_scales], to=TensorProto.FLOAT)
    bounds = [build.constant(0.0), build.constant(levels - 1)]
    if not fixed:
        below = build.node("Neg", [build.node("Div", [lo, step])])
        zero = build.node("Clip", [build.node("Round", [below]), *bounds])
    scaled = build.node("Round", [build.node("Div", [values, step])])
    new_codes = build.node("Clip", [build.node("Add", [scaled, zero]), *bounds])
    reader.input[1] = packed.packed(new_codes, tuple(inits[weight].dims))
    reader.input[2] = build.node("Reshape", [new_scales, build.shape(inits[inputs[2]].dims)])
    if not fixed:
        width = -(-blocks * bits // 8) * (8 // bits)
        rows = build.node("Reshape", [zero, build.shape((n, blocks))])
        if width > blocks:
            rows = build.node("Pad", [rows, build.shape((0, 0, 0, width - blocks))])
        reader.input[3] = packed.packed(rows, tuple(inits[zero_name].dims))
    return build.nodes


class _Packing:
    """``b``-bit codes packed ``8 / b`` to a byte, least significant first, in ``int32``."""

    def __init__(self, build: _Builder, bits: int):
        self.build, self.per_byte, self.levels = build, 8 // bits, 1 << bits
        powers = (self.levels ** np.arange(self.per_byte)).astype(np.int32)
        self.powers = build.array(powers.reshape(1, -1))

    def unpacked(self, packed: str, shape: tuple) -> str:
        """The codes of ``packed`` (uint8), as float values of ``shape``."""
        build = self.build
        wide = build.node("Cast", [packed], to=TensorProto.INT32)
        column = build.node("Reshape", [wide, build.shape((-1, 1))])
        shifted = build.node("Div", [column, self.powers])
        codes = build.node("Mod", [shifted, build.array(np.int32(self.levels))])
        values = build.node("Cast", [codes], to=TensorProto.FLOAT)
        return build.node("Reshape", [values, build.shape(shape)])

    def packed(self, codes: str, dims: tuple) -> str:
        """``codes`` (float, whole, in ``[0, 2^b)``) packed into uint8 of shape ``dims``."""
        build = self.build
        whole = build.node("Cast", [codes], to=TensorProto.INT32)
        grouped = build.node("Reshape", [whole, build.shape((-1, self.per_byte))])
        weighted = build.node("Mul", [grouped, self.powers])
        axis, dropped = _last_axis(weighted, build)
        total = build.node("ReduceSum", axis, **dropped)
        codes = build.node("Cast", [total], to=TensorProto.UINT8)
        return build.node("Reshape", [codes, build.shape(dims)])


def _unpacked_rows(zero: TensorProto, bits: int, n: int) -> np.ndarray:
    """A ``MatMulNBits``'s packed zero points as ``N`` rows of codes."""
    raw = numpy_helper.to_array(zero).astype(np.int64).reshape(-1, 1)
    codes = (raw >> (bits * np.arange(8 // bits))) & ((1 << bits) - 1)
    return codes.reshape(n, -1)


def _blocked_delta(build: _Builder, product: Product, adapter: dict, shape: tuple) -> str:
    """``s (A B)^T`` as ``N`` rows of blocks, ``K`` padded with zeros to whole blocks."""
    blocks, block = shape[1:]
    product_ab = build.node("MatMul", [adapter["a"], adapter["b"]])
    delta = build.node("Mul", [product_ab, build.constant(adapter["scale"])])
    rows = build.node("Transpose", [delta], perm=[1, 0])
    k = product.shape[0]
    if blocks * block > k:
        rows = build.node("Pad", [rows, build.shape((0, 0, 0, blocks * block - k))])
    return build.node("Reshape", [rows, build.shape(shape)])


def _block_axis(values: str, build: _Builder):
    """``(inputs, attributes)`` of a ``Reduce*`` over the last of three axes, kept."""
    if reduce_axes_are_input("ReduceMax", build.opset):
        return [values, build.shape((2,))], {"keepdims": 1}
    return [values], {"keepdims": 1, "axes": [2]}


def _last_axis(values: str, build: _Builder):
    """``(inputs, attributes)`` of a ``ReduceSum`` over the last of two axes, dropped."""
    if reduce_axes_are_input("ReduceSum", build.opset):
        return [values, build.shape((1,))], {"keepdims": 0}
    return [values], {"keepdims": 0, "axes": [1]}


@dataclass(frozen=True)
class _Base:
    """A quantized weight's codes, scales (one, or one per index of ``axis``) and zero
    points (``None``: absent)."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    axis: int


def _quantized_again(build: _Builder, base: _Base, values: str, opset: int):
    """``(codes, scales, zero points)`` of ``values`` quantized as ``base`` (module
    docstring)."""
    codes, scale = base.codes, base.scale
    zero = base.zero if base.zero is not None else np.zeros((), codes.dtype)
    per_axis = scale.size > 1
    count = codes.shape[base.axis] if per_axis else 1
    others = [i for i in range(codes.ndim) if i != base.axis] if per_axis else None
    inputs, attributes = _reduced(values, others, opset, build)
    lo = build.node("Min", [build.node("ReduceMin", inputs, **attributes), build.constant(0.0)])
    hi = build.node("Max", [build.node("ReduceMax", inputs, **attributes), build.constant(0.0)])
    info = np.iinfo(codes.dtype)
    zeros = np.broadcast_to(zero.reshape(-1), (count,)).astype(np.float64)
    keeps_zero, middle = kept_zero_point(base.zero, codes.dtype, count)
    shape = scale.shape if per_axis else ()
    if keeps_zero:
        low, high = symmetric_code_range(codes, middle)
        up = np.where(high > zeros, high - zeros, np.inf).reshape(shape)
        down = np.where(low < zeros, low - zeros, -np.inf).reshape(shape)
        upper = build.node("Div", [hi, build.constant(up)])
        step = build.node("Max", [upper, build.node("Div", [lo, build.constant(down)])])
        new_zero = build.array(np.broadcast_to(zero.reshape(-1), (count,)).reshape(shape))
    else:
        span = build.node("Sub", [hi, lo])
        step = build.node("Div", [span, build.constant(float(info.max - info.min))])
    positive = build.node("Greater", [step, build.constant(0.0)])
    step = build.node("Where", [positive, step, build.constant(1.0)])
    if not keeps_zero:
        below = build.node("Div", [lo, step])
        shifted = build.node("Sub", [build.constant(float(info.min)), below])
        bounds = [build.constant(float(info.min)), build.constant(float(info.max))]
        clipped = build.node("Clip", [build.node("Round", [shifted]), *bounds])
        new_zero = build.node("Cast", [clipped], to=helper.np_dtype_to_tensor_dtype(codes.dtype))
    attributes = {"axis": base.axis} if per_axis else {}
    new_codes = build.node("QuantizeLinear", [values, step, new_zero], **attributes)
    return new_codes, step, new_zero


def _widened_requantizations(model: ModelProto, build: _Builder, weight: str, merged: str):
    """Each reader's requantization ``Q(W', s_2, z_2)`` of the merged weight ``merged``
    (:mod:`onnxgrad.graph.requantize`): ``s_2``, ``z_2`` where ``W'`` lies in their range,
    else widened to it; the ``QuantizeLinear`` and its ``DequantizeLinear`` rewired to read
    them. ``ValueError`` naming the node for a scale per axis or one not an initializer."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    between = {name for p in weight_products(model).get(weight, []) for name in p.requantizations}
    for quantize in [n for n in graph.node if n.name in between]:
        scale_name, zero_name = [*quantize.input[1:], ""][:2]
        known = scale_name in inits and (not zero_name or zero_name in inits)
        scale = numpy_helper.to_array(inits[scale_name]) if known else None
        if scale is None or scale.size != 1:
            raise ValueError(
                f"weight {weight!r}: its requantization {quantize.name!r} has no scale of "
                "one initializer; it is not quantized again per run"
            )
        zero = numpy_helper.to_array(inits[zero_name]) if zero_name else np.zeros((), np.uint8)
        step, zero_value = _widened_range(build, merged, float(scale), zero, bool(zero_name))
        codes = build.node("QuantizeLinear", [merged, step, zero_value])
        merged = build.node("DequantizeLinear", [codes, step, zero_value])
        for node in graph.node:
            if node is quantize or (
                node.op_type == "DequantizeLinear" and node.input[0] == quantize.output[0]
            ):
                node.input[1:3] = [step, zero_value]


def _widened_range(build: _Builder, values: str, scale: float, zero: np.ndarray, named: bool):
    """``(scale, zero point)`` covering ``values`` and the range of ``scale``, ``zero``
    (those, exactly, where ``values`` lie in it)."""
    info = np.iinfo(zero.dtype)
    z = float(zero.reshape(-1)[0])
    ends = [build.constant((info.min - z) * scale), build.constant((info.max - z) * scale)]
    low, high = (
        build.node("ReduceMin", [values], keepdims=0),
        build.node("ReduceMax", [values], keepdims=0),
    )
    lo, hi = build.node("Min", [low, ends[0]]), build.node("Max", [high, ends[1]])
    fixed, _ = kept_zero_point(zero if named else None, zero.dtype, 1)
    if fixed:
        up = build.node("Div", [hi, build.constant(info.max - z)]) if info.max > z else None
        down = build.node("Div", [lo, build.constant(info.min - z)]) if info.min < z else None
        step = build.node("Max", [n for n in (up, down) if n])
        new_zero = build.constant(z)
    else:
        span = build.node("Sub", [hi, lo])
        step = build.node("Div", [span, build.constant(float(info.max - info.min))])
        shifted = build.node(
            "Sub", [build.constant(float(info.min)), build.node("Div", [lo, step])]
        )
        bounds = [build.constant(float(info.min)), build.constant(float(info.max))]
        new_zero = build.node("Clip", [build.node("Round", [shifted]), *bounds])
    below, above = build.node("Sub", [ends[0], low]), build.node("Sub", [high, ends[1]])
    outside = build.node("Greater", [build.node("Max", [below, above]), build.constant(0.0)])
    step = build.node("Where", [outside, step, build.constant(scale)])
    new_zero = build.node("Where", [outside, new_zero, build.constant(z)])
    return step, build.node("Cast", [new_zero], to=helper.np_dtype_to_tensor_dtype(zero.dtype))


def _only_reader(graph, name: str, weight: str) -> NodeProto:
    """The one node reading ``name`` (a weight's scale), else ``ValueError``."""
    readers = [n for n in graph.node if name in n.input]
    if len(readers) != 1:
        raise ValueError(
            f"weight {weight!r}: its scale {name!r} is read by {len(readers)} nodes; it "
            "cannot be re-quantized alone"
        )
    return readers[0]


class _Builder:
    """Nodes and constants of one weight's update, named after it, in ``dtype``."""

    def __init__(self, base: str, dtype, names, node_names, opset: int = 0):
        self.base, self.dtype, self.names, self.node_names = (
            base,
            np.dtype(dtype),
            names,
            node_names,
        )
        self.opset = opset
        self.nodes: list[NodeProto] = []

    def node(self, op: str, inputs: list[str], **attributes) -> str:
        output = self.names.unique(f"{self.base}_{op}")
        name = self.node_names.unique(f"{self.base}_{op}")
        self.nodes.append(helper.make_node(op, inputs, [output], name=name, **attributes))
        return output

    def constant(self, value) -> str:
        return self.array(np.asarray(value, dtype=self.dtype))

    def array(self, value: np.ndarray) -> str:
        return self.node("Constant", [], value=numpy_helper.from_array(np.asarray(value)))

    def shape(self, dims) -> str:
        """A constant ``int64`` vector (a shape, pads or axes)."""
        return self.array(np.asarray(dims, dtype=np.int64))


def _delta(build: _Builder, product: Product, adapter: dict) -> str:
    """``s A B`` in the codes' layout: ``A B`` has the weight's layout as its product reads
    it (``N x K`` for a ``Gemm`` with ``transB``), undone through the layout operators."""
    a, b = adapter["a"], adapter["b"]
    if build.dtype != np.float32:
        a = build.node("Cast", [a], to=helper.np_dtype_to_tensor_dtype(build.dtype))
        b = build.node("Cast", [b], to=helper.np_dtype_to_tensor_dtype(build.dtype))
    delta = build.node("Mul", [build.node("MatMul", [a, b]), build.constant(adapter["scale"])])
    perm = _adapter_to_codes(product)
    return build.node("Transpose", [delta], perm=perm) if perm else delta


def _adapter_to_codes(product: Product) -> list[int] | None:
    """The permutation from ``A B``'s layout to the codes' (``None``: the same)."""
    perm = list(product.perm) if product.perm else None
    if product.transposed:  # perm composes the layout operators with transB's swap
        perm = None if perm == [1, 0] else [1, 0]
    return [int(i) for i in np.argsort(perm)] if perm else None


def _reduced(values: str, axes: list[int] | None, opset: int, build: _Builder):
    """``(inputs, attributes)`` of a ``Reduce*`` of ``values`` over ``axes`` (``None``:
    all) without kept dimensions."""
    if axes is None:
        return [values], {"keepdims": 0}
    if reduce_axes_are_input("ReduceMax", opset):
        return [values, build.array(np.asarray(axes, dtype=np.int64))], {"keepdims": 0}
    return [values], {"keepdims": 0, "axes": axes}
