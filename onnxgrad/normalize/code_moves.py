r"""Integer codes moved between their quantization and the node that reads them.

A quantizer (``DynamicQuantizeLinear``, ``QuantizeLinear``) writes codes ``q``; before the
integer product or the dequantization that rescales them, a file may move them with layout
operators that neither compute nor mix values: Segformer's reduced keys,
``ConvInteger(Reshape(Transpose(q)))`` as onnxruntime's ``quantize_dynamic`` writes it. With
one (per-tensor) scale ``s`` and zero point ``z``, such a move ``M`` commutes with the
dequantization:

    (M(q) - z)\, s = M((q - z)\, s)

except for constant codes ``c`` joined to them (a ``Pad``'s constant value, ``0`` when
absent, a constant input of a ``Concat``), which become ``(c - z) s``. So the rewrites that
read codes straight through (:mod:`onnxgrad.normalize.ste`) build the float value at the
quantizer and replay the moves on it (:func:`replayed`): same values, and the derivative of
each move, which the engine has.
"""

from __future__ import annotations

from collections.abc import Callable

from onnx import NodeProto, helper

from onnxgrad._onnx_utils import normalize_domain
from onnxgrad.normalize.lowering import Lowerer

#: operators whose output is elements of their data input(s), moved, selected, repeated or
#: padded: ``Concat`` reads codes at every input, the others at input 0 only
LAYOUT_OPS = frozenset(
    {
        "Identity",
        "Transpose",
        "Reshape",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Slice",
        "Gather",
        "Expand",
        "Tile",
        "Concat",
        "Pad",
        "DepthToSpace",
        "SpaceToDepth",
    }
)


def _code_inputs(node: NodeProto) -> list[str]:
    """The inputs of a layout ``node`` that carry codes."""
    return list(node.input) if node.op_type == "Concat" else [node.input[0]]


def _is_layout(node: NodeProto | None) -> bool:
    """Whether ``node`` is a default-domain layout operator with one output (a ``Pad`` with
    its pads as an input: opset 11 and above)."""
    if node is None or normalize_domain(node.domain) or node.op_type not in LAYOUT_OPS:
        return False
    if node.op_type == "Pad" and len(node.input) < 2:
        return False
    return bool(node.input) and len([o for o in node.output if o]) == 1


def moved_codes_source(
    lw: Lowerer, name: str, is_source: Callable[[NodeProto], bool]
) -> NodeProto | None:
    """The quantizer (a node ``is_source`` accepts, read at its output 0) whose codes reach
    ``name`` through layout operators only (zero of them included), every code-carrying
    input from that same quantizer (or, for a ``Concat``, a constant: codes joined to
    them); else ``None``."""
    found: dict[int, NodeProto] = {}
    pending = [(name, False)]
    while pending:
        current, constant_allowed = pending.pop()
        node = lw.producers.get(current)
        if node is None and constant_allowed and current in lw.initializers:
            continue
        if node is not None and is_source(node) and node.output[0] == current:
            found[id(node)] = node
            continue
        if not _is_layout(node):
            return None
        joins = node.op_type == "Concat"
        pending.extend((i, joins) for i in _code_inputs(node))
    return next(iter(found.values())) if len(found) == 1 else None


def replayed(
    lw: Lowerer,
    name: str,
    codes: str,
    value: str,
    constant_value: Callable[[str], str],
    out: str | None = None,
) -> str:
    """The moves from ``codes`` to ``name`` (:func:`moved_codes_source` found them) replayed
    on ``value``, the float standing for ``codes``, the last one written to ``out``;
    constant codes ``c`` (a ``Pad``'s, ``''`` when absent, and a ``Concat``'s) become
    ``constant_value(c)``. The integer moves are superseded (removed where nothing else
    reads them)."""
    done = {codes: value}

    def replay(current: str) -> str:
        if current in done:
            return done[current]
        if current in lw.initializers and current not in lw.producers:
            return constant_value(current)
        node = lw.producers[current]
        carried = set(_code_inputs(node))
        inputs = [replay(i) if i in carried else i for i in node.input]
        if node.op_type == "Pad" and _pads_constant(node):
            constant = node.input[2] if len(node.input) > 2 else ""
            inputs = [*inputs[:2], constant_value(constant), *inputs[3:]]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        last = out if current == name else None
        done[current] = lw.op(node.op_type, *inputs, out=last, **attrs)
        lw.superseded.add(id(node))
        return done[current]

    return replay(name)


def _pads_constant(node: NodeProto) -> bool:
    mode = next((a.s for a in node.attribute if a.name == "mode"), b"constant")
    return mode == b"constant"
