r"""A weight dequantized with plain operators: ``W = (Cast(q) - z) s``.

Some exports keep a kernel as integer codes ``q`` (an initializer ``K x N`` or ``N x K``) and
dequantize it with default-domain arithmetic instead of ``DequantizeLinear``:

    Mul(Cast(q), s),   Mul(Sub(Cast(q), z), s)        (either operand order of the Mul)

``s`` (and ``z``) float initializers, one value for the whole tensor or one per index of one
axis of ``q`` (a ``[1, N]``, ``[N]`` or ``[K, 1]`` that broadcasts along it), ``z`` whole
numbers in the codes' range. That is ``DequantizeLinear(q, s, z)`` per tensor or per axis,
so such a weight is read (:mod:`onnxgrad.graph.deployed_products`), adapted and re-quantized
(:mod:`onnxgrad.graph.requantize`) as a QDQ weight is; only initializers change, so the file
keeps its operators. Anything else (a scale per element, a ``Div``, a zero point computed at
run time) is no such weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, TensorProto, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES, normalize_domain, np_dtype

#: the codes' types (numpy gives their range; 4-bit codes are not read here)
CODE_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16})


@dataclass(frozen=True)
class PlainDequantization:
    """``(Cast(codes) - zero) scale`` (``zero`` ``''``: none), grouped per tensor
    (``axis`` ``None``) or per index of ``axis`` of the codes; ``nodes`` are the ``Cast``,
    the ``Sub`` where there is one, and the ``Mul`` (its output the dequantized weight)."""

    codes: str
    scale: str
    zero: str
    axis: int | None
    nodes: tuple[str, ...]

    @property
    def cast(self) -> str:
        return self.nodes[0]


def plain_dequantization(mul: NodeProto, producers, inits) -> PlainDequantization | None:
    """The dequantization ``mul`` ends (module docstring), else ``None``."""
    if not _plain(mul, "Mul") or len(mul.input) != 2:
        return None
    for index in (0, 1):
        chain = _codes_chain(mul.input[index], producers, inits)
        scale = mul.input[1 - index]
        if chain is None or scale not in inits:
            continue
        cast, sub = chain
        codes = inits[cast.input[0]]
        axis = _group_axis(inits[scale], codes)
        zero = sub.input[1] if sub is not None else ""
        if axis == _OTHER or inits[scale].data_type not in FLOAT_TYPES:
            continue
        if zero and not _zero_fits(inits.get(zero), codes, axis):
            continue
        nodes = tuple(n.name for n in (cast, sub, mul) if n is not None)
        return PlainDequantization(codes.name, scale, zero, axis, nodes)
    return None


def _plain(node: NodeProto | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and not normalize_domain(node.domain)


def _codes_chain(value: str, producers, inits):
    """``(Cast, Sub or None)`` where ``value`` is ``Cast(q)`` or ``Cast(q) - z`` of 2-D
    integer codes ``q`` cast to a float type, else ``None``."""
    node = producers.get(value)
    sub = None
    if _plain(node, "Sub") and len(node.input) == 2:
        sub, node = node, producers.get(node.input[0])
    if not _plain(node, "Cast"):
        return None
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    codes = inits.get(node.input[0])
    if to not in FLOAT_TYPES or codes is None:
        return None
    if codes.data_type not in CODE_TYPES or len(codes.dims) != 2:
        return None
    return node, sub


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


def _zero_fits(zero: TensorProto | None, codes: TensorProto, axis: int | None) -> bool:
    """A zero point a ``DequantizeLinear`` could hold: a float initializer of whole values
    in the codes' range, one for all or one per index of the scale's ``axis``."""
    if zero is None or zero.data_type not in FLOAT_TYPES:
        return False
    layout = _group_axis(zero, codes)
    if layout == _OTHER or (layout is not None and layout != axis):
        return False
    values = numpy_helper.to_array(zero).astype(np.float64)
    info = np.iinfo(np_dtype(codes.data_type))
    whole = np.all(values == np.round(values))
    return bool(whole and np.all((info.min <= values) & (values <= info.max)))


__all__ = ["CODE_TYPES", "PlainDequantization", "plain_dequantization"]
