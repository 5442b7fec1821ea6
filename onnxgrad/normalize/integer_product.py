r"""``quantize_dynamic``'s int8 product read as a float product over the dequantized weight.

onnxruntime's ``quantize_dynamic`` writes ``y = x W`` as

    (q, s_x, z_x) = DynamicQuantizeLinear(x)
    y = Cast(MatMulInteger(q, B, z_x, z_B)) \cdot (s_x s_B)

which is ``\hat x W`` with ``\hat x = (q - z_x) s_x`` and ``W = (B - z_B) s_B``. This pass
writes it so: a float ``MatMul`` of ``\hat x`` (with the straight-through term of
:func:`onnxgrad.normalize.ste.straight_through`, so the gradient reaches ``x``) and
``W = DequantizeLinear(B, s_B, z_B)``, the value a LoRA adapter adds to
(:mod:`onnxgrad.graph.qlora`). ``B``, ``s_B`` and ``z_B`` stay frozen; a ``B`` that is itself
an activation's ``DynamicQuantizeLinear`` is read straight through like ``x``. The kernel sums the
integer products exactly and scales once; the float product rounds each term: the values
agree up to float32 rounding of the accumulation. A product the pattern does not describe
(an int32 bias added before the ``Cast``, other scales) is left to
:func:`onnxgrad.normalize.ste.lower_integer_product_cast`.
"""

from __future__ import annotations

from typing import NamedTuple

from onnx import ModelProto, NodeProto, TensorProto, helper

from onnxgrad._onnx_utils import normalize_domain
from onnxgrad.normalize.lowering import Lowerer, lower_nodes
from onnxgrad.normalize.ste import (
    HELD_SCALE,
    dequantized_codes,
    differentiable_scale,
    held_scale,
    rounding_held,
    straight_through,
)


def dynamic_round_trip(lw: Lowerer, x: str) -> str:
    """``x`` quantized by a new ``DynamicQuantizeLinear`` and dequantized, read straight
    through (:func:`dequantized_round_trip`)."""
    code, scale, zero = lw.ops("DynamicQuantizeLinear", [x], 3)
    lw.builder.graph.node[-1].doc_string = HELD_SCALE
    lw.types[scale] = helper.make_tensor_type_proto(TensorProto.FLOAT, [])
    lw.types[zero] = helper.make_tensor_type_proto(TensorProto.UINT8, [])
    if rounding_held():
        scale = differentiable_scale(lw, x, scale)
    return dequantized_round_trip(lw, x, code, scale, zero)


def dequantized_round_trip(lw: Lowerer, x: str, code: str, scale: str, zero: str) -> str:
    """``(code - zero) scale`` (``DynamicQuantizeLinear``'s outputs for ``x``) with the
    straight-through term: its value, and the derivative 1 with respect to ``x`` (where
    rounding is held, the derivative through ``scale`` only)."""
    if rounding_held():
        return dequantized_codes(lw, code, scale, zero)
    held = held_scale(lw, scale)
    value = lw.op("DequantizeLinear", code, held, zero)
    return lw.op("Add", value, straight_through(lw, x, held, zero, TensorProto.UINT8))


class _Product(NamedTuple):
    dynamic: NodeProto  # DynamicQuantizeLinear(x)
    nodes: tuple[NodeProto, ...]  # MatMulInteger, Cast, Mul(s_x, s_B): superseded
    codes: str  # B
    scale: str  # s_B
    zero: str  # z_B, '' when absent


def lower_scaled_integer_product(lw: Lowerer) -> None:
    """``Mul(Cast(MatMulInteger(DynamicQuantizeLinear(x), B)), s_x s_B)`` as
    ``MatMul(\\hat x, DequantizeLinear(B))``; any other ``Mul`` is kept."""
    node = lw.node
    found = _pattern(lw, node)
    weight = None if found is None else _dequantized_right(lw, found)
    if weight is None:
        lw.builder.graph.node.append(node)
        return
    x, (code, scale, zero) = found.dynamic.input[0], found.dynamic.output
    rounded = dequantized_round_trip(lw, x, code, scale, zero)
    lw.op("MatMul", rounded, weight, out=node.output[0])
    lw.superseded.update(id(n) for n in found.nodes)


def _dequantized_right(lw: Lowerer, found: _Product) -> str | None:
    """The right factor: a weight dequantized, or an activation quantized by its own
    ``DynamicQuantizeLinear`` read straight through too."""
    source = lw.producers.get(found.codes)
    if source is not None and source.op_type == "DynamicQuantizeLinear":
        if list(source.output) == [found.codes, found.scale, found.zero]:
            return dequantized_round_trip(lw, source.input[0], *source.output)
        return None
    return _dequantized_weight(lw, found.codes, found.scale, found.zero)


def _pattern(lw: Lowerer, node: NodeProto) -> _Product | None:
    """What ``node`` reads when it is the scaled integer product of the module docstring."""
    if len(node.input) != 2 or node.input[0] == node.input[1]:
        return None
    for i in (0, 1):
        cast, scales = lw.producers.get(node.input[i]), node.input[1 - i]
        product = _integer_product(lw, cast)
        if product is None:
            continue
        dynamic = lw.producers.get(product.input[0])
        if dynamic is None or dynamic.op_type != "DynamicQuantizeLinear":
            continue
        if len(product.input) < 3 or product.input[2] != dynamic.output[2]:
            continue
        weight_scale = _other_factor(lw, scales, dynamic.output[1])
        if weight_scale is None:
            continue
        zero = product.input[3] if len(product.input) > 3 else ""
        nodes = (product, cast, lw.producers[scales])
        return _Product(dynamic, nodes, product.input[1], weight_scale, zero)
    return None


def _integer_product(lw: Lowerer, cast: NodeProto | None) -> NodeProto | None:
    """The ``MatMulInteger`` that ``cast`` (a ``Cast`` to float32 read once) converts."""
    if cast is None or cast.op_type != "Cast" or normalize_domain(cast.domain):
        return None
    to = next((a.i for a in cast.attribute if a.name == "to"), None)
    if to != TensorProto.FLOAT or lw.uses.get(cast.output[0], 0) != 1:
        return None
    product = lw.producers.get(cast.input[0])
    if product is None or product.op_type != "MatMulInteger" or normalize_domain(product.domain):
        return None
    if lw.uses.get(product.output[0], 0) != 1:
        return None
    return product


def _other_factor(lw: Lowerer, scales: str, activation_scale: str) -> str | None:
    """``s_B`` where ``scales = Mul(activation_scale, s_B)`` (either order), else ``None``."""
    node = lw.producers.get(scales)
    if node is None or node.op_type != "Mul" or normalize_domain(node.domain):
        return None
    if len(node.input) != 2 or activation_scale not in node.input:
        return None
    other = node.input[1 - list(node.input).index(activation_scale)]
    return other if other != activation_scale else None


def _dequantized_weight(lw: Lowerer, codes: str, scale: str, zero: str) -> str | None:
    """``DequantizeLinear(codes, scale, zero)`` for a 2-D ``codes`` with per-tensor or
    per-column (last axis) scale and zero point, else ``None``."""
    shapes = [lw.dims(name) for name in (codes, scale, zero) if name]
    if any(dims is None for dims in shapes) or len(shapes[0]) != 2:
        return None
    if lw.elem(scale) != TensorProto.FLOAT:
        return None
    columns = shapes[0][1]
    sizes = {_size(dims) for dims in shapes[1:]}
    if any(len(dims) > 1 for dims in shapes[1:]) or not sizes <= {1, columns}:
        return None
    parameters = [name for name in (scale, zero) if name]
    if sizes == {1}:
        flat = [
            lw.op("Reshape", name, lw.ints([])) if lw.dims(name) else name for name in parameters
        ]
        return lw.op("DequantizeLinear", codes, *flat)
    if columns is None:
        return None
    wide = [
        lw.op("Expand", lw.op("Reshape", n, lw.ints([-1])), lw.ints([columns])) for n in parameters
    ]
    return lw.op("DequantizeLinear", codes, *wide, axis=1)


def _size(dims: list) -> int | None:
    size = 1
    for d in dims:
        if d is None:
            return None
        size *= d
    return size


INTEGER_PRODUCTS = {("", "Mul"): lower_scaled_integer_product}


def lowered_integer_products(model: ModelProto) -> ModelProto:
    """``model`` with its scaled ``MatMulInteger`` products as float products (module
    docstring); ``model`` itself when it has none."""
    if not any(n.op_type == "MatMulInteger" for n in model.graph.node):
        return model
    return lower_nodes(model, INTEGER_PRODUCTS)
