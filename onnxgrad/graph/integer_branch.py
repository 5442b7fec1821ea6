r"""The first product of an adapter's branch beside an int8 base, computed in integers.

``quantize_dynamic``'s product ``y = MatMulInteger(DynamicQuantizeLinear(x), q)`` already
quantizes its activation, ``x ~ s_x (x_q - z_x)`` (uint8 codes, one scale and zero point per
run). The adapter's branch ``s (x A) B`` beside it (``add_branch`` of
:mod:`onnxgrad.graph.deployed_products`; ``A' = s A``, or ``[A'_1 | A'_2 | ...]`` for the
branches sharing ``x``) reads ``x`` again in float; here its first product reuses the codes:

    x A' ~ s_x (x_q - z_x) (A_q * s_A),    s_A[j] = max_k |A'[k, j]| / 63,
    A_q = round(A' / s_A)                  (int8, |A_q| <= 63, one scale per column)

``B`` and the ``Add`` stay float. Seven bits keep every pair of u8s8 products within int16
(``2 * 255 * 63 < 32767``), so the integer product is exact on CPUs without VNNI too (see
``tests/normalize/integer_products.py``). onnxruntime fuses ``MatMulInteger -> Cast -> Mul``
into ``MatMulIntegerToFloat``, the base's own kernel; ``A``'s quantization (a few nodes over the
``K x r`` factor) is folded once where ``A`` is an initializer (a merged model) and costs
``O(K r)`` a run where ``A`` is an input (the runtime adapter model).

The branch then differs from the float one by the rounding of ``x`` (the base's own) and of
``A`` (at most half a step ``s_A / 2`` an entry), and by the later layers' rounding this moves:
on the int8 forms of a small Llama and BERT, below the base's own rounding with adapters of a
moderate effect, above it on the BERT with adapters moving the logits as much as the logits
(docs/deployed-models.md). Training keeps the float branch; this form is asked for
(``integer_branch=True`` of ``merge_lora``, ``merge_checkpoint``, ``runtime_adapter_model``).
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import NameScope, is_default_op, reduce_axes_are_input

#: the largest code of ``A_q``: 7 bits, so a pair of u8s8 products fits in int16
CODE_LIMIT = 63
#: the smallest scale of a column (an all-zero column of ``A`` quantizes to zeros)
_TINY = np.finfo(np.float32).tiny


def integer_first_products(
    graph, candidates: set[str], opset: int, names: NameScope, node_names: NameScope
) -> dict[str, list[str]]:
    r"""Replace, in place, each ``MatMul(x, A')`` named in ``candidates`` whose ``x`` a
    ``DynamicQuantizeLinear`` before it quantizes by the integer product of the module
    docstring. Returns ``{replaced node: the names of the nodes now computing it}``; opsets
    below 11 (no ``Round``) are left as they are."""
    if opset < 11:
        return {}
    codes = {}  # x -> (position, the first DynamicQuantizeLinear of x)
    for i, node in enumerate(graph.node):
        if is_default_op(node, "DynamicQuantizeLinear"):
            codes.setdefault(node.input[0], (i, node))
    new_nodes: dict[str, list[NodeProto]] = {}
    for i, node in enumerate(graph.node):
        if node.name not in candidates or not is_default_op(node, "MatMul"):
            continue
        position, quantize = codes.get(node.input[0], (i, None))
        if quantize is not None and position < i:
            new_nodes[node.name] = _integer_product(node, quantize, opset, names, node_names)
    if new_nodes:
        ordered = [n for node in graph.node for n in new_nodes.get(node.name, [node])]
        del graph.node[:]
        graph.node.extend(ordered)
    return {name: [n.name for n in nodes] for name, nodes in new_nodes.items()}


def _integer_product(
    matmul: NodeProto, quantize: NodeProto, opset: int, names: NameScope, node_names: NameScope
) -> list[NodeProto]:
    """The nodes of ``s_x (x_q - z_x) (A_q * s_A)`` writing ``matmul``'s output."""
    base = matmul.output[0]
    nodes: list[NodeProto] = []

    def add(op, inputs, output=None, **attrs):
        output = output or names.unique(f"{base}_int8_{op}")
        name = node_names.unique(f"{base}_int8_{op}")
        nodes.append(helper.make_node(op, inputs, [output], name, **attrs))
        return output

    def constant(value, dtype):
        return add("Constant", [], value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))

    factor = matmul.input[1]
    if reduce_axes_are_input("ReduceMax", opset):
        largest = add("ReduceMax", [add("Abs", [factor]), constant([0], np.int64)], keepdims=0)
    else:
        largest = add("ReduceMax", [add("Abs", [factor])], axes=[0], keepdims=0)
    step = add("Div", [largest, constant(CODE_LIMIT, np.float32)])
    scale = add("Max", [step, constant(_TINY, np.float32)])
    factor_codes = add("Cast", [add("Round", [add("Div", [factor, scale])])], to=TensorProto.INT8)
    x_codes, x_scale, x_zero = quantize.output
    product = add("MatMulInteger", [x_codes, factor_codes, x_zero])
    scales = add("Mul", [x_scale, scale])
    add("Mul", [add("Cast", [product], to=TensorProto.FLOAT), scales], output=base)
    return nodes


__all__ = ["CODE_LIMIT", "integer_first_products"]
