r"""A weight dequantized with plain operators: ``W = (Cast(q) - z) s`` or ``(Cast(q) - z) / d``.

Some exports keep a kernel as integer codes ``q`` (an initializer ``K x N`` or ``N x K``) and
dequantize it with default-domain arithmetic instead of ``DequantizeLinear``:

    Mul(Cast(q), s),   Mul(Sub(Cast(q), z), s)        (either operand order of the Mul)
    Div(Cast(q), d),   Div(Sub(Cast(q), z), d)        (``s = 1 / d``)

``s`` (``d``) a float initializer, ``z`` a float initializer of whole numbers or an integer
one cast to the float type (``Sub(Cast(q), Cast(z))``), each one value for the whole tensor
or one per index of one axis of ``q`` (a ``[1, N]``, ``[N]`` or ``[K, 1]`` that broadcasts
along it), ``z`` in the codes' range. That is ``DequantizeLinear(q, s, z)`` per tensor or
per axis, so such a weight is read (:mod:`onnxgrad.graph.deployed_products`), adapted and
re-quantized (:mod:`onnxgrad.graph.requantize`: ``d`` written again as a divisor) as a QDQ
weight is; only initializers change, so the file keeps its operators. Anything else (a
scale per element, a zero point computed at run time) is no such weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, TensorProto, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES, normalize_domain, np_dtype

#: the codes' types (numpy gives their range; 4-bit codes are not read here)
CODE_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16})
#: the types an integer zero point (cast to float) may have
ZERO_TYPES = CODE_TYPES | {
    TensorProto.INT32,
    TensorProto.UINT32,
    TensorProto.INT64,
    TensorProto.UINT64,
}


@dataclass(frozen=True)
class PlainDequantization:
    """``(Cast(codes) - zero) scale``, or ``/ scale`` where ``divides`` (``zero`` ``''``:
    none), grouped per tensor (``axis`` ``None``) or per index of ``axis`` of the codes;
    ``nodes`` are the ``Cast`` of the codes, the ``Cast`` of an integer zero point and the
    ``Sub`` where there are, and the ``Mul`` or ``Div`` (its output the dequantized weight)."""

    codes: str
    scale: str
    zero: str
    axis: int | None
    nodes: tuple[str, ...]
    divides: bool = False

    @property
    def cast(self) -> str:
        return self.nodes[0]


def plain_dequantization(node: NodeProto, producers, inits) -> PlainDequantization | None:
    """The dequantization ``node`` (a ``Mul`` or ``Div``) ends (module docstring), else
    ``None``."""
    divides = _plain(node, "Div")
    if not (divides or _plain(node, "Mul")) or len(node.input) != 2:
        return None
    for index in (0,) if divides else (0, 1):
        chain = _codes_chain(node.input[index], producers, inits)
        scale = node.input[1 - index]
        if chain is None or scale not in inits:
            continue
        cast, zero_cast, sub = chain
        codes = inits[cast.input[0]]
        axis = _group_axis(inits[scale], codes)
        if axis == _OTHER or inits[scale].data_type not in FLOAT_TYPES:
            continue
        zero = "" if sub is None else zero_cast.input[0] if zero_cast else sub.input[1]
        if zero and not _zero_fits(inits.get(zero), codes, axis, cast=zero_cast is not None):
            continue
        if divides and not np.all(numpy_helper.to_array(inits[scale]) != 0):
            continue
        nodes = tuple(n.name for n in (cast, zero_cast, sub, node) if n is not None)
        return PlainDequantization(codes.name, scale, zero, axis, nodes, divides)
    return None


def _plain(node: NodeProto | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and not normalize_domain(node.domain)


def _cast_to_float(node: NodeProto | None, inits) -> TensorProto | None:
    """The initializer ``node`` casts to a float type, else ``None``."""
    if not _plain(node, "Cast"):
        return None
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    return inits.get(node.input[0]) if to in FLOAT_TYPES else None


def _codes_chain(value: str, producers, inits):
    """``(Cast, Cast of the zero point or None, Sub or None)`` where ``value`` is ``Cast(q)``,
    ``Cast(q) - z`` or ``Cast(q) - Cast(z)`` of 2-D integer codes ``q`` cast to a float
    type, else ``None``."""
    node = producers.get(value)
    sub = zero_cast = None
    if _plain(node, "Sub") and len(node.input) == 2:
        sub, node = node, producers.get(node.input[0])
        zero_cast = producers.get(sub.input[1])
        if zero_cast is not None and _cast_to_float(zero_cast, inits) is None:
            return None
    codes = _cast_to_float(node, inits)
    if codes is None or codes.data_type not in CODE_TYPES or len(codes.dims) != 2:
        return None
    return node, zero_cast, sub


#: :func:`_group_axis` of a parameter that is neither one value nor one per index of an axis
_OTHER = -1


def _group_axis(parameter: TensorProto, codes: TensorProto) -> int | None:
    """The axis of ``codes`` that ``parameter`` (broadcast against them) has one value per
    index of; ``None`` for one value in all; :data:`_OTHER` for another layout."""
    dims = list(parameter.dims)
    if len(dims) > 2:
        return _OTHER
    if int(np.prod(dims, dtype=np.int64)) == 1:
        return None
    aligned = [1] * (2 - len(dims)) + dims  # numpy's broadcasting: aligned on the right
    spread = [i for i, d in enumerate(aligned) if d != 1]
    if len(spread) == 1 and aligned[spread[0]] == codes.dims[spread[0]]:
        return spread[0]
    return _OTHER


def _zero_fits(zero: TensorProto | None, codes: TensorProto, axis: int | None, cast: bool) -> bool:
    """A zero point a ``DequantizeLinear`` could hold: whole values in the codes' range, one
    for all or one per index of the scale's ``axis``; a float initializer, or (``cast``) an
    integer one whose type holds the codes' range (new zero points are written in it)."""
    types = ZERO_TYPES if cast else FLOAT_TYPES
    if zero is None or zero.data_type not in types:
        return False
    layout = _group_axis(zero, codes)
    if layout == _OTHER or (layout is not None and layout != axis):
        return False
    info = np.iinfo(np_dtype(codes.data_type))
    if cast:
        held = np.iinfo(np_dtype(zero.data_type))
        if held.min > info.min or held.max < info.max:
            return False
    values = numpy_helper.to_array(zero).astype(np.float64)
    whole = np.all(values == np.round(values))
    return bool(whole and np.all((info.min <= values) & (values <= info.max)))


__all__ = ["CODE_TYPES", "PlainDequantization", "plain_dequantization"]
