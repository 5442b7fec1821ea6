r"""A weight dequantized with plain operators: ``W = (Cast(q) - z) s`` or ``(Cast(q) - z) / d``.

Some exports keep a kernel as integer codes ``q`` (an initializer ``K x N`` or ``N x K`` of
4-, 8- or 16-bit integers) and dequantize it with default-domain arithmetic instead of
``DequantizeLinear``:

    Mul(Cast(q), s),   Mul(Sub(Cast(q), z), s)        (either operand order of the Mul)
    Div(Cast(q), d),   Div(Sub(Cast(q), z), d)        (``s = 1 / d``)

``s`` (``d``) a float initializer, ``z`` a float initializer of whole numbers or an integer
one cast to the float type (``Sub(Cast(q), Cast(z))``), each one value for the whole tensor
or one per index of one axis of ``q`` (a ``[1, N]``, ``[N]`` or ``[K, 1]`` that broadcasts
along it), ``z`` in the codes' range. That is ``DequantizeLinear(q, s, z)`` per tensor or
per axis, so such a weight is read (:mod:`onnxgrad.graph.deployed_products`), adapted and
re-quantized (:mod:`onnxgrad.graph.requantize`: ``d`` written again as a divisor) as a QDQ
weight is; only initializers change, so the file keeps its operators.

Per block (group quantization written with plain operators): the cast codes ``Reshape``d so
that one axis of ``q`` splits into ``blocks x b`` (``[K/b, b, N]`` or ``[N, K/b, b]``), less
``z`` and times (or divided by) ``s`` of that 3-D shape with 1 on the ``b`` axis (one value
per block, per block and index of the other axis), then ``Reshape``d back to ``q``'s shape:

    Reshape(Mul(Sub(Reshape(Cast(q), blocks), z), s), shape(q))

Anything else (a scale per element, a zero point computed at run time) is no such weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
from onnx import NodeProto, TensorProto, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES, normalize_domain, np_dtype

#: the codes' types (``ml_dtypes.iinfo`` gives their range)
CODE_TYPES = frozenset(
    {
        TensorProto.INT4,
        TensorProto.UINT4,
        TensorProto.INT8,
        TensorProto.UINT8,
        TensorProto.INT16,
        TensorProto.UINT16,
    }
)
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
    ``Sub`` where there are, and the ``Mul`` or ``Div`` (its output the dequantized weight).
    Per block, ``blocks`` is the 3-D shape the codes are reshaped to (``axis`` the one split),
    ``nodes`` hold the two ``Reshape`` nodes too (the last one's output the weight)."""

    codes: str
    scale: str
    zero: str
    axis: int | None
    nodes: tuple[str, ...]
    divides: bool = False
    blocks: tuple[int, int, int] | None = None

    @property
    def cast(self) -> str:
        return self.nodes[0]


def plain_dequantization(node: NodeProto, producers, inits) -> PlainDequantization | None:
    """The dequantization ``node`` (a ``Mul`` or ``Div``; per block the ``Reshape`` back)
    ends (module docstring), else ``None``."""
    if _plain(node, "Reshape"):
        return _blocked(node, producers, inits)
    return _scaled(node, producers, inits, None)


def _scaled(node: NodeProto | None, producers, inits, blocks) -> PlainDequantization | None:
    """The ``Mul`` or ``Div`` ``node`` of a dequantization of the 2-D codes (``blocks``
    ``None``) or of the codes reshaped to ``blocks`` (``(shape, axis split)``), else
    ``None``."""
    divides = _plain(node, "Div")
    if not (divides or _plain(node, "Mul")) or len(node.input) != 2:
        return None
    for index in (0,) if divides else (0, 1):
        chain = _codes_chain(node.input[index], producers, inits, blocks)
        scale = node.input[1 - index]
        if chain is None or scale not in inits or inits[scale].data_type not in FLOAT_TYPES:
            continue
        cast, reshape, zero_cast, sub = chain
        codes = inits[cast.input[0]]
        axis = _group_axis(inits[scale], codes) if blocks is None else blocks[1]
        if blocks is not None and not _per_block(inits[scale], *blocks):
            continue
        zero = "" if sub is None else zero_cast.input[0] if zero_cast else sub.input[1]
        if axis == _OTHER or (zero and not _zero_fits(inits.get(zero), codes, zero_cast)):
            continue
        if zero and not _zero_layout(inits[zero], inits[scale], codes, axis, blocks):
            continue
        if divides and not np.all(numpy_helper.to_array(inits[scale]) != 0):
            continue
        nodes = tuple(n.name for n in (cast, reshape, zero_cast, sub, node) if n is not None)
        shape = None if blocks is None else tuple(blocks[0])
        return PlainDequantization(codes.name, scale, zero, axis, nodes, divides, shape)
    return None


def _blocked(back: NodeProto, producers, inits) -> PlainDequantization | None:
    """The per-block dequantization the ``Reshape`` ``back`` (to the codes' shape) ends."""
    scaled = producers.get(back.input[0])
    for value in scaled.input if _plain(scaled, "Mul") or _plain(scaled, "Div") else ():
        reshape = _reshape_of_codes(value, producers)
        blocks = _blocks(reshape, producers, inits) if reshape is not None else None
        codes = inits.get(producers[reshape.input[0]].input[0]) if blocks else None
        if codes is None or _constant(back.input[1], producers, inits) != list(codes.dims):
            continue
        found = _scaled(scaled, producers, inits, blocks)
        if found is not None:
            return replace(found, nodes=(*found.nodes, back.name))
    return None


def _reshape_of_codes(value: str, producers) -> NodeProto | None:
    """The ``Reshape`` behind ``value`` (through a ``Sub`` of a zero point)."""
    node = producers.get(value)
    if _plain(node, "Sub"):
        node = producers.get(node.input[0])
    return node if _plain(node, "Reshape") and node.input[0] in producers else None


def _constant(name: str, producers, inits) -> list[int] | None:
    """The values of a 1-D int64 constant (an initializer or a ``Constant`` node)."""
    node = producers.get(name)
    tensor = inits.get(name) if node is None else None
    if _plain(node, "Constant"):
        tensor = next((a.t for a in node.attribute if a.name == "value"), None)
    if tensor is None or tensor.data_type != TensorProto.INT64 or len(tensor.dims) != 1:
        return None
    return [int(v) for v in numpy_helper.to_array(tensor)]


def _blocks(reshape: NodeProto, producers, inits) -> tuple[list[int], int] | None:
    """``(shape, axis)`` where ``reshape`` gives the 2-D codes ``q`` (``R x C``, cast) the
    3-D ``shape`` that splits ``axis`` of theirs into ``blocks x b``, ``b > 1``
    (``[R/b, b, C]``: 0, ``[R, C/b, b]``: 1), else ``None``."""
    shape = _constant(reshape.input[1], producers, inits)
    cast = producers.get(reshape.input[0])
    codes = inits.get(cast.input[0]) if _plain(cast, "Cast") else None
    if shape is None or codes is None or len(shape) != 3 or len(codes.dims) != 2:
        return None
    rows, cols = codes.dims
    if shape[0] * shape[1] == rows and shape[2] == cols and shape[1] > 1:
        return shape, 0
    if shape[0] == rows and shape[1] * shape[2] == cols and shape[2] > 1:
        return shape, 1
    return None


def _per_block(parameter: TensorProto, shape: list[int], axis: int) -> bool:
    """Whether ``parameter`` holds one value per block of codes reshaped to ``shape``
    (splitting their ``axis``) and per index of the other axis, or one for all of it."""
    dims = list(parameter.dims)
    within, across, other = (1, 0, 2) if axis == 0 else (2, 1, 0)
    return (
        len(dims) == 3
        and dims[within] == 1
        and dims[across] == shape[across]
        and dims[other] in (1, shape[other])
    )


def _plain(node: NodeProto | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and not normalize_domain(node.domain)


def _cast_to_float(node: NodeProto | None, inits) -> TensorProto | None:
    """The initializer ``node`` casts to a float type, else ``None``."""
    if not _plain(node, "Cast"):
        return None
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    return inits.get(node.input[0]) if to in FLOAT_TYPES else None


def _codes_chain(value: str, producers, inits, blocks=None):
    """``(Cast, Reshape or None, Cast of the zero point or None, Sub or None)`` where
    ``value`` is ``Cast(q)``, ``Cast(q) - z`` or ``Cast(q) - Cast(z)`` of 2-D integer codes
    ``q`` cast to a float type (``Reshape(Cast(q))`` in place of ``Cast(q)`` where
    ``blocks``), else ``None``."""
    node = producers.get(value)
    sub = zero_cast = reshape = None
    if _plain(node, "Sub") and len(node.input) == 2:
        sub, node = node, producers.get(node.input[0])
        zero_cast = producers.get(sub.input[1])
        if zero_cast is not None and _cast_to_float(zero_cast, inits) is None:
            return None
    if blocks is not None:
        if not _plain(node, "Reshape"):
            return None
        reshape, node = node, producers.get(node.input[0])
    codes = _cast_to_float(node, inits)
    if codes is None or codes.data_type not in CODE_TYPES or len(codes.dims) != 2:
        return None
    return node, reshape, zero_cast, sub


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


def code_range(dtype) -> tuple[int, int]:
    """``(lowest, highest)`` of an integer numpy dtype, ``ml_dtypes``' 4-bit ones too."""
    info = ml_dtypes.iinfo(dtype)
    return int(info.min), int(info.max)


def _zero_layout(zero: TensorProto, scale: TensorProto, codes, axis, blocks) -> bool:
    """Whether ``zero`` is one value, or one per group of the scale's layout."""
    if int(np.prod(zero.dims, dtype=np.int64)) == 1:
        return True
    if blocks is not None:
        return list(zero.dims) == list(scale.dims)
    layout = _group_axis(zero, codes)
    return layout != _OTHER and layout == axis


def _zero_fits(zero: TensorProto | None, codes: TensorProto, cast: NodeProto | None) -> bool:
    """A zero point a ``DequantizeLinear`` could hold: whole values in the codes' range; a
    float initializer, or (``cast``) an integer one whose type holds the codes' range (new
    zero points are written in it)."""
    types = ZERO_TYPES if cast is not None else FLOAT_TYPES
    if zero is None or zero.data_type not in types:
        return False
    low, high = code_range(np_dtype(codes.data_type))
    if cast is not None:
        held = code_range(np_dtype(zero.data_type))
        if held[0] > low or held[1] < high:
            return False
    values = numpy_helper.to_array(zero).astype(np.float64)
    whole = np.all(values == np.round(values))
    return bool(whole and np.all((low <= values) & (values <= high)))


__all__ = ["CODE_TYPES", "PlainDequantization", "code_range", "plain_dequantization"]
