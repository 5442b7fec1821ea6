r"""A merged adapter folded into its quantized base, re-quantized in the base's own format.

``merge_lora(model, quantized="requantize")`` computes ``W' = W + s A B`` (float64) over the
dequantized base ``W = (c - z) s_q`` and quantizes ``W'`` again with the base's layout:
the same code width, the same groups sharing a scale, the same kind of zero point. Per group
``g`` of values ``w`` (``lo = min(w, 0)``, ``hi = max(w, 0)``, codes ``[q_min, q_max]``):

- zero points absent, or all at the middle of the code range (0 for int8, 128 for uint8,
  ``2^{b-1}`` for ``b``-bit codes): symmetric, ``z`` kept,
  ``s = max(hi / (q_max - z), lo / (q_min - z))``, where ``q_min`` is the type's lowest code
  only if the deployed codes use it, else ``2 z - q_max`` (a restricted range, as
  onnxruntime's symmetric int8 weights ``[-127, 127]``): with nothing added, the codes and
  scales come back unchanged (:func:`symmetric_code_range`);
- otherwise asymmetric: ``s = (hi - lo) / (q_max - q_min)``, ``z = round(q_min - lo / s)``;

then ``c = clip(round(w / s) + z, q_min, q_max)``: every value within half a step of ``W'``.

The base is found in the deployed graph (:mod:`onnxgrad.graph.deployed_products`):

- ``MatMulNBits``: groups are the blocks of ``block_size`` codes of each of the ``N`` rows
  of ``W'^T`` (``K`` padded with zeros), codes packed ``8/bits`` to a byte, least
  significant first, zero points likewise per row;
- a ``DequantizeLinear`` of an integer initializer (QDQ weights) or its plain-operator form
  (:mod:`onnxgrad.graph.plain_dequantization`: a divisor ``d`` is written as ``1 / s``; per
  block, one group per value of the block scale), ``MatMulInteger``
  (``quantize_dynamic``: the weight's scale is the initializer multiplied into the
  product), ``DynamicQuantizeMatMul`` and ``QLinearMatMul``: one group per tensor or one
  per column, as the scale.

A product may read a QDQ weight quantized again, ``DQ(Q(W, s_2, z_2))`` (``quantize_static``'s
second reader of a weight two layers share, :mod:`onnxgrad.graph.deployed_products`): every
reader has the one adapter, so the new codes hold ``W' = W + s A B`` for all of them, and
such a reader quantizes ``W'`` again with its own ``s_2``, ``z_2``, as the file does; where
``W'`` leaves their range (which would clip what the training graph adds unclipped), they
are widened by the rule above over ``W'`` and the range's two ends (unchanged where ``W'``
lies inside). Codes that several ``DequantizeLinear`` nodes of one scale and zero point read
(a tied weight, a table read twice) are quantized once, over ``W'``, for all of them. Another
node reading the dequantized weight makes it refuse.

Only initializers change: the result has the deployed model's nodes.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, helper, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES
from onnxgrad.graph.deployed_products import Product, weight_products
from onnxgrad.graph.plain_dequantization import code_range


def requantize_products(model: ModelProto, merged: list[tuple[str, np.ndarray]]) -> None:
    """Fold each ``(weight, delta)`` of ``merged`` (``delta = s A B``, ``K x N``, the
    adapter's branch already removed) into the quantized base of ``weight``, in place:
    its codes, scales and zero points replaced (module docstring)."""
    products = weight_products(model)
    inits = {init.name: init for init in model.graph.initializer}
    for weight, delta in merged:
        found = products.get(weight)
        if not found or not found[0].quantized:
            raise ValueError(f"weight {weight!r}: the model has no quantized product reading it")
        product = found[0]
        if product.kind == "MatMulNBits":
            _requantize_nbits(inits, weight, _nbits_record(model, product), delta)
        elif product.kind == "DequantizeLinear":
            _requantize_dequantized(model, inits, found, delta)
        elif product.kind == "Cast":
            _requantize_plain(model, inits, found, delta)
        else:
            scale, zero = _product_parameters(model, product)
            readers = [product.reader, *_scale_readers(model, product, scale)]
            _check_private(model, readers, weight, [weight, scale, zero])
            _requantize_codes(inits, weight, scale, zero, 1, update=delta)


def _nbits_record(model: ModelProto, product: Product) -> dict:
    node = next(n for n in model.graph.node if n.name == product.reader)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {
        "inputs": list(node.input),
        "attributes": {k: v for k, v in attrs.items() if isinstance(v, int)},
    }


def _product_parameters(model: ModelProto, product: Product) -> tuple[str, str]:
    """``(scale, zero point)`` initializers of an integer product's weight (``''``: no
    zero point)."""
    reader = next(n for n in model.graph.node if n.name == product.reader)
    inputs = list(reader.input) + [""] * 6
    if product.kind == "DynamicQuantizeMatMul":
        return inputs[2], inputs[3]
    if product.kind == "QLinearMatMul":
        return inputs[4], inputs[5]
    return integer_product_scale(model, product), inputs[3]


def integer_product_scale(model: ModelProto, product: Product) -> str:
    """The float initializer ``quantize_dynamic`` multiplies into ``Cast(MatMulInteger)``:
    an input of a ``Mul`` of the chain, or of the ``Mul`` computing the scales' product."""
    inits = {init.name: init for init in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    node = next(n for n in model.graph.node if n.name == product.reader)
    found = set()
    while node.name != product.node.name and len(readers.get(node.output[0], [])) == 1:
        value, node = node.output[0], readers[node.output[0]][0]
        for name in (n for n in node.input if n != value) if node.op_type == "Mul" else ():
            source = producers.get(name)
            candidates = [name] if name in inits else list(source.input) if source else []
            found |= {c for c in candidates if c in inits and inits[c].data_type in FLOAT_TYPES}
    if len(found) != 1:
        raise ValueError(
            f"weight {product.weight!r}: its scale is not one initializer of the Mul after "
            f"its MatMulInteger (found {sorted(found)}); it cannot be re-quantized"
        )
    return found.pop()


def _scale_readers(model: ModelProto, product: Product, scale: str) -> list[str]:
    """The first ``Mul`` reading ``scale``: the product's own (any other reader makes
    :func:`_check_private` refuse)."""
    return [n.name for n in model.graph.node if scale in n.input and n.op_type == "Mul"][:1]


def symmetric_code_range(codes: np.ndarray, middle: int) -> tuple[int, int]:
    """``(q_min, q_max)`` of a symmetric requantization of ``codes`` (zero point ``middle``):
    the type's range, less its lowest code where ``codes`` never use it (a restricted
    range ``[2 middle - q_max, q_max]``, so that the scale of unchanged values is theirs)."""
    low, high = code_range(codes.dtype)
    if codes.size and int(codes.min()) == low:
        return low, high
    return max(low, 2 * middle - high), high


def kept_zero_point(zero: np.ndarray | None, dtype, groups: int) -> tuple[bool, int]:
    """``(kept, middle)``: whether re-quantizing codes of ``dtype`` in ``groups`` groups is
    symmetric, keeping their zero points ``zero`` (``None``: absent): absent, all at the
    ``middle`` of the code range (0 signed, ``2^{b-1}`` unsigned), or one shared by groups
    with scales of their own (left as it is)."""
    low, high = code_range(dtype)
    middle = 0 if low < 0 else (high + 1) // 2
    kept = zero is None or bool(np.all(zero == middle)) or zero.size < groups
    return kept, middle


def _steps(stored: np.ndarray, divides: bool) -> np.ndarray:
    """The quantization steps (float64) of stored scales: themselves, or ``1 / d`` for
    divisors ``d``."""
    values = stored.astype(np.float64)
    return 1.0 / values if divides else values


def _quantize_groups(
    w: np.ndarray, zero: np.ndarray, fixed: bool, codes_range, scale_dtype, divides: bool = False
):
    """``(codes, scales, zero points)`` of ``w`` (groups along axis 0, float64) with
    ``zero`` (one per group) kept where ``fixed`` (module docstring); each scale the step
    its stored ``scale_dtype`` value gives (``1 / d`` for a divisor ``d`` where ``divides``)."""
    q_min, q_max = codes_range
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
    scale = np.where(scale > 0, scale, 1.0)
    stored = (1.0 / scale if divides else scale).astype(scale_dtype)
    scale = _steps(stored, divides)
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
    """``(inputs, (bits, block_size, K, N))`` of a ``MatMulNBits`` node's record, checked
    against the initializers (``ValueError`` naming the weight)."""
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
    raise ValueError(
        f"the MatMulNBits node reading weight {weight!r} disagrees with its codes and scales "
        "(bits, block_size, K, N)"
    )


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


def _requantize_dequantized(model: ModelProto, inits, products: list[Product], delta) -> None:
    """The base read by ``DequantizeLinear(q, scale[, zero])``, per tensor or per axis,
    through the layout operators between it and the ``MatMul``. Every product reading it
    (one adapter for all, of one layout: :func:`onnxgrad.graph.lora.add_lora`) reads the new
    codes, a requantized reader through its own ``QuantizeLinear`` as the file does; codes
    two ``DequantizeLinear`` nodes read (a tied weight, a table read twice) are quantized
    once, over the merged weight both read."""
    weight = products[0].weight
    layouts = {}
    for name in dict.fromkeys(p.reader for p in products):
        node = next(n for n in model.graph.node if n.name == name)
        layouts[name] = (node, _dequantization_layout(model, inits, node, weight))
    layout = next(iter(layouts.values()))[1]
    if any(other != layout for _, other in layouts.values()):
        raise ValueError(
            f"weight {weight!r}: its DequantizeLinear nodes {sorted(layouts)} read its codes "
            "with different scales, zero points or axes; it is not re-quantized (merge with "
            "quantized='keep')"
        )
    scale_name, zero_name, _ = layout
    _check_private(model, list(layouts), weight, [weight, scale_name, zero_name])
    outputs = [out for node, _ in layouts.values() for out in node.output]
    _check_only_products(model, outputs, products, weight)
    _requantize_read(model, inits, products, layout, delta)


def _dequantization_layout(model: ModelProto, inits, node, weight: str) -> tuple[str, str, int]:
    """``(scale, zero point, axis)`` of a weight's ``DequantizeLinear`` ``node``."""
    if any(a.name == "block_size" and a.i for a in node.attribute):
        raise ValueError(f"weight {weight!r}: blocked DequantizeLinear is not re-quantized")
    scale_name = _initializer_behind(model, node.input[1])
    zero_name = _initializer_behind(model, node.input[2]) if len(node.input) > 2 else ""
    if scale_name is None or zero_name is None:
        raise ValueError(f"weight {weight!r}: its scale or zero point is not an initializer")
    rank = len(inits[weight].dims)
    return scale_name, zero_name, next((a.i for a in node.attribute if a.name == "axis"), 1) % rank


def _requantize_plain(model: ModelProto, inits, products: list[Product], delta) -> None:
    """The base read as ``(Cast(q) - z) s`` or ``(Cast(q) - z) / d``
    (:mod:`onnxgrad.graph.plain_dequantization`): as a ``DequantizeLinear`` of the same scale
    (``1 / d``) and zero point, the new ones written in the file's form (a divisor ``d``, a
    zero point of whole floats or integers); the ``Cast``, ``Sub``, ``Mul`` or ``Div`` unchanged."""
    plain = products[0].plain
    _check_private(model, list(plain.nodes), plain.codes, [plain.codes, plain.scale, plain.zero])
    casts = [n for n in model.graph.node if n.name in plain.nodes and n.op_type == "Cast"]
    start = [out for cast in casts for out in cast.output]  # the codes, the zero point
    _check_only_products(model, start, products, plain.codes, set(plain.nodes))
    if plain.blocks is not None:
        _requantize_blocks(model, inits, products, delta)
        return
    axis = 0 if plain.axis is None else plain.axis
    layout = (plain.scale, plain.zero, axis, plain.divides)
    _requantize_read(model, inits, products, layout, delta)


def _requantize_blocks(model: ModelProto, inits, products: list[Product], delta) -> None:
    """Per block: the codes reshaped to ``plain.blocks``, one group per value of the scale
    (per block, and per index of the other axis where the scale has one), each quantized
    again by the module docstring's rule; a reader quantizing the weight again as in
    :func:`_requantize_read`."""
    product = products[0]
    plain = product.plain
    update = np.transpose(delta, np.argsort(product.perm)) if product.perm else delta
    codes = numpy_helper.to_array(inits[plain.codes])
    scale = numpy_helper.to_array(inits[plain.scale])
    zero = numpy_helper.to_array(inits[plain.zero]) if plain.zero else None
    if update.shape != codes.shape:
        raise ValueError(f"weight {plain.codes!r} {list(codes.shape)}: an update {update.shape}")
    shape, steps = plain.blocks, _steps(scale, plain.divides)
    shift = np.zeros(()) if zero is None else zero.astype(np.float64)
    values = (codes.astype(np.float64).reshape(shape) - shift) * steps + update.reshape(shape)
    order = [i for i, d in enumerate(scale.shape) if d != 1]
    order += [i for i in range(3) if i not in order]  # the groups first, their values last
    groups = np.transpose(values, order).reshape(scale.size, -1)
    zero_groups = np.broadcast_to(shift, scale.shape).reshape(-1)
    fixed, middle = kept_zero_point(zero, codes.dtype, scale.size)
    codes_range = symmetric_code_range(codes, middle) if fixed else code_range(codes.dtype)
    new_codes, new_steps, new_zero = _quantize_groups(
        groups, zero_groups, fixed, codes_range, scale.dtype, plain.divides
    )
    moved = new_codes.reshape([shape[i] for i in order])
    blocked = np.transpose(moved, np.argsort(order))
    _replace(inits, plain.codes, blocked.reshape(codes.shape))
    stored = 1.0 / new_steps if plain.divides else new_steps
    _replace(inits, plain.scale, stored.reshape(scale.shape))
    if zero is not None and not fixed:
        _replace(inits, plain.zero, new_zero.reshape(zero.shape))
    requantizations = _requantizations(model, products)
    if requantizations:
        steps, shift = new_steps.reshape(scale.shape), new_zero.reshape(scale.shape)
        merged = ((blocked - shift) * steps).reshape(codes.shape)
        for quantize in requantizations:
            merged = _widened(model, inits, quantize, merged, plain.codes)


def _requantize_read(model: ModelProto, inits, products: list[Product], layout, delta) -> None:
    """``(scale, zero point, axis[, divides])``'s codes of ``products`` (one weight) hold
    ``W + delta`` (``delta`` ``K x N`` as the first product reads it); a reader quantizing
    the weight again widens its range where the new values leave it."""
    product = products[0]
    weight, perm = product.weight, product.perm
    update = np.transpose(delta, np.argsort(perm)) if perm else delta
    _requantize_codes(inits, weight, *layout, update=update)
    requantizations = _requantizations(model, products)
    merged = _dequantized(inits, weight, *layout) if requantizations else None
    for quantize in requantizations:
        merged = _widened(model, inits, quantize, merged, weight)


def _dequantized(
    inits, weight: str, scale_name: str, zero_name: str, axis: int, divides: bool = False
) -> np.ndarray:
    """``(codes - zero) scale`` (float64) of ``weight``, per tensor or per index of ``axis``
    (``scale`` ``1 / d`` where it ``divides``)."""
    codes = numpy_helper.to_array(inits[weight]).astype(np.float64)
    scale = _steps(numpy_helper.to_array(inits[scale_name]), divides)
    zero = numpy_helper.to_array(inits[zero_name]) if zero_name else np.zeros(())
    shape = [1] * codes.ndim
    if scale.size > 1:
        shape[axis] = -1
    return (codes - zero.astype(np.float64).reshape(shape)) * scale.reshape(shape)


def _requantizations(model: ModelProto, products: list[Product]) -> list:
    """The ``QuantizeLinear`` nodes between the weight and its products (a reader of the
    weight quantized again), each once, in graph order."""
    between = {name for product in products for name in product.requantizations}
    return [n for n in model.graph.node if n.name in between]


def _widened(model: ModelProto, inits, quantize, values: np.ndarray, weight: str) -> np.ndarray:
    """A reader's requantization ``Q(W', s_2, z_2)`` of the merged weight: its scale and zero
    point kept where ``W'`` lies in their range, the file's computation, else widened to the
    range of both (the rule of the module docstring over ``W'`` and the range's ends), so
    that no value of ``W + s A B`` is clipped where the training graph's branch adds it
    unclipped. Returns the values the reader then reads, ``DQ(Q(W'))``."""
    scale_name = _initializer_behind(model, quantize.input[1])
    zero_name = _initializer_behind(model, quantize.input[2]) if len(quantize.input) > 2 else ""
    if not scale_name or zero_name is None:
        raise ValueError(
            f"weight {weight!r}: the scale or zero point of its requantization "
            f"{quantize.name!r} is not an initializer"
        )
    scale = numpy_helper.to_array(inits[scale_name])
    zero = numpy_helper.to_array(inits[zero_name]) if zero_name else np.zeros((), np.uint8)
    if scale.size > 1 or zero.size > 1:
        raise ValueError(
            f"weight {weight!r}: its requantization {quantize.name!r} has a scale per axis; "
            "it is not re-quantized (merge with quantized='keep')"
        )
    info = np.iinfo(zero.dtype)
    step, z = float(scale.reshape(-1)[0]), float(zero.reshape(-1)[0])
    ends = np.array([(info.min - z) * step, (info.max - z) * step])
    if ends[0] <= values.min() and values.max() <= ends[1]:
        return _rounded(values, step, z, info)
    dequantize = [n for n in model.graph.node if quantize.output[0] in n.input]
    owners = [quantize.name, *(n.name for n in dequantize)]
    _check_private(model, owners, weight, [scale_name, zero_name])
    fixed, _ = kept_zero_point(zero if zero_name else None, zero.dtype, 1)
    both = np.concatenate([values.reshape(-1), ends])[None]
    _, new_scale, new_zero = _quantize_groups(
        both, np.full(1, z), fixed, (info.min, info.max), scale.dtype
    )
    _replace(inits, scale_name, new_scale.reshape(scale.shape))
    if zero_name and not fixed:
        _replace(inits, zero_name, new_zero.reshape(zero.shape))
    return _rounded(values, float(new_scale[0]), float(new_zero[0]), info)


def _rounded(values: np.ndarray, step: float, zero: float, info) -> np.ndarray:
    """``DQ(Q(values, step, zero))``: half to even, saturated to the codes' range."""
    codes = np.clip(np.round(values / step) + zero, info.min, info.max)
    return (codes - zero) * step


def _requantize_codes(
    inits, weight: str, scale_name: str, zero_name: str, axis: int, divides=False, *, update
):
    """``codes <- quantize((codes - zero) scale + update)`` with one group per tensor or,
    for a scale of several values, per index of ``axis`` (``update`` in the codes' layout;
    ``scale`` a divisor ``d``, the step ``1 / d``, where ``divides``)."""
    codes = numpy_helper.to_array(inits[weight])
    scale = numpy_helper.to_array(inits[scale_name])
    if update.shape != codes.shape:
        raise ValueError(f"weight {weight!r} {list(codes.shape)}: an update {update.shape}")
    zero = numpy_helper.to_array(inits[zero_name]) if zero_name else np.zeros((), codes.dtype)
    per_axis = scale.size > 1
    numbers = codes.astype(np.int64)  # 4-bit codes (ml_dtypes) take no arithmetic with floats
    groups = np.moveaxis(numbers, axis, 0) if per_axis else numbers[None]
    count = len(groups)
    zero_groups = np.broadcast_to(zero.reshape(-1), (count,)).astype(np.float64)
    scale_groups = np.broadcast_to(_steps(scale, divides).reshape(-1), (count,))
    shape = (count,) + (1,) * (groups.ndim - 1)
    values = (groups - zero_groups.reshape(shape)) * scale_groups.reshape(shape)
    values = values + (np.moveaxis(update, axis, 0) if per_axis else update[None])
    fixed, middle = kept_zero_point(zero if zero_name else None, codes.dtype, count)
    codes_range = symmetric_code_range(codes, middle) if fixed else code_range(codes.dtype)
    new_codes, new_scale, new_zero = _quantize_groups(
        values, zero_groups, fixed, codes_range, scale.dtype, divides
    )
    new_codes = np.moveaxis(new_codes, 0, axis) if per_axis else new_codes[0]
    _replace(inits, weight, new_codes)
    _replace(inits, scale_name, (1.0 / new_scale if divides else new_scale).reshape(scale.shape))
    if zero_name and not fixed:
        _replace(inits, zero_name, new_zero.reshape(zero.shape))


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


#: what may stand between a ``DequantizeLinear`` of a weight and its product
_LAYOUT = frozenset({"Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"})


def _check_only_products(
    model: ModelProto, start: list[str], products, weight: str, inner: set[str] = frozenset()
) -> None:
    """``ValueError`` where the dequantized weight (``start``: the outputs of its
    ``DequantizeLinear``, or of the ``Cast`` of its plain form, whose ``Sub`` and ``Mul``
    are ``inner``) reaches another node than ``products`` (through layout operators and the
    nodes between it and each product: a requantized reader's ``QuantizeLinear`` and
    ``DequantizeLinear``): that reader has no adapter and would read the new codes."""
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in dict.fromkeys(node.input):
            readers.setdefault(name, []).append(node)
    # each product's own output, or (QDQ) the value its output QuantizeLinear reads
    own = {out for p in products for out in p.node.output}
    own |= {p.requantized_by.input[0] for p in products if p.requantized_by is not None}
    between = {name for p in products for name in p.via} | set(inner)
    pending, seen = list(start), set()
    while pending:
        value = pending.pop()
        for reader in readers.get(value, []) if value not in seen else []:
            if own & set(reader.output):
                continue
            if reader.name not in between and reader.op_type not in _LAYOUT:
                raise ValueError(
                    f"weight {weight!r}: its dequantized value is also read by node "
                    f"{reader.name or reader.op_type!r}, which has no adapter; re-quantizing "
                    "would change it too (merge with quantized='keep')"
                )
            pending.extend(reader.output)
        seen.add(value)


def _check_private(model: ModelProto, owners: list[str], weight: str, names) -> None:
    """``ValueError`` where another node than ``owners`` (or a reshape feeding one) reads
    the weight, its scale or its zero point: re-quantizing would change it too."""
    owned = [n for n in model.graph.node if n.name in owners]
    feeding = {name for n in owned for name in n.input}
    for node in model.graph.node:
        reshaping = node.op_type in ("Reshape", "Identity") and feeding & set(node.output)
        if node.name in owners or reshaping:
            continue
        shared = sorted(set(names) & set(node.input) - {""})
        if shared:
            raise ValueError(
                f"weight {weight!r}: its quantization parameters {shared} are also read by "
                f"node {node.name or node.op_type!r}; it cannot be re-quantized alone"
            )
