r"""onnxruntime's fused attention operators lowered to standard ONNX.

All three compute, per head, ``softmax(scale\, q k^T + m) v`` with ``scale = 1/\sqrt{h}``
by default, heads split from the hidden axis (``(B, S, N h) -> (B, N, S, h)``) and merged
back, float16 in float32:

- ``Attention``: ``[q, k, v] = x W + b`` (split by ``qkv_hidden_sizes``); a ``past``
  ``(2, B, N, P, h)`` is prepended to ``k, v`` and ``present`` stacks the results. The mask
  ``m`` is onnxruntime's: a masked key (a raw 2-D or 3-D mask's zeros, positions past a 1-D
  mask's end or before its start) scores ``mask_filter_value``, and ``unidirectional``
  adds ``mask_filter_value`` to every key after the query's position; an
  ``attention_bias`` is added.
- ``MultiHeadAttention``: separate ``query``, ``key``, ``value`` (3-D, or ``key``/``value``
  already split into heads), an optional packed ``bias``, ``key_padding_mask`` as above,
  ``past_key``/``past_value`` ``(B, N, P, h)`` concatenated.
- ``GroupQueryAttention``: ``kv_num_heads`` key/value heads shared by groups of query heads,
  causal, key ``j`` visible to query ``i`` when ``j <= T - S + i`` and ``j <=
  seqlens_k[b]`` (``T`` the total length): exact for unpadded batches and for a first prompt
  padded on the right; optional rotary embedding of ``q, k`` and ``softcap``.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.normalize.lowering import Lowerer, reading_only
from onnxgrad.normalize.rotary import rotate

MS = "com.microsoft"


def _heads(lw: Lowerer, x: str, heads: int) -> str:
    """``(B, S, N h) -> (B, N, S, h)``."""
    split = lw.op("Reshape", x, lw.ints([0, 0, heads, -1]))
    return lw.op("Transpose", split, perm=[0, 2, 1, 3])


def _merged(lw: Lowerer, x: str) -> str:
    """``(B, N, S, h) -> (B, S, N h)``."""
    return lw.op("Reshape", lw.op("Transpose", x, perm=[0, 2, 1, 3]), lw.ints([0, 0, -1]))


def _scale(lw: Lowerer, head_size: int | None) -> float:
    scale = lw.attr("scale", 0.0)
    if scale:
        return scale
    if not head_size:
        raise lw.error("the default scale needs a static head size")
    return 1.0 / float(np.sqrt(head_size))


def _head_size(lw: Lowerer, x: str, heads: int, axis: int = -1) -> int | None:
    dims = lw.dims(x)
    if dims and dims[axis]:
        return dims[axis] // heads
    return None


def _scores(lw: Lowerer, q: str, k: str, scale: float, ct: int) -> str:
    product = lw.op("MatMul", q, lw.op("Transpose", k, perm=[0, 1, 3, 2]))
    return lw.op("Mul", product, lw.const(scale, ct))


def _attend(lw: Lowerer, scores: str, v: str) -> str:
    return lw.op("MatMul", lw.op("Softmax", scores, axis=-1), v)


def _length(lw: Lowerer, x: str, axis: int) -> str:
    """The size of axis ``axis`` of ``x`` as a 1-element int64 tensor."""
    return lw.op("Gather", lw.op("Shape", x), lw.ints([axis]), axis=0)


def _causal(lw: Lowerer, q: str, k: str, past: str = "") -> str:
    """Boolean ``(S, T)``: key ``j`` after query ``i``'s position ``P + i``, ``P`` the length
    of ``past`` (axis 2), or ``T - S`` without one."""
    s, t = _length(lw, q, 2), _length(lw, k, 2)
    start = _length(lw, past, 2) if past else lw.op("Sub", t, s)
    end = lw.op("Add", start, s)
    rows = lw.op("Range", _scalar(lw, start), _scalar(lw, end), lw.ints(1))
    cols = lw.op("Range", lw.ints(0), _scalar(lw, t), lw.ints(1))
    return lw.op("Greater", lw.unsqueeze(cols, [0]), lw.unsqueeze(rows, [1]))


def _scalar(lw: Lowerer, one: str) -> str:
    return lw.op("Squeeze", one, lw.ints([0]))


def _padding_bias(lw: Lowerer, mask: str, q: str, k: str, ct: int, filter_value: float) -> str:
    """onnxruntime's additive mask, shaped to broadcast over ``(B, N, S, T)``."""
    rank = lw.rank(mask)
    zero, masked = lw.const(0.0, ct), lw.const(filter_value, ct)
    if rank in (2, 3):
        keep = lw.op("Greater", mask, lw.const(0, lw.elem(mask)))
        bias = lw.op("Where", keep, zero, masked)
        return lw.unsqueeze(bias, [1, 2] if rank == 2 else [1])
    if rank != 1:
        raise lw.error(f"a {rank}-D mask is not supported (onnxruntime's CPU kernel has none)")
    batch = _length(lw, q, 0)
    positions = lw.unsqueeze(
        lw.op("Range", lw.ints(0), _scalar(lw, _length(lw, k, 2)), lw.ints(1)), [0]
    )
    mask64 = lw.cast(mask, TensorProto.INT64)
    end = lw.unsqueeze(lw.op("Slice", mask64, lw.ints([0]), batch, lw.ints([0])), [1])
    out = lw.op("GreaterOrEqual", positions, end)
    has_start = _has_start(lw, mask, lw.input(0))
    if has_start is not False:
        if has_start is None:  # sizes known at run time only: a missing start reads as 0
            zeros = lw.op("ConstantOfShape", batch, value=_int64_zero())
            mask64 = lw.op("Concat", mask64, zeros, axis=0)
        start = lw.op("Slice", mask64, batch, lw.op("Mul", batch, lw.ints([2])), lw.ints([0]))
        out = lw.op("Or", out, lw.op("Less", positions, lw.unsqueeze(start, [1])))
    return lw.unsqueeze(lw.op("Where", out, masked, zero), [1, 2])


def _has_start(lw: Lowerer, mask: str, q: str) -> bool | None:
    """Whether a 1-D mask index ``(2B,)`` also holds start positions (``(B,)``: ends
    only); ``None`` when the batch or mask size is dynamic."""
    mask_dims, q_dims = lw.dims(mask), lw.dims(q)
    if mask_dims and q_dims and mask_dims[0] and q_dims[0]:
        return mask_dims[0] == 2 * q_dims[0]
    return None


def _int64_zero():
    return numpy_helper.from_array(np.zeros(1, dtype=np.int64))


def _masked_scores(lw, scores, q, k, mask, bias, ct, unidirectional, past="") -> str:
    filter_value = lw.attr("mask_filter_value", -10000.0)
    if mask:
        scores = lw.op("Add", scores, _padding_bias(lw, mask, q, k, ct, filter_value))
    if unidirectional:
        after = _causal(lw, q, k, past)
        causal = lw.op("Where", after, lw.const(filter_value, ct), lw.const(0.0, ct))
        scores = lw.op("Add", scores, causal)
    if bias:
        scores = lw.op("Add", scores, lw.to_compute(bias, lw.elem(bias)))
    return scores


def lower_attention(lw: Lowerer) -> None:
    x, weights, bias = lw.input(0), lw.input(1), lw.input(2)
    for attr in ("do_rotary", "past_present_share_buffer"):
        if lw.attr(attr, 0):
            raise lw.error(f"{attr}=1 is not supported")
    t = lw.elem(x)
    ct = lw.compute_type(t)
    heads = lw.attr("num_heads")
    projected = lw.op("MatMul", lw.to_compute(x, t), lw.to_compute(weights, t))
    if bias:
        projected = lw.op("Add", projected, lw.to_compute(bias, t))
    sizes = list(lw.attr("qkv_hidden_sizes", []) or [])
    if sizes:
        bounds = np.cumsum([0, *sizes])
        q, k, v = (lw.slice_last(projected, int(bounds[i]), int(bounds[i + 1])) for i in range(3))
        head_size = sizes[0] // heads
    else:
        q, k, v = lw.split_last(projected, 3)
        width = (lw.dims(weights) or [None, None])[1]
        head_size = width // (3 * heads) if width else None
    q, k, v = (_heads(lw, part, heads) for part in (q, k, v))
    past = lw.input(4)
    if past:
        past = lw.to_compute(past, t)
        k = lw.op("Concat", lw.op("Gather", past, lw.ints(0), axis=0), k, axis=2)
        v = lw.op("Concat", lw.op("Gather", past, lw.ints(1), axis=0), v, axis=2)
    scores = _scores(lw, q, k, _scale(lw, head_size), ct)
    scores = _masked_scores(
        lw, scores, q, k, lw.input(3), lw.input(5), ct, lw.attr("unidirectional", 0)
    )
    lw.finish(_merged(lw, _attend(lw, scores, v)), t)
    if lw.output(1):
        present = lw.op("Concat", lw.unsqueeze(k, [0]), lw.unsqueeze(v, [0]), axis=0)
        lw.finish(present, t, 1)


def lower_multi_head_attention(lw: Lowerer) -> None:
    query, key, value, bias = (lw.input(i) for i in range(4))
    if not key or lw.rank(query) != 3 or lw.rank(key) not in (3, 4):
        raise lw.error("packed query/key/value inputs are not supported")
    if lw.input(8) or lw.input(9):
        raise lw.error("past_sequence_length and cache_indirection are not supported")
    t = lw.elem(query)
    ct = lw.compute_type(t)
    heads = lw.attr("num_heads")
    q, k, v = (lw.to_compute(name, t) for name in (query, key, value))
    if bias:
        q, k, v = _biased(lw, bias, t, q, k, v, lw.rank(key) == 3)
    head_size = _head_size(lw, query, heads)
    q = _heads(lw, q, heads)
    if lw.rank(key) == 3:
        k, v = _heads(lw, k, heads), _heads(lw, v, heads)
    if lw.input(6):
        k = lw.op("Concat", lw.to_compute(lw.input(6), t), k, axis=2)
        v = lw.op("Concat", lw.to_compute(lw.input(7), t), v, axis=2)
    scores = _scores(lw, q, k, _scale(lw, head_size), ct)
    causal = lw.attr("unidirectional", 0)
    scores = _masked_scores(lw, scores, q, k, lw.input(4), lw.input(5), ct, causal, lw.input(6))
    lw.finish(_merged(lw, _attend(lw, scores, v)), t)
    lw.finish(k, t, 1)
    lw.finish(v, t, 2)


def _biased(lw, bias, t, q, k, v, key_is_3d):
    parts = lw.split_last(lw.to_compute(bias, t), 3)
    q = lw.op("Add", q, parts[0])
    if key_is_3d:
        k, v = lw.op("Add", k, parts[1]), lw.op("Add", v, parts[2])
    return q, k, v


def lower_group_query_attention(lw: Lowerer) -> None:
    if lw.attr("local_window_size", -1) != -1:
        raise lw.error(f"local_window_size={lw.attr('local_window_size')} is not supported")
    if lw.attr("smooth_softmax", 0) not in (0, -1):  # -1: the schema's default, off
        raise lw.error(f"smooth_softmax={lw.attr('smooth_softmax')} is not supported")
    if len(lw.node.input) > 11 and lw.input(11):
        raise lw.error("head_sink is not supported")
    query = lw.input(0)
    t = lw.elem(query)
    ct = lw.compute_type(t)
    heads, kv_heads = lw.attr("num_heads"), lw.attr("kv_num_heads")
    q, k, v = _gqa_qkv(lw, t, heads, kv_heads)
    if lw.attr("do_rotary", 0):
        q, k = _gqa_rotary(lw, q, k, ct)
    if lw.input(3):
        k = lw.op("Concat", lw.to_compute(lw.input(3), t), k, axis=2)
        v = lw.op("Concat", lw.to_compute(lw.input(4), t), v, axis=2)
    lw.finish(k, t, 1)
    lw.finish(v, t, 2)
    k_all, v_all = (_repeated(lw, x, heads // kv_heads) for x in (k, v))
    head_size = _head_size(lw, query, heads + (2 * kv_heads if not lw.input(1) else 0))
    scores = _scores(lw, q, k_all, _scale(lw, head_size), ct)
    softcap = lw.attr("softcap", 0.0)
    if softcap:
        capped = lw.op("Tanh", lw.op("Div", scores, lw.const(softcap, ct)))
        scores = lw.op("Mul", capped, lw.const(softcap, ct))
    if lw.input(10):
        scores = lw.op("Add", scores, lw.to_compute(lw.input(10), t))
    hidden = lw.op("Or", lw.unsqueeze(_causal(lw, q, k_all), [0, 1]), _beyond_seqlens(lw, k_all))
    lowest = lw.const(np.finfo(np_dtype(ct)).min, ct)
    bias = lw.op("Where", hidden, lowest, lw.const(0.0, ct))  # (B, 1, S, T), added: cheaper
    scores = lw.op("Add", scores, bias)
    lw.finish(_merged(lw, _attend(lw, scores, v_all)), t)


def _gqa_qkv(lw, t, heads, kv_heads):
    query, key, value = lw.input(0), lw.input(1), lw.input(2)
    if key:
        parts = [lw.to_compute(name, t) for name in (query, key, value)]
    else:
        parts = _unpacked_qkv(lw, lw.to_compute(query, t), heads, kv_heads)
    counts = (heads, kv_heads, kv_heads)
    return tuple(_heads(lw, x, n) for x, n in zip(parts, counts, strict=True))


def _unpacked_qkv(lw: Lowerer, packed: str, heads: int, kv_heads: int) -> list[str]:
    """``packed`` ``(B, S, (n + 2 n_kv) h)`` split into query, key and value: by static
    bounds when the width is known, else by sizes computed from its shape."""
    width = (lw.dims(packed) or [None])[-1]
    if width:
        size = width // (heads + 2 * kv_heads)
        bounds = [0, heads * size, (heads + kv_heads) * size, width]
        return [lw.slice_last(packed, bounds[i], bounds[i + 1]) for i in range(3)]
    unit = lw.op("Div", _length(lw, packed, -1), lw.ints([heads + 2 * kv_heads]))
    sizes = lw.op("Mul", unit, lw.ints([heads, kv_heads, kv_heads]))
    return lw.ops("Split", [packed, sizes], 3, axis=-1)


def _gqa_rotary(lw, q, k, ct):
    cos_cache, sin_cache = lw.input(7), lw.input(8)
    dims = lw.dims(cos_cache)
    if not dims or not dims[-1]:
        raise lw.error("rotary embedding needs a cos_cache of static width")
    if lw.input(9):
        positions = lw.input(9)
    else:
        total = lw.cast(lw.op("Reshape", lw.input(6), lw.ints([1])), TensorProto.INT64)
        start = lw.op("Sub", total, _length(lw, q, 2))
        positions = lw.unsqueeze(
            lw.op("Range", _scalar(lw, start), _scalar(lw, total), lw.ints(1)), [0]
        )
    cos = lw.unsqueeze(lw.op("Gather", cos_cache, positions), [1])
    sin = lw.unsqueeze(lw.op("Gather", sin_cache, positions), [1])
    if lw.elem(cos_cache) != ct:
        cos, sin = lw.cast(cos, ct), lw.cast(sin, ct)
    interleaved = lw.attr("rotary_interleaved", 0)
    return tuple(rotate(lw, x, cos, sin, 2 * dims[-1], interleaved) for x in (q, k))


def _repeated(lw: Lowerer, x: str, group: int) -> str:
    """``(B, n, T, h) -> (B, n g, T, h)``, each head repeated ``g`` times in a row."""
    if group == 1:
        return x
    shape = lw.op("Shape", x)
    expanded = lw.op("Unsqueeze", x, lw.ints([2]))
    target = lw.op(
        "Concat",
        lw.op("Slice", shape, lw.ints([0]), lw.ints([2]), lw.ints([0])),
        lw.ints([group]),
        lw.op("Slice", shape, lw.ints([2]), lw.ints([4]), lw.ints([0])),
        axis=0,
    )
    tiled = lw.op("Expand", expanded, target)
    merged = lw.op(
        "Concat",
        lw.op("Slice", shape, lw.ints([0]), lw.ints([1]), lw.ints([0])),
        lw.ints([-1]),
        lw.op("Slice", shape, lw.ints([2]), lw.ints([4]), lw.ints([0])),
        axis=0,
    )
    return lw.op("Reshape", tiled, merged)


def _beyond_seqlens(lw: Lowerer, k: str) -> str:
    """Boolean ``(B, 1, 1, T)``: key ``j`` past ``seqlens_k[b]``."""
    cols = lw.op("Range", lw.ints(0), _scalar(lw, _length(lw, k, 2)), lw.ints(1))
    last = lw.cast(lw.input(5), TensorProto.INT64)
    beyond = lw.op("Greater", lw.unsqueeze(cols, [0]), lw.unsqueeze(last, [1]))
    return lw.unsqueeze(beyond, [1, 2])


_ATTENTION = {"num_heads", "qkv_hidden_sizes", "scale", "mask_filter_value", "unidirectional"}
#: the rotary attributes of an Attention whose do_rotary=1 the lowering refuses
_ATTENTION_ROTARY = {"do_rotary", "past_present_share_buffer", "rotary_embedding_dim"}
_MHA = {"num_heads", "mask_filter_value", "scale", "unidirectional"}
_GQA = {
    *("num_heads", "kv_num_heads", "scale", "softcap", "do_rotary", "rotary_interleaved"),
    *("local_window_size", "smooth_softmax"),
}
#: GroupQueryAttention's other attributes (onnxruntime 1.32's schema) at the values that
#: change nothing: no quantized cache, no attention-score output, always causal
_GQA_NEUTRAL = {
    "causal": 1,
    "qk_output": 0,
    "k_quant_type": "NONE",
    "v_quant_type": "NONE",
    "kv_cache_bit_width": 0,
    "sliding_window_cache": 0,
}

ATTENTION_LOWERINGS = {
    (MS, "Attention"): reading_only(lower_attention, _ATTENTION | _ATTENTION_ROTARY),
    (MS, "MultiHeadAttention"): reading_only(lower_multi_head_attention, _MHA),
    (MS, "GroupQueryAttention"): reading_only(lower_group_query_attention, _GQA, _GQA_NEUTRAL),
}
