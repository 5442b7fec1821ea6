r"""Where a deployed model computes ``y = x W``: the float values around each weight's product.

A model meant for inference keeps the operators the deployed file had (float, fused,
float16, ``quantize_dynamic``'s integer products, QDQ, 4-bit ``MatMulNBits``), so the
trained weights are written back into that form rather than into the normalised, lowered
graph training differentiates. Each :class:`Product` names, for one node reading a weight,
the float input ``x`` and the node whose first output is the float product ``y``:

- ``MatMul(x, W)``, ``Gemm(x, W)`` (``W`` float), ``MatMulNBits(x, codes)``,
  ``DynamicQuantizeMatMul(x, codes)``: ``y`` is the node's output; ``MatMul(x, Transpose(W))``
  with only such products reading the ``Transpose``: ``W`` read ``transposed``, the
  ``Transpose`` its reader;
- ``MatMul(x, DequantizeLinear(q))`` or ``Gemm(x, DequantizeLinear(q), c)`` (``transB``
  a swap of the codes' layout) through ``Transpose``/``Identity``/``Cast`` to a float type
  (QDQ): ``x`` is its (dequantized) activation, ``y`` the ``MatMul``'s output or, where that
  is quantized again (``MatMul -> QuantizeLinear -> DequantizeLinear``, the pattern
  onnxruntime fuses into ``QLinearMatMul`` or, for ``Gemm``, ``QGemm``), the
  ``DequantizeLinear``'s output. The weight may also be requantized on the way, a
  ``QuantizeLinear -> DequantizeLinear`` pair of one scale and zero point
  (``quantize_static`` reads a weight shared by two layers a second time so, as an
  activation): ``W_2 = DQ(Q(W, s_2, z_2))``, within half a step ``s_2`` of ``W``, so the
  product reads ``W`` up to the file's own rounding and is a reader of ``q`` too;
- the same with the weight dequantized by plain operators, ``(Cast(q) - z) s`` or
  ``(Cast(q) - z) / d`` (:mod:`onnxgrad.graph.plain_dequantization`): ``kind`` ``Cast``, the
  ``Cast`` reading ``q``;
- ``MatMulInteger(DynamicQuantizeLinear(x), q)`` followed by ``Cast`` and the ``Mul`` by
  the scales (``quantize_dynamic``): ``y`` is the last ``Mul``'s output;
- ``QLinearMatMul(QuantizeLinear(x), q)`` read by one ``DequantizeLinear``: ``y`` is that
  ``DequantizeLinear``'s output.

Where a bias ``Add`` (a constant ``[1, ..., 1, N]``) alone reads ``y`` of a
``quantize_dynamic`` or 4-bit product, ``y`` is that ``Add``'s output: onnxruntime folds the
bias into the product's kernel; unless a GELU reads the sum (``Erf`` or ``Tanh`` through
``Mul``/``Div``/``Pow``, or a fused ``Gelu``), where onnxruntime folds the bias into
``BiasGelu`` / ``FastGelu`` instead. Where a float ``MatMul``'s bias ``Add`` is read by a
residual ``Add`` alone whose sum a ``LayerNormalization`` reads, ``LN((x W + b) + r)``,
onnxruntime folds the bias and the residual sum into ``SkipLayerNormalization``: the
product records that ``Add`` (``residual``) and its branch joins ``r`` instead.

A low-rank adapter kept beside such a product adds ``s (x A) B`` to ``y``
(:func:`add_branch`); :func:`remove_branch` undoes it once folded into ``W``. Where ``y``
was quantized again, the sum is too, with the same scale and zero point:
``y' = DQ(Q(y + s (x A) B))``, so every node of the deployed graph keeps its neighbours and
onnxruntime's fusions of the base (``QLinearMatMul``, the next node's ``DequantizeLinear``)
still apply: the branch is added after the fused pattern, not inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES, NameScope, normalize_domain, np_dtype
from onnxgrad.graph.plain_dequantization import PlainDequantization, plain_dequantization

MS = "com.microsoft"
#: operators a QDQ weight passes through between its DequantizeLinear and the MatMul
LAYOUT_OPS = frozenset({"Transpose", "Identity", "Cast"})
#: products whose onnxruntime kernel takes the bias ``Add`` after them in (``quantize_dynamic``'s
#: chain becomes ``MatMulIntegerToFloat``); a float product's bias goes to the next fused
#: operator: ``BiasGelu``, which a branch before the bias leaves alone, or
#: ``SkipLayerNormalization``, which one joining the residual does (``Product.residual``)
BIASED = frozenset({"MatMulInteger", "DynamicQuantizeMatMul", "MatMulNBits"})
_INTEGER_TYPES = frozenset(
    {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4}
)


@dataclass(frozen=True)
class Product:
    """One product ``y = x W`` of the deployed model reading ``weight``.

    ``kind`` is the operator ``reader`` reading the weight (``MatMul``, ``Gemm``,
    ``MatMulNBits``, ``MatMulInteger``, ``DynamicQuantizeMatMul``, ``QLinearMatMul``,
    ``DequantizeLinear`` for QDQ or ``Cast`` for its plain-operator form), ``node`` the one
    writing ``y``, ``shape`` the ``(K, N)`` of ``W`` as the product uses it, ``transposed``
    whether the weight is stored ``N x K`` (``Gemm`` with ``transB``), ``alpha`` ``Gemm``'s
    factor."""

    weight: str
    kind: str
    node: NodeProto
    x: str
    shape: tuple[int, int]
    elem_type: int
    reader: str = ""
    transposed: bool = False
    alpha: float = 1.0
    #: QDQ: the permutation between the codes and the ``K x N`` weight (``None``: none)
    perm: tuple[int, ...] | None = None
    #: QDQ: the ``QuantizeLinear`` of the product's output, ``node`` its ``DequantizeLinear``
    requantized_by: NodeProto | None = None
    #: QDQ: the names of the nodes between the weight's ``DequantizeLinear`` and the product
    #: (layout operators, a requantization's ``QuantizeLinear`` and ``DequantizeLinear``)
    via: tuple[str, ...] = ()
    #: QDQ: the ``QuantizeLinear`` nodes of ``via`` (the weight quantized again on its way)
    requantizations: tuple[str, ...] = ()
    #: ``kind`` ``Cast``: the plain operators dequantizing the codes
    plain: PlainDequantization | None = None
    #: a float ``MatMul`` whose bias ``Add`` a residual ``Add`` before a ``LayerNormalization``
    #: reads: that ``Add`` and the index of its residual input, where the branch joins
    residual: tuple[NodeProto, int] | None = None

    @property
    def y(self) -> str:
        return self.node.output[0]

    @property
    def quantized(self) -> bool:
        return self.kind not in ("MatMul", "Gemm")


def weight_products(model: ModelProto) -> dict[str, list[Product]]:
    """``{weight initializer: its products}`` of ``model``'s main graph (module docstring),
    in node order; nodes without a name are named."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list[NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    for output in graph.output:  # read by the user: a value no rewrite may move
        readers.setdefault(output.name, []).append(NodeProto(op_type="graph output"))
    names = NameScope(n.name for n in graph.node if n.name)
    for node in graph.node:
        if not node.name:
            node.name = names.unique(f"{node.op_type}_{node.output[0]}")
    context = (inits, producers, readers)
    position = {out: i for i, node in enumerate(graph.node) for out in node.output}
    found: dict[str, list[Product]] = {}
    for node in graph.node:
        product = _product(node, context)
        if product is not None:
            bias = _bias_add(product.node, context) if product.kind in BIASED else None
            if bias is not None:
                product = replace(product, node=bias)
            elif product.kind == "MatMul":
                residual = _residual_add(product.node, context, position)
                product = replace(product, residual=residual)
            found.setdefault(product.weight, []).append(product)
    return found


def one_adapter(products: list[Product]) -> list[Product] | None:
    r"""``products`` (every reader of one quantized weight) as the readers of one adapter
    ``A B``, ``K x N`` as the first product reads the weight: a product reading it in the
    other layout (the codes moved by the other of the two 2-D permutations, its ``K x N`` the
    first's ``N x K``) reads ``(A B)^T`` and is marked ``transposed`` (its branch
    ``s (x B^T) A^T``). ``None`` where a product's shape is neither."""
    first = products[0]
    base = _codes_layout(first)
    readers = []
    for product in products:
        same = _codes_layout(product) == base
        if product.shape != (first.shape if same else first.shape[::-1]):
            return None
        readers.append(replace(product, transposed=not same))
    return readers


def _codes_layout(product: Product) -> tuple[int, ...] | None:
    """How ``product`` permutes the codes into its ``K x N`` (``None``: not at all)."""
    perm = product.perm
    return None if perm is None or list(perm) == sorted(perm) else tuple(perm)


def _bias_add(node: NodeProto, context) -> NodeProto | None:
    """The ``Add`` of a bias (a constant ``[N]``, or ``[1, N]`` as BART's logits bias) that
    alone reads ``node``'s output: for
    :data:`BIASED` products onnxruntime folds it into the kernel, so a branch is added after
    it, ``(y + b) + s x A B``, not between them."""
    inits, producers, readers = context
    add = _only_reader(node.output[0], readers, "Add")
    if add is None or _read_by_gelu(add.output[0], readers):
        return None
    return add if _is_bias(add, node.output[0], inits, producers) else None


def _is_bias(add: NodeProto, y: str, inits, producers) -> bool:
    """Whether ``add`` adds a bias to ``y``: a constant ``[N]`` or ``[1, ..., 1, N]``."""
    other = [name for name in add.input if name != y]
    if len(other) != 1:
        return False
    dims = _constant_dims(other[0], inits, producers)
    return bool(dims) and all(d == 1 for d in dims[:-1])


def _residual_add(node: NodeProto, context, position: dict) -> tuple[NodeProto, int] | None:
    r"""For ``y`` of a float ``MatMul`` read by a bias ``Add`` alone and that by a residual
    ``Add`` alone, ``(y + b) + r``, whose sum a ``LayerNormalization`` reads: that ``Add``
    and the index of ``r`` (produced before ``node``). onnxruntime fuses the bias, the
    residual sum and the norm into one ``SkipLayerNormalization``; a branch joining at ``y``
    would leave the bias ``Add`` out of it, so it joins ``r`` instead:
    ``(y + b) + (r + s x A B)``, the same sum."""
    inits, producers, readers = context
    bias = _only_reader(node.output[0], readers, "Add")
    if bias is None or not _is_bias(bias, node.output[0], inits, producers):
        return None
    residual = _only_reader(bias.output[0], readers, "Add")
    if residual is None or len(residual.input) != 2:
        return None
    index = 1 - list(residual.input).index(bias.output[0])
    r = residual.input[index]
    normed = any(
        reader.op_type == "LayerNormalization" and not normalize_domain(reader.domain)
        for reader in readers.get(residual.output[0], [])
    )
    if not normed or r == bias.output[0] or _constant_dims(r, inits, producers) is not None:
        return None
    before = position.get(r, -1) < position[node.output[0]]  # the branch follows node
    return (residual, index) if before else None


#: the operators a GELU's argument passes through before its ``Erf`` or ``Tanh``
_GELU_ARITHMETIC = frozenset({"Mul", "Div", "Pow", "Add"})
_FUSED_GELU = frozenset({"Gelu", "FastGelu", "QuickGelu", "BiasGelu"})


def _read_by_gelu(name: str, readers, depth: int = 3) -> bool:
    """``name`` is the argument of a GELU: read by a fused one, or, within ``depth``
    arithmetic nodes, by the ``Erf`` (exact) or ``Tanh`` (approximate) of one."""
    for reader in readers.get(name, []):
        if reader.op_type in _FUSED_GELU or reader.op_type in ("Erf", "Tanh"):
            return True
        arithmetic = depth > 1 and reader.op_type in _GELU_ARITHMETIC
        if arithmetic and _read_by_gelu(reader.output[0], readers, depth - 1):
            return True
    return False


def _constant_dims(name: str, inits, producers) -> list[int] | None:
    """The dims of ``name`` when it is a constant (an initializer or a ``Constant`` tensor,
    through ``Identity`` nodes), else ``None``."""
    node = producers.get(name)
    while node is not None and node.op_type == "Identity" and not normalize_domain(node.domain):
        name, node = node.input[0], producers.get(node.input[0])
    if node is None:
        return list(inits[name].dims) if name in inits else None
    if node.op_type == "Constant" and not normalize_domain(node.domain):
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return list(value.dims) if value is not None else None
    return None


def _product(node: NodeProto, context) -> Product | None:
    inits = context[0]
    key = (normalize_domain(node.domain), node.op_type)
    if key == ("", "MatMul") and len(node.input) == 2:
        return _matmul(node, context)
    if key == ("", "Gemm") and len(node.input) >= 2:
        return _gemm(node, context)
    if key == (MS, "MatMulNBits") and node.input[1] in inits:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        shape = (int(attrs.get("K", 0)), int(attrs.get("N", 0)))
        return _made(node.input[1], "MatMulNBits", node, node.input[0], shape, inits, node.input[2])
    if key == (MS, "DynamicQuantizeMatMul") and _integer_matrix(node.input[1], inits):
        dims = tuple(inits[node.input[1]].dims)
        return _made(node.input[1], node.op_type, node, node.input[0], dims, inits, node.input[2])
    if key == ("", "MatMulInteger") and _integer_matrix(node.input[1], inits):
        return _integer_product(node, context)
    if key == ("", "QLinearMatMul") and _integer_matrix(node.input[3], inits):
        return _qlinear_product(node, context)
    return None


def _made(weight, kind, node, x, shape, inits, typed, reader=None, **extra) -> Product | None:
    """A product whose float type is ``typed``'s (an initializer), when ``shape`` is a
    static ``K x N``; ``reader`` (default ``node``) reads the weight."""
    if len(shape) != 2 or not all(int(d) > 0 for d in shape):
        return None
    elem = inits[typed].data_type if typed in inits else TensorProto.FLOAT
    if elem not in FLOAT_TYPES:
        return None
    shape = (int(shape[0]), int(shape[1]))
    return Product(weight, kind, node, x, shape, elem, (reader or node).name, **extra)


def _integer_matrix(name: str, inits) -> bool:
    init = inits.get(name)
    return init is not None and init.data_type in _INTEGER_TYPES and len(init.dims) == 2


def _matmul(node: NodeProto, context) -> Product | None:
    inits = context[0]
    weight = node.input[1]
    if weight in inits:
        init = inits[weight]
        if init.data_type in FLOAT_TYPES and len(init.dims) == 2:
            return _made(weight, "MatMul", node, node.input[0], tuple(init.dims), inits, weight)
        return None
    transpose = _float_transpose(weight, context)
    if transpose is not None:
        stored = transpose.input[0]
        shape = tuple(inits[stored].dims)[::-1]
        x = node.input[0]
        return _made(stored, "MatMul", node, x, shape, inits, stored, transpose, transposed=True)
    return _qdq_product(node, context)


def _float_transpose(value: str, context) -> NodeProto | None:
    """The ``Transpose`` of a 2-D float initializer writing ``value``, when only ``MatMul``
    products (as their weight) read it: ``MatMul(x, Transpose(W))`` reads ``W^T``, ``W``
    stored ``N x K`` (PyTorch's ``Linear`` exported without folding the transpose)."""
    inits, producers, readers = context
    node = producers.get(value)
    if node is None or node.op_type != "Transpose" or normalize_domain(node.domain):
        return None
    init = inits.get(node.input[0])
    if init is None or init.data_type not in FLOAT_TYPES or len(init.dims) != 2:
        return None
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
    users = readers.get(value, [])
    only_products = all(
        u.op_type == "MatMul" and not normalize_domain(u.domain) and list(u.input[1:]) == [value]
        for u in users
    )
    return node if perm == [1, 0] and users and only_products else None


def _qdq_product(node: NodeProto, context, transposed: bool = False, alpha: float = 1.0):
    """The product of a ``MatMul`` or ``Gemm`` ``node`` whose weight (input 1) is
    dequantized from integer codes (QDQ, or its plain-operator form), ``transposed`` where
    the node reads it ``N x K`` (``Gemm``'s ``transB``): one more swap of the codes' layout."""
    inits, producers, readers = context
    dequantize, perm, via = dequantize_behind(node.input[1], producers, inits)
    if dequantize is None:
        return None
    if transposed:
        perm = [1, 0] if perm in (None, [0, 1]) else None
    plain = plain_dequantization(dequantize, producers, inits)
    codes, scale = (plain.codes, plain.scale) if plain else dequantize.input[:2]
    reader = _cast_of(plain, dequantize, producers) if plain else dequantize
    dims = tuple(inits[codes].dims)
    shape = tuple(dims[i] for i in perm) if perm else dims
    quantize, output = _requantized_output(node, readers)
    return _made(
        codes,
        "Cast" if plain else "DequantizeLinear",
        output or node,
        _activation_before_rounding(node.input[0], producers),
        shape,
        inits,
        scale,
        reader,
        plain=plain,
        perm=tuple(perm) if perm else None,
        requantized_by=quantize,
        alpha=alpha,
        via=tuple(n.name for n in via),
        requantizations=tuple(n.name for n in via if n.op_type == "QuantizeLinear"),
    )


def _cast_of(plain: PlainDequantization, last: NodeProto, producers) -> NodeProto:
    """The ``Cast`` reading the codes of ``plain`` (ending in ``last``)."""
    node = last
    while node.name != plain.cast:  # the codes' Cast is first: behind the Sub's first input
        node = producers[node.input[0]] if node.input[0] in producers else producers[node.input[1]]
    return node


def _activation_before_rounding(x: str, producers) -> str:
    """``v`` where ``x = DequantizeLinear(QuantizeLinear(v))`` (a QDQ activation), else
    ``x``: the branch reads the float activation, as beside ``quantize_dynamic``'s products,
    so the pair keeps its one reader and onnxruntime still fuses it into the product."""
    dequantize = producers.get(x)
    if dequantize is None or (dequantize.op_type, normalize_domain(dequantize.domain)) != (
        "DequantizeLinear",
        "",
    ):
        return x
    quantize = producers.get(dequantize.input[0])
    if quantize is None or (quantize.op_type, normalize_domain(quantize.domain)) != (
        "QuantizeLinear",
        "",
    ):
        return x
    return quantize.input[0]


def _requantized_output(node: NodeProto, readers) -> tuple[NodeProto | None, NodeProto | None]:
    """``(QuantizeLinear, DequantizeLinear)`` when ``node``'s output is only quantized and
    dequantized again (QDQ's ``MatMul -> Q -> DQ``), else ``(None, None)``."""
    quantize = _only_reader(node.output[0], readers, "QuantizeLinear")
    if quantize is None:
        return None, None
    dequantize = _only_reader(quantize.output[0], readers, "DequantizeLinear")
    if dequantize is None or len(quantize.output) != 1:
        return None, None
    return quantize, dequantize


def dequantize_behind(
    value: str, producers, inits
) -> tuple[NodeProto | None, list[int] | None, list[NodeProto]]:
    """The ``DequantizeLinear`` of integer codes (a 2-D initializer), or the ``Mul``, ``Div``
    or (per block) ``Reshape`` ending its plain-operator form
    (:mod:`onnxgrad.graph.plain_dequantization`), that ``value`` is computed from through
    :data:`LAYOUT_OPS` and requantizations (:func:`_requantization`), the composed
    permutation (``None`` for none) and the nodes passed after it, in order;
    ``(None, None, [])`` when there is none."""
    perm, via = None, []
    node = producers.get(value)
    while node is not None and not normalize_domain(node.domain):
        plain = node.op_type in ("Mul", "Div", "Reshape")
        if plain and plain_dequantization(node, producers, inits):
            return node, perm, via[::-1]
        if node.op_type == "DequantizeLinear":
            if _integer_matrix(node.input[0], inits):
                return node, perm, via[::-1]
            quantize = _requantization(node, producers)
            if quantize is None:
                break
            via += [node, quantize]
            node = producers.get(quantize.input[0])
            continue
        if not _preserves_values(node):
            break
        if node.op_type == "Transpose":
            step = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
            perm = step if perm is None else [step[i] for i in perm]
        via.append(node)
        node = producers.get(node.input[0])
    return None, None, []


def _preserves_values(node: NodeProto) -> bool:
    """A :data:`LAYOUT_OPS` node: ``Transpose``, ``Identity``, ``Cast`` to a float type."""
    if node.op_type == "Cast":
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        return to in FLOAT_TYPES
    return node.op_type in LAYOUT_OPS


#: the attributes saying which values of a quantized tensor share a scale
_GROUPING = ("axis", "block_size")


def _requantization(dequantize: NodeProto, producers) -> NodeProto | None:
    """The ``QuantizeLinear`` whose codes ``dequantize`` reads back with the same scale,
    zero point and attributes (``DQ(Q(W, s, z), s, z)``: ``W`` rounded to the step ``s``),
    else ``None``."""
    quantize = producers.get(dequantize.input[0])
    if quantize is None or (quantize.op_type, normalize_domain(quantize.domain)) != (
        "QuantizeLinear",
        "",
    ):
        return None
    same = list(quantize.input[1:3]) == list(dequantize.input[1:3])
    layouts = [
        {"axis": 1, "block_size": 0} | {a.name: a.i for a in n.attribute if a.name in _GROUPING}
        for n in (quantize, dequantize)
    ]
    return quantize if same and layouts[0] == layouts[1] and len(quantize.output) == 1 else None


def _gemm(node: NodeProto, context) -> Product | None:
    inits = context[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    weight = node.input[1]
    transposed = bool(attrs.get("transB", 0))
    alpha = float(attrs.get("alpha", 1.0))
    if attrs.get("transA", 0):
        return None
    if weight not in inits:
        return _qdq_product(node, context, transposed, alpha)
    if len(inits[weight].dims) != 2:
        return None
    dims = tuple(inits[weight].dims)
    shape = dims[::-1] if transposed else dims
    return _made(
        weight,
        "Gemm",
        node,
        node.input[0],
        shape,
        inits,
        weight,
        transposed=transposed,
        alpha=alpha,
    )


def _only_reader(name: str, readers, op_type: str) -> NodeProto | None:
    found = readers.get(name, [])
    if len(found) == 1 and found[0].op_type == op_type and not normalize_domain(found[0].domain):
        return found[0]
    return None


def _integer_product(node: NodeProto, context) -> Product | None:
    """``quantize_dynamic``'s ``Cast(MatMulInteger(DynamicQuantizeLinear(x), q))`` times the
    scales: ``y`` is the last ``Mul`` of the chain."""
    inits, producers, readers = context
    source = producers.get(node.input[0])
    if source is None or source.op_type != "DynamicQuantizeLinear":
        return None
    last = _only_reader(node.output[0], readers, "Cast")
    if last is None:
        return None
    while (following := _only_reader(last.output[0], readers, "Mul")) is not None:
        other = [name for name in following.input if name != last.output[0]]
        if len(other) != 1 or not _is_scale(other[0], source.output[1], inits, producers):
            break
        last = following
    if last.op_type != "Mul":
        return None
    dims = tuple(inits[node.input[1]].dims)
    kind, x = "MatMulInteger", source.input[0]
    return Product(node.input[1], kind, last, x, dims, TensorProto.FLOAT, node.name)


def _is_scale(name: str, activation_scale: str, inits, producers, depth: int = 0) -> bool:
    """Whether ``name`` is a scale of the product: an initializer, the activation's
    dynamic scale, or a ``Mul`` of such (never a value computed from the data)."""
    if name in inits or name == activation_scale:
        return True
    node = producers.get(name)
    return (
        depth < 4
        and node is not None
        and node.op_type == "Mul"
        and all(_is_scale(i, activation_scale, inits, producers, depth + 1) for i in node.input)
    )


def _qlinear_product(node: NodeProto, context) -> Product | None:
    inits, producers, readers = context
    source = producers.get(node.input[0])
    result = _only_reader(node.output[0], readers, "DequantizeLinear")
    if source is None or source.op_type != "QuantizeLinear" or result is None:
        return None
    dims = tuple(inits[node.input[3]].dims)
    x, scale = source.input[0], node.input[1]
    return _made(node.input[3], "QLinearMatMul", result, x, dims, inits, scale, node)


def add_branch(
    graph, product: Product, a: str, b: str, scale: float, names: NameScope, node_names: NameScope
) -> list[NodeProto]:
    r"""The nodes of ``y + (x (s \alpha A)) B`` (``A``, ``B`` float32 names of shapes
    ``K x r``, ``r x N``; ``(x B^T) A^T`` for a weight stored transposed; the scale on the
    small ``K x r`` factor, not on the ``M x N`` product): ``product``'s node now writes
    ``<y>_without_lora`` and the sum takes ``y``'s name, so its readers and a graph output
    get the sum (quantized and dequantized again where ``y`` was, module docstring). The
    caller inserts the nodes right after ``product.node``."""
    base = product.weight
    nodes: list[NodeProto] = []

    def add(op, inputs, **attrs):
        out = names.unique(f"{base}_lora_{op}")
        name = node_names.unique(f"{base}_lora_{op}")
        nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    if product.elem_type != TensorProto.FLOAT:
        a, b = add("Cast", [a], to=product.elem_type), add("Cast", [b], to=product.elem_type)
    if product.transposed:
        a, b = add("Transpose", [b], perm=[1, 0]), add("Transpose", [a], perm=[1, 0])
    factor = scale * product.alpha
    if factor != 1:  # on the K x r factor, a constant onnxruntime folds where A is one
        value = numpy_helper.from_array(np.asarray(factor, dtype=np_dtype(product.elem_type)))
        a = add("Mul", [a, add("Constant", [], value=value)])
    delta = add("MatMul", [add("MatMul", [product.x, a]), b])
    if product.residual is not None:  # (y + b) + (r + delta): module docstring
        residual, index = product.residual
        total = add("Add", [residual.input[index], delta])
        residual.input[index] = total
        return nodes
    y = product.node.output[0]
    product.node.output[0] = names.unique(f"{y}_without_lora")
    total = add("Add", [product.node.output[0], delta])
    quantize = product.requantized_by
    if quantize is not None:
        codes = add("QuantizeLinear", [total, *quantize.input[1:]])
        nodes[-1].attribute.extend(quantize.attribute)
        total = add("DequantizeLinear", [codes, *product.node.input[1:]])
        nodes[-1].attribute.extend(product.node.attribute)
    nodes[-1].output[0] = y
    return nodes


def share_first_products(
    graph, branches: list[tuple[list[NodeProto], int]], opset: int, names, node_names
) -> dict[str, list[str]]:
    r"""Branches reading the same ``x`` (query, key and value; gate and up) compute
    ``x [A_1 | A_2 | ...]`` in one ``MatMul`` and split it into the ``x A_i``, in place:
    one pass over ``x`` instead of one per branch, the same values. ``branches`` are the
    nodes :func:`add_branch` gave (in ``graph``) with each adapter's rank. Returns, for each
    first product replaced, the names of the nodes now computing it."""
    by_x: dict[str, list[tuple[NodeProto, list[NodeProto], int]]] = {}
    for nodes, rank in branches:
        first, preparation = _first_product(nodes)
        by_x.setdefault(first.input[0], []).append((first, preparation, rank))
    replaced: dict[str, list[str]] = {}
    for x, group in by_x.items():
        if len(group) > 1:
            shared = _shared_first_product(x, group, opset, names, node_names)
            _replace_nodes(graph, [n for f, p, _ in group for n in (*p, f)], shared)
            replaced.update({first.name: [n.name for n in shared] for first, _, _ in group})
    return replaced


def _first_product(nodes: list[NodeProto]) -> tuple[NodeProto, list[NodeProto]]:
    """A branch's ``MatMul(x, A')`` and the nodes making ``A'`` from ``A`` (cast, transpose,
    scale: they read only initializers, inputs and constants)."""
    producers = {out: node for node in nodes for out in node.output}
    first = next(n for n in nodes if n.op_type == "MatMul" and n.input[0] not in producers)
    preparation, pending = set(), [first.input[1]]
    while pending:
        node = producers.get(pending.pop())
        if node is not None and node.name not in preparation:
            preparation.add(node.name)
            pending.extend(node.input)
    return first, [n for n in nodes if n.name in preparation]


def _shared_first_product(x, group, opset, names, node_names) -> list[NodeProto]:
    base = names.unique(f"{x}_lora")

    def node(op, inputs, outputs, **attrs):
        name = node_names.unique(f"{base}_{op}")
        return helper.make_node(op, inputs, outputs, name=name, **attrs)

    ranks = [rank for _, _, rank in group]
    stacked, product = names.unique(f"{base}_A"), names.unique(f"{base}_xA")
    nodes = [n for _, preparation, _ in group for n in preparation]
    nodes.append(node("Concat", [first.input[1] for first, _, _ in group], [stacked], axis=1))
    nodes.append(node("MatMul", [x, stacked], [product]))
    parts = [first.output[0] for first, _, _ in group]
    if opset < 13:
        nodes.append(node("Split", [product], parts, axis=-1, split=ranks))
    else:
        sizes = names.unique(f"{base}_ranks")
        value = numpy_helper.from_array(np.asarray(ranks, dtype=np.int64))
        nodes.append(node("Constant", [], [sizes], value=value))
        nodes.append(node("Split", [product, sizes], parts, axis=-1))
    return nodes


def _replace_nodes(graph, removed: list[NodeProto], added: list[NodeProto]) -> None:
    """``graph`` without ``removed``, ``added`` where the first of them was."""
    gone = {n.name for n in removed}
    kept, placed = [], False
    for node in graph.node:
        if node.name not in gone:
            kept.append(node)
        elif not placed:
            kept.extend(added)
            placed = True
    del graph.node[:]
    graph.node.extend(kept)


def insert_after(graph, new_nodes: dict[str, list[NodeProto]]) -> None:
    """Insert ``new_nodes[name]`` right after the node called ``name`` (order kept)."""
    ordered = []
    for node in graph.node:
        ordered.append(node)
        ordered.extend(new_nodes.get(node.name, []))
    del graph.node[:]
    graph.node.extend(ordered)


def remove_branch(graph, nodes: list[str], sums: list[str]) -> None:
    """Remove the branch nodes ``nodes`` whose last nodes are ``sums`` (the ``Add``, or the
    ``DequantizeLinear`` quantizing it again): each product writes its own output again."""
    removed = set(nodes)
    by_name = {node.name: node for node in graph.node}
    producers = {out: node for node in graph.node for out in node.output}
    renamed = {}
    for name in sums:
        last = by_name.get(name)
        if last is None or name not in removed or last.op_type not in ("Add", "DequantizeLinear"):
            raise ValueError(f"the adapter's branch sum {name!r} is no Add node of the model")
        first = last
        while (source := producers.get(first.input[0])) is not None and source.name in removed:
            first = source
        if first.op_type != "Add":
            raise ValueError(f"the adapter's branch sum {name!r} is no Add node of the model")
        renamed[first.input[0]] = last.output[0]
    kept = [node for node in graph.node if node.name not in removed]
    for node in kept:
        for i, out in enumerate(node.output):
            if out in renamed:
                node.output[i] = renamed[out]
    del graph.node[:]
    graph.node.extend(kept)


__all__ = [
    "Product",
    "add_branch",
    "insert_after",
    "one_adapter",
    "remove_branch",
    "share_first_products",
    "weight_products",
]
