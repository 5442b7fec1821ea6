r"""Activation quantization differentiated with the straight-through estimator.

Rounding has a zero derivative almost everywhere, so a model that quantizes its activations
(static QDQ, dynamic ``DynamicQuantizeLinear`` + ``MatMulInteger``) passes no gradient to
its inputs. The straight-through estimator (Bengio et al. 2013; PyTorch's fake quantization)
takes the round trip ``\hat x = (clip(round(x/s) + z) - z) s`` as the identity inside the
quantization range and as zero outside:

    \hat x \leftarrow \hat x + [q_{min} \le round(x/s) + z \le q_{max}]\,(x - sg(x))

whose value is exactly ``\hat x`` (``x - sg(x) = 0``) and whose derivative is the mask. The
stop-gradient ``sg(x)`` is built from piecewise-constant operators only, so the rewritten
graph is standard ONNX: ``sg(x) = Floor(x 2^k) / 2^k`` (exact for ``|x| \ge 2^{-(k-p)}``, ``p``
the mantissa width: ``k = 100`` in float32, ``2^{-76} \approx 1.3e-23``) and ``Floor(x)`` where
``|x| \ge 2^p`` (every such float is an integer). Below ``2^{-76}`` (zero excepted) and at
infinities the term is zero: no gradient there.

- ``DequantizeLinear(QuantizeLinear(x))`` (per tensor, per axis or per block, to 2- to 16-bit
  integer or float8 codes, ``x`` in any float type) becomes the same pair over ``sg(x)`` plus
  the term above: normalising again adds nothing. ``DequantizeLinear(DynamicQuantizeLinear(x))``
  likewise.
- ``DynamicQuantizeLinear``'s scale ``s = (max(0, max x) - min(0, min x)) / 255`` is a
  function of ``x`` with a derivative, which a consumer reading it as a float (an output,
  any float operator) gets; the consumers that rescale its integer codes (the dequantized
  round trip, ``Mul(Cast(MatMulInteger(q, B)), s s_B)``, an int32 bias quantized by
  ``s s_B``) read it held, so that the quantized product's derivative is the float
  product's, not that plus ``(q - z) B\, \partial s``.
- ``Cast(MatMulInteger(DynamicQuantizeLinear(x), B))`` and its ``ConvInteger`` twin, as
  onnxruntime's ``quantize_dynamic`` writes them, become the float product of
  ``(q - z) + mask (x - sg(x))/s`` and ``B - z_B``: the same value up to float rounding of
  the accumulation, the integer weight still frozen.
- Codes moved by layout operators between the quantizer and what rescales them (a
  ``Transpose``/``Reshape`` before a ``ConvInteger``, a ``Pad`` by the zero point; per-tensor
  parameters) are read the same way: the float value at the quantizer, the moves replayed
  on it (:mod:`onnxgrad.normalize.code_moves`).

The estimator is the default, for training. ``quantized_activations="exact"`` (on
:func:`onnxgrad.onnx_derivative`, ``make_train_step``, ``generate_artifacts`` and every
entry that normalises, :func:`quantized_activations`) asks instead for the derivative of the
deployed file itself, for analysis: the piece through the point, rounding held. A static
``QuantizeLinear``/``DequantizeLinear`` pair is kept as it is (its derivative is zero: the
codes are constant around the point and the scale is a constant); a
``DynamicQuantizeLinear``'s codes and zero point are held but its scale is computed
``s = (max(0, max x) - min(0, min x)) / 255`` with differentiable operators, so
``\hat x = (q - z) s`` has the derivative ``(q - z)\, \partial s / \partial x``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
from onnx import NodeProto, TensorProto, helper

from onnxgrad._onnx_utils import normalize_domain
from onnxgrad.normalize.code_moves import moved_codes_source, replayed
from onnxgrad.normalize.lowering import Lowerer

#: the values of ``quantized_activations=``: the straight-through estimator (default) or the
#: derivative of the deployed file, rounding held
STRAIGHT_THROUGH, EXACT = "straight_through", "exact"
QUANTIZED_ACTIVATIONS = (STRAIGHT_THROUGH, EXACT)
_MODE: ContextVar[str] = ContextVar("onnxgrad_quantized_activations", default=STRAIGHT_THROUGH)


def check_quantized_activations(mode: object) -> str:
    """``mode`` when it is one of :data:`QUANTIZED_ACTIVATIONS`, else ``ValueError``."""
    if not isinstance(mode, str) or mode not in QUANTIZED_ACTIVATIONS:
        raise ValueError(
            f"quantized_activations must be one of {list(QUANTIZED_ACTIVATIONS)}, got {mode!r}"
        )
    return mode


@contextmanager
def quantized_activations(mode: str) -> Iterator[None]:
    """Normalisation inside the block differentiates quantized activations by ``mode``."""
    token = _MODE.set(check_quantized_activations(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def rounding_held() -> bool:
    """Whether the current normalisation gives the derivative of the file itself."""
    return _MODE.get() == EXACT


def dynamic_scale(lw: Lowerer, x: str) -> str:
    """``DynamicQuantizeLinear``'s scale of a float32 ``x`` with differentiable operators:
    ``(max(0, max x) - min(0, min x)) / 255``."""
    zero = lw.const(0.0, TensorProto.FLOAT)
    high = lw.op("Max", lw.op("ReduceMax", x, keepdims=0), zero)
    low = lw.op("Min", lw.op("ReduceMin", x, keepdims=0), zero)
    return lw.op("Div", lw.op("Sub", high, low), lw.const(255.0, TensorProto.FLOAT))


def held_scale(lw: Lowerer, scale: str) -> str:
    """A float32 ``scale`` through piecewise-constant operators: its value for every finite
    scale (:func:`stop_gradient` at ``2^{-76}`` and above; below, the same of ``s 2^{75}``,
    divided back, exact down to the subnormals), derivative zero."""
    t = TensorProto.FLOAT
    up = lw.const(2.0**75, t)
    small = lw.op("Div", stop_gradient(lw, lw.op("Mul", scale, up), t), up)
    tiny = lw.op("Less", lw.op("Abs", scale), lw.const(2.0**-76, t))
    held = lw.op("Where", tiny, small, stop_gradient(lw, scale, t))
    lw.types[held] = lw.types.get(scale) or helper.make_tensor_type_proto(t, None)
    return held


def integer_scale(lw: Lowerer, scale: str) -> str:
    """``scale`` as a factor of an integer accumulation (an int32 bias quantized by
    ``s_x s_w``): held under the estimator where a ``DynamicQuantizeLinear`` computes it,
    else ``scale`` itself."""
    source = lw.producers.get(scale)
    if rounding_held() or source is None or source.op_type != "DynamicQuantizeLinear":
        return scale
    return held_scale(lw, scale)


def differentiable_scale(lw: Lowerer, x: str, computed: str) -> str:
    r"""``DynamicQuantizeLinear``'s scale with its derivative: the value ``computed`` by the
    kernel (bit for bit, whatever the runtime writes for a constant ``x``) plus
    ``d - sg(d)``, ``d`` = :func:`dynamic_scale`, zero in value and ``\partial d / \partial
    x`` in derivative. At ties (several elements at the maximum or minimum, or the maximum
    or minimum at 0) the derivative is the engine's subgradient of ``ReduceMax``/``Max``:
    shared equally between the tied elements, half of it at 0."""
    computed_held = held_scale(lw, computed)
    d = dynamic_scale(lw, x)
    return lw.op("Add", computed_held, lw.op("Sub", d, held_scale(lw, d)))


def dequantized_codes(lw: Lowerer, code: str, scale: str, zero: str) -> str:
    """``(code - zero) scale`` in float32 with standard operators (differentiable in
    ``scale``)."""
    unit = lw.cast(code, TensorProto.FLOAT)
    if zero:
        unit = lw.op("Sub", unit, lw.cast(zero, TensorProto.FLOAT))
    return lw.op("Mul", unit, scale)


#: ``(scale exponent k, mantissa bits p)`` of the stop-gradient per float type
_SG_BITS = {TensorProto.FLOAT: (100, 24), TensorProto.DOUBLE: (900, 53)}
_RANGES = {
    TensorProto.UINT8: (0, 255),
    TensorProto.INT8: (-128, 127),
    TensorProto.UINT16: (0, 65535),
    TensorProto.INT16: (-32768, 32767),
    TensorProto.UINT4: (0, 15),
    TensorProto.INT4: (-8, 7),
    TensorProto.UINT2: (0, 3),
    TensorProto.INT2: (-2, 1),
    # float8 codes: the largest finite magnitude (saturated beyond, where the estimator's mask
    # is zero)
    TensorProto.FLOAT8E4M3FN: (-448, 448),
    TensorProto.FLOAT8E4M3FNUZ: (-240, 240),
    TensorProto.FLOAT8E5M2: (-57344, 57344),
    TensorProto.FLOAT8E5M2FNUZ: (-57344, 57344),
}
#: the float types of a quantized activation: computed in float32 where not float64
_QUANTIZED_FLOATS = (
    TensorProto.FLOAT,
    TensorProto.DOUBLE,
    TensorProto.FLOAT16,
    TensorProto.BFLOAT16,
)


def stop_gradient(lw: Lowerer, x: str, t: int) -> str:
    """``x`` (float32 or float64) through piecewise-constant operators only."""
    k, p = _SG_BITS[t]
    scale = lw.const(2.0**k, t)
    fine = lw.op("Div", lw.op("Floor", lw.op("Mul", x, scale)), scale)
    large = lw.op("GreaterOrEqual", lw.op("Abs", x), lw.const(2.0**p, t))
    return lw.op("Where", large, lw.op("Floor", x), fine)


def _unsplit(lw: Lowerer, x: str, t: int) -> str:
    """Where :func:`stop_gradient` is not exact: infinities and nonzero ``|x| < 2^{p-k}``."""
    k, p = _SG_BITS[t]
    magnitude = lw.op("Abs", x)
    tiny = lw.op(
        "And",
        lw.op("Less", magnitude, lw.const(2.0 ** (p - k), t)),
        lw.op("Greater", magnitude, lw.const(0.0, t)),
    )
    return lw.op("Or", tiny, lw.op("IsInf", x))


def straight_through(
    lw: Lowerer, x: str, scale: str, zero: str, zero_type: int, held: str = ""
) -> str:
    """``[q_min <= round(x/s) + z <= q_max] (x - sg(x))``: zero, with the estimator's
    derivative (``held``: ``sg(x)`` already built, for a float32 or float64 ``x``)."""
    t = lw.elem(x)
    ct = TensorProto.DOUBLE if t == TensorProto.DOUBLE else TensorProto.FLOAT
    xc = x if ct == t else lw.cast(x, ct)
    s = scale if lw.elem(scale) == ct else lw.cast(scale, ct)
    code = lw.op("Round", lw.op("Div", xc, s))
    if zero:
        code = lw.op("Add", code, lw.cast(zero, ct))
    lo, hi = _RANGES[zero_type]
    inside = lw.op(
        "And",
        lw.op("GreaterOrEqual", code, lw.const(lo, ct)),
        lw.op("LessOrEqual", code, lw.const(hi, ct)),
    )
    residual = lw.op("Sub", xc, held or stop_gradient(lw, xc, ct))
    term = lw.op("Where", _unsplit(lw, xc, ct), lw.const(0.0, ct), residual)
    term = lw.op("Mul", term, lw.cast(inside, ct))
    return term if ct == t else lw.cast(term, t)


def lower_fake_quantized(lw: Lowerer) -> None:
    """A ``DequantizeLinear`` of a ``QuantizeLinear`` (per tensor, per axis or per block) of
    a float value ``x`` to integer codes becomes the same pair over ``sg(x)`` plus the
    straight-through term; any other is kept as it is. ``sg(x) = x`` wherever the term is
    exact (module docstring; elsewhere the codes agree for any scale above ``2^{-75}``), and
    the pair over it has no derivative, so normalising again adds nothing to the gradient (a
    second term over ``x`` itself doubled each pair's derivative, compounding over a deep
    model) and, recognised, no node."""
    if lower_dynamic_dequantize(lw):
        return
    node = lw.node
    source = None if rounding_held() else _static_source(lw, node)
    if source is None or _is_held(lw, source.input[0]):
        lw.builder.graph.node.append(node)
        return
    x, scale, zero = _inputs(source)
    t = lw.elem(x)
    ct = TensorProto.DOUBLE if t == TensorProto.DOUBLE else TensorProto.FLOAT
    held = stop_gradient(lw, x if ct == t else lw.cast(x, ct), ct)
    attrs = {a.name: helper.get_attribute_value(a) for a in source.attribute}
    code = lw.op(
        "QuantizeLinear", held if ct == t else lw.cast(held, t), *source.input[1:], **attrs
    )
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    value = lw.op("DequantizeLinear", code, *node.input[1:], **attrs)
    if not _one_element(lw, scale):
        scale, zero = _broadcast_parameters(lw, source, x)
    term = _like(
        lw, straight_through(lw, x, scale, zero, _code_type(lw, source), held=held), x, value
    )
    lw.superseded.add(id(source))
    if node.input[0] == source.output[0]:
        lw.op("Add", value, term, out=node.output[0])
        return

    def constant_codes(constant: str) -> str:
        constant = constant or lw.const(0, _code_type(lw, source))
        return lw.op("DequantizeLinear", constant, *node.input[1:], **attrs)

    moved = lw.op("Add", value, term)
    replayed(lw, node.input[0], source.output[0], moved, constant_codes, out=node.output[0])


def _static_source(lw: Lowerer, dequantize: NodeProto) -> NodeProto | None:
    """The float ``QuantizeLinear`` whose codes ``dequantize`` reads, directly or moved by
    layout operators (then with per-tensor scales and zero points only: a move commutes with
    those), else ``None``."""
    source = moved_codes_source(lw, dequantize.input[0], lambda n: _is_float_quantize(lw, n))
    if source is None or dequantize.input[0] == source.output[0]:
        return source
    parameters = [*_inputs(source)[1:], *_inputs(dequantize)[1:]]
    return source if all(_one_element(lw, name) for name in parameters if name) else None


def _broadcast_parameters(lw: Lowerer, quantize: NodeProto, x: str) -> tuple[str, str]:
    """The scale and zero point of a per-axis or blocked ``quantize`` spread over ``x``'s
    shape (``DequantizeLinear`` of unit codes broadcasts them as the operator does), the zero
    point as floats (``''`` where absent)."""
    _, scale, zero = _inputs(quantize)
    ones = lw.op(
        "ConstantOfShape",
        lw.op("Shape", x),
        value=helper.make_tensor("one", TensorProto.UINT8, [1], [1]),
    )
    layout = {a.name: helper.get_attribute_value(a) for a in quantize.attribute}
    layout = {k: v for k, v in layout.items() if k in ("axis", "block_size")}
    spread = [lw.op("DequantizeLinear", ones, scale, **layout)]
    lw.types[spread[0]] = helper.make_tensor_type_proto(lw.elem(scale), None)
    if zero:
        unit_zero = lw.op("DequantizeLinear", ones, lw.cast(zero, TensorProto.FLOAT), **layout)
        lw.types[unit_zero] = helper.make_tensor_type_proto(TensorProto.FLOAT, None)
        spread.append(unit_zero)
    return spread[0], spread[1] if zero else ""


def _like(lw: Lowerer, term: str, x: str, value: str) -> str:
    """``term`` (typed as ``x``) cast to the element type of ``value`` where that differs."""
    wanted = lw.types.get(value)
    if wanted is None or wanted.tensor_type.elem_type == lw.elem(x):
        return term
    return lw.cast(term, wanted.tensor_type.elem_type)


def _is_held(lw: Lowerer, name: str) -> bool:
    """Whether ``name`` is a :func:`stop_gradient` output (``Where(|x| >= 2^p, Floor(x),
    Floor(x 2^k) / 2^k)``): the pair over it was lowered already."""
    where = lw.producers.get(name)
    if where is not None and where.op_type == "Cast":  # a float16 or bfloat16 x
        where = lw.producers.get(where.input[0])
    if where is None or where.op_type != "Where" or len(where.input) != 3:
        return False
    floor, fine = (lw.producers.get(where.input[i]) for i in (1, 2))
    return (
        floor is not None
        and floor.op_type == "Floor"
        and fine is not None
        and fine.op_type == "Div"
        and getattr(lw.producers.get(fine.input[0]), "op_type", None) == "Floor"
    )


def _inputs(node: NodeProto) -> tuple[str, str, str]:
    """``(x, scale, zero point)`` of a ``QuantizeLinear`` or ``DequantizeLinear``."""
    return tuple(node.input[i] if i < len(node.input) else "" for i in range(3))


def _one_element(lw: Lowerer, name: str) -> bool:
    dims = lw.dims(name)
    return dims is not None and int(np.prod(dims or [1])) == 1


def _is_float_quantize(lw: Lowerer, source: NodeProto | None) -> bool:
    """Whether ``source`` is a default-domain ``QuantizeLinear`` of a float ``x`` to integer
    codes."""
    if source is None or source.op_type != "QuantizeLinear" or source.domain not in ("", "ai.onnx"):
        return False
    x, scale, _ = _inputs(source)
    if x not in lw.types or lw.elem(x) not in _QUANTIZED_FLOATS or scale not in lw.types:
        return False
    return _code_type(lw, source) in _RANGES


def _code_type(lw: Lowerer, quantize: NodeProto) -> int:
    """The element type of ``quantize``'s codes: its zero point's, else ``output_dtype``'s,
    else uint8."""
    zero = _inputs(quantize)[2]
    if zero:
        return lw.elem(zero)
    declared = next((a.i for a in quantize.attribute if a.name == "output_dtype"), 0)
    return declared or TensorProto.UINT8


#: doc_string of the ``DynamicQuantizeLinear`` :func:`lower_dynamic_quantize` emits, which
#: normalising again keeps as it is (its raw scale output is only read held; the text, kept
#: from when the scale output itself was held, marks files normalised before)
HELD_SCALE = "onnxgrad: scale held constant to the gradient"


def lower_dynamic_quantize(lw: Lowerer) -> None:
    """``DynamicQuantizeLinear`` whose scale output has its derivative
    (:func:`differentiable_scale`) in both modes: a consumer reading it as a float (an
    output, any float operator) differentiates it. The consumers that rescale the integer
    codes (a ``DequantizeLinear`` of the codes, the ``Mul`` after a ``Cast`` of their
    ``MatMulInteger``/``ConvInteger`` product) hold it themselves under the estimator
    (:func:`lower_dynamic_dequantize`, :func:`lower_integer_rescale`), so that the derivative
    of the whole quantized product is the float product's. The node emitted is marked
    :data:`HELD_SCALE`, so a second normalisation adds nothing."""
    node = lw.node
    if node.doc_string == HELD_SCALE:
        lw.builder.graph.node.append(node)
        return
    code, scale, zero = lw.ops("DynamicQuantizeLinear", [node.input[0]], 3)
    lw.builder.graph.node[-1].doc_string = HELD_SCALE
    lw.op("Identity", code, out=node.output[0])
    if len(node.output) > 1 and node.output[1]:
        lw.op("Identity", differentiable_scale(lw, node.input[0], scale), out=node.output[1])
    if len(node.output) > 2 and node.output[2]:
        lw.op("Identity", zero, out=node.output[2])


def _dynamic_source(lw: Lowerer, code: str, scale: str, zero: str) -> NodeProto | None:
    """The ``DynamicQuantizeLinear`` whose codes reach ``code`` (directly or moved by layout
    operators: :mod:`onnxgrad.normalize.code_moves`) and whose scale and zero point are
    ``scale``, ``zero`` (a dequantization of its own codes by its own parameters), else
    ``None``."""
    source = moved_codes_source(lw, code, _is_dynamic_quantize)
    if source is None:
        return None
    return source if list(source.output[1:3]) == [scale, zero] else None


def _is_dynamic_quantize(node: NodeProto) -> bool:
    return (
        node.op_type == "DynamicQuantizeLinear"
        and not normalize_domain(node.domain)
        and len(node.output) >= 3
    )


def lower_dynamic_dequantize(lw: Lowerer) -> bool:
    r"""``DequantizeLinear(DynamicQuantizeLinear(x))`` read straight through: the pair over
    the held scale (no derivative) plus the estimator's term, derivative the in-range mask,
    the codes' moves (if any) replayed on that float; ``False`` (nothing emitted) for any
    other ``DequantizeLinear`` and where rounding is held (``(q - z) s``, derivative
    ``(q - z)\, \partial s / \partial x``)."""
    node = lw.node
    source = _dynamic_source(lw, *_inputs(node))
    if source is None or rounding_held():
        return False
    moved, scale, zero = node.input
    code = source.output[0]
    held = held_scale(lw, scale)
    value = lw.op("DequantizeLinear", code, held, zero)
    term = straight_through(lw, source.input[0], held, zero, TensorProto.UINT8)
    if moved == code:
        lw.op("Add", value, term, out=node.output[0])
        return True

    def constant_codes(constant: str) -> str:
        return lw.op("DequantizeLinear", constant or lw.const(0, TensorProto.UINT8), held, zero)

    replayed(lw, moved, code, lw.op("Add", value, term), constant_codes, out=node.output[0])
    return True


def lower_integer_product_cast(lw: Lowerer) -> None:
    """``Cast(MatMulInteger/ConvInteger(DynamicQuantizeLinear(x), ...))`` as the float
    product with the straight-through estimator; any other ``Cast`` is kept."""
    node = lw.node
    product, bias = _product_and_bias(lw, node.input[0])
    dynamic = _dynamic_quantization(lw, product)
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    if dynamic is None or to not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        lw.builder.graph.node.append(node)
        return
    ct = TensorProto.FLOAT
    x, (code, scale, zero) = dynamic.input[0], dynamic.output[:3]
    float_zero = lw.cast(zero, ct)
    unit = lw.op("Sub", lw.cast(code, ct), float_zero)
    if not rounding_held():
        held = held_scale(lw, scale)
        term = straight_through(lw, x, held, zero, TensorProto.UINT8)
        unit = lw.op("Add", unit, lw.op("Div", term, held))
    if product.input[0] != code:

        def constant_codes(constant: str) -> str:
            if not constant:
                return lw.op("Neg", float_zero)
            return lw.op("Sub", lw.cast(constant, ct), float_zero)

        unit = replayed(lw, product.input[0], code, unit, constant_codes)
    weight = lw.cast(product.input[1], ct)
    if len(product.input) > 3 and product.input[3]:
        weight = lw.op("Sub", weight, _weight_zero(lw, product))
    attrs = {a.name: helper.get_attribute_value(a) for a in product.attribute}
    op = "MatMul" if product.op_type == "MatMulInteger" else "Conv"
    result = lw.op(op, unit, weight, **attrs)
    if bias is not None:
        term_index = list(bias.input).index(product.output[0])
        result = lw.op("Add", result, lw.cast(bias.input[1 - term_index], ct))
        lw.superseded.add(id(bias))
    lw.cast(result, to, out=node.output[0])
    lw.superseded.add(id(product))


def _product_and_bias(lw: Lowerer, name: str) -> tuple[NodeProto | None, NodeProto | None]:
    """The node computing ``name`` and, where ``name = Add(product, b)`` with an integer
    ``b`` (the int32 bias older ``quantize_dynamic`` adds before the ``Cast``), that
    ``Add``; ``(node, None)`` otherwise."""
    node = lw.producers.get(name)
    if node is None or node.op_type != "Add" or normalize_domain(node.domain):
        return node, None
    if lw.uses.get(name, 0) != 1 or len(node.input) != 2:
        return node, None
    for i, term in enumerate(node.input):
        product = lw.producers.get(term)
        other = node.input[1 - i]
        if (
            product is not None
            and product.op_type in ("MatMulInteger", "ConvInteger")
            and other != term
            and other in lw.types
            and lw.elem(other) == TensorProto.INT32
        ):
            return product, node
    return node, None


def _weight_zero(lw: Lowerer, product: NodeProto) -> str:
    """The weight's zero point as floats broadcasting over it: per output column of a
    MatMul weight, per output channel ``(M, 1, ..., 1)`` of a convolution kernel."""
    zero = lw.cast(product.input[3], TensorProto.FLOAT)
    if product.op_type == "MatMulInteger":
        return zero
    rank = lw.rank(product.input[1])
    dims = lw.dims(product.input[3]) or []
    if len(dims) == 1 and dims[0] != 1:
        return lw.unsqueeze(zero, list(range(1, rank)))
    return zero


def _dynamic_quantization(lw: Lowerer, product: NodeProto | None) -> NodeProto | None:
    if product is None or product.op_type not in ("MatMulInteger", "ConvInteger"):
        return None
    if product.domain not in ("", "ai.onnx"):
        return None
    source = moved_codes_source(lw, product.input[0], _is_dynamic_quantize)
    if source is None:
        return None
    if len(product.input) < 3 or product.input[2] != source.output[2]:
        return None
    if lw.uses.get(product.output[0], 0) != 1:
        return None
    return source


def lower_integer_rescale(lw: Lowerer) -> None:
    """Under the estimator, ``Mul(Cast(P), s_x)`` or ``Mul(Cast(P), Mul(s_x, s_B))`` (either
    order), ``P`` a ``MatMulInteger``/``ConvInteger`` product (or that plus an int32 bias) of
    the codes of ``DynamicQuantizeLinear(x)`` and ``s_x`` its scale, reads ``s_x`` held: the
    product's derivative is the float product's (:func:`lower_integer_product_cast`), and
    the int32 bias, quantized by ``s_x s_B``, stands for a float bias that does not move
    with ``x``. The pair ``Mul(s_x, s_B)`` itself holds ``s_x`` where only such rescales
    read it; any other ``Mul`` is kept."""
    node = lw.node
    if not rounding_held():
        if _is_rescale_pair(lw, node):
            scale = next(name for name in node.input if _dynamic_scale_of(lw, name))
            other = node.input[1 - list(node.input).index(scale)]
            lw.op("Mul", held_scale(lw, scale), other, out=node.output[0])
            return
        found = _rescale(lw, node)
        if found is not None and not _held_by_its_pair(lw, node, found[0]):
            product, scale, other = found
            factor = held_scale(lw, scale)
            if other:
                factor = lw.op("Mul", factor, other)
            lw.op("Mul", product, factor, out=node.output[0])
            return
    lw.builder.graph.node.append(node)


def _held_by_its_pair(lw: Lowerer, node: NodeProto, product: str) -> bool:
    """Whether ``node``'s other factor is a pair that holds the scale itself."""
    pair = lw.producers.get(node.input[1 - list(node.input).index(product)])
    return pair is not None and _is_rescale_pair(lw, pair)


def _dynamic_scale_of(lw: Lowerer, name: str) -> bool:
    source = lw.producers.get(name)
    return (
        source is not None
        and source.op_type == "DynamicQuantizeLinear"
        and (len(source.output) > 1 and source.output[1] == name)
    )


def _scale_pair(lw: Lowerer, name: str) -> tuple[str, str] | None:
    """``(s_x, s_B)`` where ``name = Mul(s_x, s_B)`` (either order), ``s_x`` a
    ``DynamicQuantizeLinear``'s scale, else ``None``."""
    pair = lw.producers.get(name)
    if pair is None or pair.op_type != "Mul" or normalize_domain(pair.domain):
        return None
    if len(pair.input) != 2 or pair.input[0] == pair.input[1]:
        return None
    for i in (0, 1):
        if _dynamic_scale_of(lw, pair.input[i]):
            return pair.input[i], pair.input[1 - i]
    return None


def _is_rescale_pair(lw: Lowerer, node: NodeProto) -> bool:
    """Whether ``node`` is a pair ``Mul(s_x, s_B)`` that only rescales read (as
    ``quantize_dynamic`` writes them)."""
    if not node.output or _scale_pair(lw, node.output[0]) is None:
        return False
    name = node.output[0]
    readers = lw.readers(name)
    reads = sum(list(reader.input).count(name) for reader in readers)
    return bool(readers) and reads == lw.uses[name] and all(_rescale(lw, r) for r in readers)


def _rescale(lw: Lowerer, node: NodeProto) -> tuple[str, str, str] | None:
    """``(Cast(P), s_x, s_B)`` (``s_B`` ``''`` when ``s_x`` multiplies alone) where ``node``
    rescales an integer product as :func:`lower_integer_rescale` says."""
    if node.op_type != "Mul" or len(node.input) != 2 or normalize_domain(node.domain):
        return None
    for i in (0, 1):
        source = _dynamic_quantization(lw, _product_and_bias(lw, _cast_of(lw, node.input[i]))[0])
        if source is None:
            continue
        scale, factor = source.output[1], node.input[1 - i]
        if factor == scale:
            return node.input[i], scale, ""
        pair = _scale_pair(lw, factor)
        if pair is not None and pair[0] == scale:
            return node.input[i], scale, pair[1]
    return None


def _cast_of(lw: Lowerer, name: str) -> str:
    """What the ``Cast`` to a float type computing ``name`` converts, else ``''``."""
    cast = lw.producers.get(name)
    if cast is None or cast.op_type != "Cast" or normalize_domain(cast.domain):
        return ""
    to = next((a.i for a in cast.attribute if a.name == "to"), None)
    return cast.input[0] if to in (TensorProto.FLOAT, TensorProto.DOUBLE) else ""
