r"""Fed adapters folded into a QDQ weight once per run, quantized again in the graph.

For a weight the deployed model reads as ``DequantizeLinear(q, s_q, z_q)`` (QDQ; one group
per tensor or one per index of ``axis``), :func:`requantized_weight_nodes` computes, from the
adapters ``A`` and ``B`` fed at run time,

    W' = (q - z_q) s_q + s A B,
    lo = min(min_g W', 0),  hi = max(max_g W', 0)          (per group g),
    symmetric (z kept):  s' = max(hi / (q_max - z), lo / (q_min - z)),
    asymmetric:          s' = (hi - lo) / (q_max - q_min),  z' = clip(round(q_min - lo / s'))
    q' = QuantizeLinear(W', s', z')                          (saturating, half to even)

exactly the rule ``merge_lora(..., quantized="requantize")`` applies with numpy
(:mod:`onnxgrad.graph.requantize`), here in float32: the same codes but where ``W' / s'``
lands within float32 rounding of a half step. The deployed ``DequantizeLinear`` then reads
``q'``, ``s'`` and ``z'``: the product's pattern is unchanged and onnxruntime still fuses it
(``QLinearMatMul``, ``QGemm``). The cost is ``K N r`` plus a few passes over ``K x N`` per
run, whatever the number of rows.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, helper, numpy_helper

from onnxgrad._onnx_utils import reduce_axes_are_input
from onnxgrad.graph.deployed_products import Product


def requantized_weight_nodes(
    graph, product: Product, adapter: dict, opset: int, names, node_names
) -> list[NodeProto]:
    """The nodes computing ``q', s', z'`` (module docstring) from ``adapter``'s fed ``A``
    and ``B`` for the QDQ ``product``; its ``DequantizeLinear`` is rewired to read them.
    The nodes read only initializers and graph inputs: the caller puts them first.
    ``ValueError`` naming the weight for a blocked ``DequantizeLinear`` or a scale or zero
    point that is not an initializer."""
    dequantize = next(n for n in graph.node if n.name == product.reader)
    inits = {init.name: init for init in graph.initializer}
    weight = product.weight
    if any(a.name == "block_size" and a.i for a in dequantize.attribute):
        raise ValueError(f"weight {weight!r}: a blocked DequantizeLinear is not re-quantized")
    scale_name, zero_name = [*dequantize.input[1:], ""][:2]
    if scale_name not in inits or (zero_name and zero_name not in inits):
        raise ValueError(f"weight {weight!r}: its scale or zero point is not an initializer")
    codes = numpy_helper.to_array(inits[weight])
    scale = numpy_helper.to_array(inits[scale_name])
    zero = numpy_helper.to_array(inits[zero_name]) if zero_name else np.zeros((), codes.dtype)
    axis = next((a.i for a in dequantize.attribute if a.name == "axis"), 1) % codes.ndim
    per_axis = scale.size > 1
    count = codes.shape[axis] if per_axis else 1
    build = _Builder(f"{weight}_lora", scale.dtype, names, node_names)
    values = build.node("Add", [_dequantized(build, dequantize), _delta(build, product, adapter)])
    others = [i for i in range(codes.ndim) if i != axis] if per_axis else None
    inputs, attributes = _reduced(values, others, opset, build)
    lo = build.node("Min", [build.node("ReduceMin", inputs, **attributes), build.constant(0.0)])
    hi = build.node("Max", [build.node("ReduceMax", inputs, **attributes), build.constant(0.0)])
    info = np.iinfo(codes.dtype)
    zeros = np.broadcast_to(zero.reshape(-1), (count,)).astype(np.float64)
    middle = 0 if info.min < 0 else (info.max + 1) // 2
    keeps_zero = not zero_name or bool(np.all(zero == middle)) or zero.size < count
    shape = scale.shape if per_axis else ()
    if keeps_zero:
        up = np.where(info.max > zeros, info.max - zeros, np.inf).reshape(shape)
        down = np.where(info.min < zeros, info.min - zeros, -np.inf).reshape(shape)
        step = build.node(
            "Max",
            [
                build.node("Div", [hi, build.constant(up)]),
                build.node("Div", [lo, build.constant(down)]),
            ],
        )
        new_zero = build.array(np.broadcast_to(zero.reshape(-1), (count,)).reshape(shape))
    else:
        span = build.node("Sub", [hi, lo])
        step = build.node("Div", [span, build.constant(float(info.max - info.min))])
    positive = build.node("Greater", [step, build.constant(0.0)])
    step = build.node("Where", [positive, step, build.constant(1.0)])
    if not keeps_zero:
        shifted = build.node(
            "Sub", [build.constant(float(info.min)), build.node("Div", [lo, step])]
        )
        bounds = [build.constant(float(info.min)), build.constant(float(info.max))]
        clipped = build.node("Clip", [build.node("Round", [shifted]), *bounds])
        new_zero = build.node("Cast", [clipped], to=helper.np_dtype_to_tensor_dtype(codes.dtype))
    attributes = {"axis": axis} if per_axis else {}
    new_codes = build.node("QuantizeLinear", [values, step, new_zero], **attributes)
    del dequantize.input[:]
    dequantize.input.extend([new_codes, step, new_zero])
    return build.nodes


class _Builder:
    """Nodes and constants of one weight's update, named after it, in ``dtype``."""

    def __init__(self, base: str, dtype, names, node_names):
        self.base, self.dtype, self.names, self.node_names = (
            base,
            np.dtype(dtype),
            names,
            node_names,
        )
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


def _dequantized(build: _Builder, dequantize: NodeProto) -> str:
    """``(q - z_q) s_q``: a copy of the deployed ``DequantizeLinear`` (its inputs, before
    they are rewired)."""
    output = build.node("DequantizeLinear", list(dequantize.input))
    build.nodes[-1].attribute.extend(dequantize.attribute)
    return output


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
