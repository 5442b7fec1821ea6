r"""A merged adapter folded into its quantized base, re-quantized in the base's own format.

``merge_lora(model, quantized="requantize")`` computes ``W' = W + s A B`` (float64) over the
dequantized base ``W = (c - z) s_q`` and quantizes ``W'`` again with the base's layout:
the same code width, the same groups sharing a scale, the same kind of zero point. Per group
``g`` of values ``w`` (``lo = min(w, 0)``, ``hi = max(w, 0)``, codes ``[q_min, q_max]``):

- zero points absent, or all at the middle of the code range (0 for int8, 128 for uint8,
  ``2^{b-1}`` for ``b``-bit codes): symmetric, ``z`` kept,
  ``s = max(hi / (q_max - z), lo / (q_min - z))``;
- otherwise asymmetric: ``s = (hi - lo) / (q_max - q_min)``, ``z = round(q_min - lo / s)``;

then ``c = clip(round(w / s) + z, q_min, q_max)``: every value within half a step of ``W'``.

Two bases:

- ``MatMulNBits`` (recorded by ``add_lora`` from the original node, see
  :func:`quantized_formats`): groups are the blocks of ``block_size`` codes of each of the
  ``N`` rows of ``W'^T`` (``K`` padded with zeros), codes packed ``8/bits`` to a byte, least
  significant first, zero points likewise per row; the ``MatMul`` over the lowered
  dequantization becomes the ``MatMulNBits`` node again.
- A ``DequantizeLinear`` of an integer initializer (QDQ weights, ``QLinearMatMul``'s weight
  once lowered): one group per tensor or one per index of ``axis``, as its scale.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, helper, numpy_helper

from onnxgrad._onnx_utils import normalize_domain
from onnxgrad.graph.select import prune_graph

MS = "com.microsoft"
#: operators between a dequantized weight and the MatMul reading it that re-quantization
#: inverts (Transpose by its permutation, the others are the identity on values)
_LAYOUT = frozenset({"Transpose", "Identity", "Cast"})


def quantized_formats(model: ModelProto) -> dict[str, dict]:
    """``{packed weight: record}`` of the ``MatMulNBits`` nodes of ``model`` (before
    normalisation lowers them): op, input names and integer attributes, JSON-ready."""
    inits = {init.name for init in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if (normalize_domain(node.domain), node.op_type) != (MS, "MatMulNBits"):
            continue
        if len(node.input) > 1 and node.input[1] in inits:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            found[node.input[1]] = {
                "op": "MatMulNBits",
                "inputs": list(node.input),
                "attributes": {k: v for k, v in attrs.items() if isinstance(v, int)},
            }
    return found


def requantize(model: ModelProto, merged: list[tuple[dict, np.ndarray]]) -> None:
    """Fold each ``(adapter, delta)`` of ``merged`` (``delta = s A B`` shaped as the
    adapter's dequantized value, the adapter's nodes already removed and its readers reading
    that value) into its quantized base, in place: the integer weight, its scales and zero
    points replaced, a ``MatMulNBits`` raised back; nodes left unused are removed (first
    too: a parameter only a dead node also reads is the weight's own)."""
    prune_graph(model.graph, keep_inputs=True)
    inits = {init.name: init for init in model.graph.initializer}
    for adapter, delta in merged:
        record = adapter.get("quantized")
        if record and record.get("op") == "MatMulNBits":
            _requantize_nbits(inits, adapter["weight"], record, delta)
            _raise_nbits(model, adapter, record)
        else:
            _requantize_dequantized(model, inits, adapter, delta)
    prune_graph(model.graph, keep_inputs=True)


def _quantize_groups(w: np.ndarray, zero: np.ndarray, fixed: bool, code_range, scale_dtype):
    """``(codes, scales, zero points)`` of ``w`` (groups along axis 0, float64) with
    ``zero`` (one per group) kept where ``fixed`` (module docstring)."""
    q_min, q_max = code_range
    flat = w.reshape(len(w), -1)
    lo = np.minimum(flat.min(axis=1), 0.0)
    hi = np.maximum(flat.max(axis=1), 0.0)
    if fixed:
        z = zero.astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            up = np.where(q_max > z, hi / (q_max - z), 0.0)
            down = np.where(q_min < z, lo / (q_min - z), 0.0)
        scale = np.maximum(up, down)
    else:
        scale = (hi - lo) / (q_max - q_min)
    scale = np.where(scale > 0, scale, 1.0).astype(scale_dtype).astype(np.float64)
    if not fixed:
        z = np.clip(np.round(q_min - lo / scale), q_min, q_max)
    codes = np.clip(np.round(flat / scale[:, None]) + z[:, None], q_min, q_max)
    return codes.reshape(w.shape), scale, z


def _requantize_nbits(inits, weight: str, record: dict, delta: np.ndarray) -> None:
    inputs, (bits, block, k, n) = _checked_record(record, weight, inits)
    blocks = -(-k // block)
    if delta.shape != (k, n):
        raise ValueError(f"MatMulNBits weight {weight!r}: an update {delta.shape}, not {(k, n)}")
    zero_name = inputs[3] if len(inputs) > 3 else ""
    packed, scale_init = inits[weight], inits[inputs[2]]
    scales = numpy_helper.to_array(scale_init).reshape(n, blocks).astype(np.float64)
    codes = _unpack(numpy_helper.to_array(packed), bits, (n, blocks * block))
    middle = 1 << (bits - 1)
    if zero_name:
        zero_array = numpy_helper.to_array(inits[zero_name])
        if zero_array.dtype != np.uint8:
            raise ValueError(
                f"MatMulNBits weight {weight!r}: float zero points {zero_name!r} are not "
                "re-quantized"
            )
        width = -(-blocks * bits // 8)
        zero = _unpack(zero_array, bits, (n, width * (8 // bits)))[:, :blocks]
    else:
        zero = np.full((n, blocks), middle)
    values = (codes.reshape(n, blocks, block) - zero[..., None]) * scales[..., None]
    merged = values.reshape(n, blocks * block)
    merged[:, :k] += delta.T
    merged[:, k:] = 0.0
    groups = merged.reshape(n * blocks, block)
    fixed = not zero_name or bool(np.all(zero == middle))
    scale_dtype = numpy_helper.to_array(scale_init).dtype
    new_codes, new_scales, new_zero = _quantize_groups(
        groups, zero.reshape(-1), fixed, (0, (1 << bits) - 1), scale_dtype
    )
    _replace(inits, weight, _pack(new_codes.reshape(n, -1), bits, packed.dims))
    _replace(inits, inputs[2], new_scales.reshape(scale_init.dims))
    if zero_name:
        zero_rows = np.zeros((n, -(-blocks * bits // 8) * (8 // bits)), dtype=np.uint8)
        zero_rows[:, :blocks] = new_zero.reshape(n, blocks)
        _replace(inits, zero_name, _pack(zero_rows, bits, inits[zero_name].dims))


def _checked_record(record: object, weight: str, inits) -> tuple[list[str], tuple]:
    """``(inputs, (bits, block_size, K, N))`` of a ``MatMulNBits`` record read from the
    model's metadata, checked against the initializers (``ValueError`` naming the weight)."""
    inputs = record.get("inputs") if isinstance(record, dict) else None
    attrs = record.get("attributes") if isinstance(record, dict) else None
    if (
        isinstance(inputs, list)
        and isinstance(attrs, dict)
        and 3 <= len(inputs) <= 6
        and all(isinstance(name, str) for name in inputs)
        and inputs[1] == weight
        and all(name in inits for name in inputs[2:4] if name)
    ):
        sizes = (attrs.get("bits", 4), attrs.get("block_size"), attrs.get("K"), attrs.get("N"))
        if sizes[0] in (2, 4, 8) and all(type(v) is int and v > 0 for v in sizes):
            bits, block, k, n = sizes
            blocks = -(-k // block)
            packed, scales = (int(np.prod(inits[name].dims)) for name in (weight, inputs[2]))
            if packed * 8 == n * blocks * block * bits and scales == n * blocks:
                return inputs, sizes
    raise ValueError(f"the LoRA metadata's MatMulNBits record of weight {weight!r} is malformed")


def _unpack(packed: np.ndarray, bits: int, shape) -> np.ndarray:
    """Codes of ``bits`` bits packed ``8/bits`` to a byte, least significant first."""
    per_byte = 8 // bits
    raw = packed.astype(np.int64).reshape(-1, 1) >> (bits * np.arange(per_byte))
    return (raw & ((1 << bits) - 1)).reshape(shape)


def _pack(codes: np.ndarray, bits: int, dims) -> np.ndarray:
    per_byte = 8 // bits
    grouped = codes.astype(np.int64).reshape(-1, per_byte) << (bits * np.arange(per_byte))
    return grouped.sum(axis=1).astype(np.uint8).reshape(tuple(dims))


def _replace(inits, name: str, value: np.ndarray) -> None:
    init = inits[name]
    dtype = numpy_helper.to_array(init).dtype
    init.CopyFrom(numpy_helper.from_array(np.asarray(value).astype(dtype), name=name))


def _raise_nbits(model: ModelProto, adapter: dict, record: dict) -> None:
    """Each ``MatMul(a, value)`` becomes the recorded ``MatMulNBits(a, B, scales[, zero
    points])`` (a bias stays the lowering's ``Add``)."""
    graph = model.graph
    value = adapter["value"]
    inputs = record["inputs"][1:4]
    while inputs and not inputs[-1]:
        inputs.pop()
    for index, node in enumerate(graph.node):
        if node.op_type != "MatMul" or normalize_domain(node.domain) or node.input[1] != value:
            continue
        raised = helper.make_node(
            "MatMulNBits",
            [node.input[0], *inputs],
            list(node.output),
            name=node.name,
            domain=MS,
            **record["attributes"],
        )
        graph.node[index].CopyFrom(raised)
    if not any(normalize_domain(o.domain) == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))


def _requantize_dequantized(model: ModelProto, inits, adapter: dict, delta) -> None:
    """The base read by ``DequantizeLinear(q, scale[, zero])``, per tensor or per axis."""
    weight = adapter["weight"]
    node, perm = _dequantize_of(model, adapter["value"], weight)
    if any(a.name == "block_size" and a.i for a in node.attribute):
        raise ValueError(f"weight {weight!r}: blocked DequantizeLinear is not re-quantized")
    scale_name = _initializer_behind(model, node.input[1])
    zero_name = _initializer_behind(model, node.input[2]) if len(node.input) > 2 else ""
    if scale_name is None or zero_name is None:
        raise ValueError(f"weight {weight!r}: its scale or zero point is not an initializer")
    _check_private(model, node, weight, [weight, scale_name, zero_name])
    codes = numpy_helper.to_array(inits[weight])
    scale = numpy_helper.to_array(inits[scale_name])
    info = np.iinfo(codes.dtype)
    zero = numpy_helper.to_array(inits[zero_name]) if zero_name else np.zeros((), codes.dtype)
    per_axis = scale.size > 1
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1) % codes.ndim
    groups = np.moveaxis(codes, axis, 0) if per_axis else codes[None]
    count = len(groups)
    zero_groups = np.broadcast_to(zero.reshape(-1), (count,)).astype(np.float64)
    scale_groups = np.broadcast_to(scale.reshape(-1), (count,)).astype(np.float64)
    shape = (count,) + (1,) * (groups.ndim - 1)
    values = (groups - zero_groups.reshape(shape)) * scale_groups.reshape(shape)
    update = np.transpose(delta, np.argsort(perm)) if perm else delta
    if update.shape != codes.shape:
        raise ValueError(f"weight {weight!r} {list(codes.shape)}: an update {delta.shape}")
    values = values + (np.moveaxis(update, axis, 0) if per_axis else update[None])
    middle = 0 if info.min < 0 else (info.max + 1) // 2
    fixed = not zero_name or bool(np.all(zero == middle))
    new_codes, new_scale, new_zero = _quantize_groups(
        values, zero_groups, fixed, (info.min, info.max), scale.dtype
    )
    new_codes = np.moveaxis(new_codes, 0, axis) if per_axis else new_codes[0]
    _replace(inits, weight, new_codes)
    _replace(inits, scale_name, new_scale.reshape(scale.shape))
    if zero_name:
        _replace(inits, zero_name, new_zero.reshape(zero.shape))


def _dequantize_of(model: ModelProto, value: str, weight: str):
    """The ``DequantizeLinear`` reading ``weight`` that ``value`` (2-D, so a ``Transpose``
    without ``perm`` swaps its axes) is computed from through :data:`_LAYOUT` operators, and
    the composed permutation (``None`` for none)."""
    producers = {out: node for node in model.graph.node for out in node.output}
    perm = None
    node = producers.get(value)
    while node is not None and node.op_type in _LAYOUT and not normalize_domain(node.domain):
        if node.op_type == "Transpose":
            step = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
            perm = step if perm is None else [step[i] for i in perm]
        node = producers.get(node.input[0])
    if node is None or node.op_type != "DequantizeLinear" or node.input[0] != weight:
        raise ValueError(
            f"weight {weight!r}: its dequantized value {value!r} is not a DequantizeLinear "
            "of it through Transpose/Identity/Cast; it cannot be re-quantized"
        )
    return node, perm


def _initializer_behind(model: ModelProto, name: str) -> str | None:
    """``name``'s initializer, through ``Reshape``/``Identity``; ``''`` for no input."""
    if not name:
        return ""
    inits = {init.name for init in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    while name not in inits:
        node = producers.get(name)
        if node is None or node.op_type not in ("Reshape", "Identity"):
            return None
        name = node.input[0]
    return name


def _check_private(model: ModelProto, dequantize, weight: str, names) -> None:
    """``ValueError`` where another node than ``dequantize`` (or a reshape feeding it)
    reads the weight, its scale or its zero point: re-quantizing would change it too."""
    feeding = set(dequantize.input)
    for node in model.graph.node:
        reshaping = node.op_type in ("Reshape", "Identity") and feeding & set(node.output)
        if list(node.output) == list(dequantize.output) or reshaping:
            continue
        shared = sorted(set(names) & set(node.input) - {""})
        if shared:
            raise ValueError(
                f"weight {weight!r}: its quantization parameters {shared} are also read by "
                f"node {node.name or node.op_type!r}; it cannot be re-quantized alone"
            )
