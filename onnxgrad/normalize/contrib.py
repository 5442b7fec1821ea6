r"""onnxruntime's fused transformer operators (``com.microsoft``) lowered to standard ONNX.

Each lowering computes what onnxruntime's CPU kernel computes (float16 and bfloat16 in
float32, cast back, as those kernels do), so every gradient rule applies to the result:

- ``Gelu(x) = x/2 (1 + erf(x/\sqrt2))``; ``BiasGelu(a, b) = Gelu(a + b)``;
  ``FastGelu(x, b) = u/2 (1 + tanh(\sqrt{2/\pi}(u + 0.044715 u^3)))``, ``u = x + b``;
  ``QuickGelu(x) = x \sigma(\alpha x)``; ``BiasAdd(x, b, s) = x + b + s``;
  ``BiasSplitGelu(x, b)``: ``[l, r] = x + b`` halved on the last axis, ``l Gelu(r)``.
- ``FusedMatMul(A, B) = \alpha\, op(A)\, op(B)`` with the transpositions of its attributes.
- ``SkipLayerNormalization``: ``s = x + skip + bias`` (an output too, with the mean and
  inverse standard deviation, zero means for the simplified form, as the kernel),
  ``y = (s - \mu)/\sqrt{\sigma^2 + \epsilon}\, \gamma + \beta``; the ``Simplified`` forms
  (RMS norm) use ``y = s/\sqrt{mean(s^2) + \epsilon}\, \gamma``;
  ``SimplifiedLayerNormalization`` is also read in the default domain, where onnxruntime
  registers it.
- ``EmbedLayerNormalization``: layer norm of ``W[ids] + P[positions] + T[segments]``, the
  mask index being the row sums of the mask.

The attention operators live in :mod:`onnxgrad.normalize.attention`, ``RotaryEmbedding``
in :mod:`onnxgrad.normalize.rotary`.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import ModelProto, TensorProto, numpy_helper

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.normalize.attention import ATTENTION_LOWERINGS
from onnxgrad.normalize.lowering import Lowerer, lower_nodes, reading_only
from onnxgrad.normalize.rotary import lower_rotary_embedding

MS = "com.microsoft"


def _gelu(lw: Lowerer, x: str, t: int) -> str:
    inner = lw.op("Erf", lw.op("Mul", x, lw.const(1 / math.sqrt(2), t)))
    one_plus = lw.op("Add", inner, lw.const(1.0, t))
    return lw.op("Mul", lw.op("Mul", x, lw.const(0.5, t)), one_plus)


def _plus_bias(lw: Lowerer, x: str, *more: str) -> str:
    for name in more:
        if name:
            x = lw.op("Add", x, name)
    return x


def lower_gelu(lw: Lowerer) -> None:
    t = lw.elem(lw.input(0))
    ct = lw.compute_type(t)
    x = lw.to_compute(lw.input(0), t)
    if lw.input(1):
        x = lw.op("Add", x, lw.to_compute(lw.input(1), t))
    lw.finish(_gelu(lw, x, ct), t)


def lower_fast_gelu(lw: Lowerer) -> None:
    t = lw.elem(lw.input(0))
    ct = lw.compute_type(t)
    x = lw.to_compute(lw.input(0), t)
    if lw.input(1):
        x = lw.op("Add", x, lw.to_compute(lw.input(1), t))
    cube = lw.op("Mul", lw.op("Mul", x, x), x)
    inner = lw.op("Add", x, lw.op("Mul", cube, lw.const(0.044715, ct)))
    tanh = lw.op("Tanh", lw.op("Mul", inner, lw.const(math.sqrt(2 / math.pi), ct)))
    half_x = lw.op("Mul", x, lw.const(0.5, ct))
    lw.finish(lw.op("Mul", half_x, lw.op("Add", tanh, lw.const(1.0, ct))), t)


def lower_quick_gelu(lw: Lowerer) -> None:
    t = lw.elem(lw.input(0))
    ct = lw.compute_type(t)
    x = lw.to_compute(lw.input(0), t)
    gate = lw.op("Sigmoid", lw.op("Mul", x, lw.const(lw.attr("alpha", 1.702), ct)))
    lw.finish(lw.op("Mul", x, gate), t)


def lower_bias_add(lw: Lowerer) -> None:
    t = lw.elem(lw.input(0))
    inputs = [lw.to_compute(lw.input(i), t) for i in range(3)]
    lw.finish(_plus_bias(lw, *inputs), t)


def lower_bias_split_gelu(lw: Lowerer) -> None:
    t = lw.elem(lw.input(0))
    ct = lw.compute_type(t)
    x = lw.op("Add", lw.to_compute(lw.input(0), t), lw.to_compute(lw.input(1), t))
    left, right = lw.split_last(x, 2)
    lw.finish(lw.op("Mul", left, _gelu(lw, right, ct)), t)


def lower_fused_matmul(lw: Lowerer) -> None:
    a = _transposed(lw, lw.input(0), lw.attr("transA", 0), lw.attr("transBatchA", 0))
    b = _transposed(lw, lw.input(1), lw.attr("transB", 0), lw.attr("transBatchB", 0))
    alpha = lw.attr("alpha", 1.0)
    if alpha == 1.0:
        lw.op("MatMul", a, b, out=lw.output(0))
        return
    product = lw.op("MatMul", a, b)
    lw.op("Mul", product, lw.const(alpha, lw.elem(lw.input(0))), out=lw.output(0))


def _transposed(lw: Lowerer, x: str, trans: int, trans_batch: int) -> str:
    """``x`` with its first axis moved behind the batch axes (``trans_batch``), then its
    last two axes swapped (``trans``)."""
    if not trans and not trans_batch:
        return x
    rank = lw.rank(x)
    perm = list(range(rank))
    if trans_batch and rank > 2:
        perm = [*range(1, rank - 1), 0, rank - 1]
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return lw.op("Transpose", x, perm=perm)


def _normalized(lw: Lowerer, s: str, ct: int, axes: list[int], eps: float, simplified: bool):
    """``(y, mean, inverse std)`` of ``s`` over ``axes`` (RMS when ``simplified``)."""
    if simplified:
        mean = None
        centred = s
    else:
        mean = lw.reduce_mean(s, axes)
        centred = lw.op("Sub", s, mean)
    var = lw.reduce_mean(lw.op("Mul", centred, centred), axes)
    inv = lw.op("Reciprocal", lw.op("Sqrt", lw.op("Add", var, lw.const(eps, ct))))
    return lw.op("Mul", centred, inv), mean, inv


def _affine(lw: Lowerer, y: str, t: int, gamma: str, beta: str) -> str:
    y = lw.op("Mul", y, lw.to_compute(gamma, lw.elem(gamma)))
    if beta:
        y = lw.op("Add", y, lw.to_compute(beta, lw.elem(beta)))
    return y


def _stat_output(lw: Lowerer, value: str | None, index: int) -> None:
    if lw.output(index) and value is not None:
        lw.cast(value, TensorProto.FLOAT, out=lw.output(index))


def _lower_skip_norm(lw: Lowerer, simplified: bool) -> None:
    t = lw.elem(lw.input(0))
    ct = lw.compute_type(t)
    gamma = lw.input(2)
    beta, bias = ("", lw.input(3)) if simplified else (lw.input(3), lw.input(4))
    parts = [lw.to_compute(lw.input(i), t) for i in (0, 1)]
    s = _plus_bias(lw, *parts, lw.to_compute(bias, t) if bias else "")
    y, mean, inv = _normalized(lw, s, ct, [-1], lw.attr("epsilon", 1e-12), simplified)
    lw.finish(_affine(lw, y, t, gamma, beta), t)
    if simplified and lw.output(1):
        mean = lw.op("ConstantOfShape", lw.op("Shape", inv), value=_zero(TensorProto.FLOAT))
    _stat_output(lw, mean, 1)
    _stat_output(lw, inv, 2)
    lw.finish(s, t, 3)


def lower_skip_layer_norm(lw: Lowerer) -> None:
    _lower_skip_norm(lw, simplified=False)


def lower_skip_simplified_layer_norm(lw: Lowerer) -> None:
    _lower_skip_norm(lw, simplified=True)


def lower_simplified_layer_norm(lw: Lowerer) -> None:
    x = lw.input(0)
    t = lw.elem(x)
    axis = lw.attr("axis", -1)
    axes = [-1] if axis == -1 else list(range(axis % lw.rank(x), lw.rank(x)))
    ct = TensorProto.FLOAT if lw.attr("stash_type", 1) == 1 else lw.compute_type(t)
    xc = x if ct == t else lw.cast(x, ct)
    y, _, inv = _normalized(lw, xc, ct, axes, lw.attr("epsilon", 1e-5), simplified=True)
    y = y if ct == t else lw.cast(y, t)
    scale = lw.input(1)
    lw.op("Mul", y, scale, out=lw.output(0))
    _stat_output(lw, inv, 1)


def lower_embed_layer_norm(lw: Lowerer) -> None:
    ids = lw.input(0)
    word, position, segment = lw.input(2), lw.input(3), lw.input(4)
    t = lw.elem(word)
    ct = lw.compute_type(t)
    total = lw.op("Gather", word, ids)
    positions = lw.input(8) or _arange_like_columns(lw, ids)
    total = lw.op("Add", total, lw.op("Gather", position, positions))
    if segment and lw.input(1):
        total = lw.op("Add", total, lw.op("Gather", segment, lw.input(1)))
    s = lw.to_compute(total, t)
    y, _, _ = _normalized(lw, s, ct, [-1], lw.attr("epsilon", 1e-12), simplified=False)
    lw.finish(_affine(lw, y, t, lw.input(5), lw.input(6)), t)
    if lw.output(1):
        _mask_index(lw, ids)
    if lw.output(2):
        lw.op("Identity", total, out=lw.output(2))


def _arange_like_columns(lw: Lowerer, ids: str) -> str:
    """``[[0, 1, ..., S-1]]`` for ids of shape ``(B, S)``."""
    length = lw.op("Gather", lw.op("Shape", ids), lw.ints(1), axis=0)
    steps = lw.op("Range", lw.ints(0), length, lw.ints(1))
    return lw.unsqueeze(steps, [0])


def _mask_index(lw: Lowerer, ids: str) -> None:
    """Row sums of the mask (int32), zeros without a mask: 1-D ``(B,)`` by the operator's
    specification, declared so (a ``ReduceSum`` whose axes are an input may leave its rank
    unknown to onnx's inference)."""
    mask = lw.input(7)
    if mask:
        sums = lw.builder.reduce("ReduceSum", lw.cast(mask, TensorProto.INT32), [1])
        lw.op("Identity", sums, out=lw.output(1))
    else:
        batch = lw.op("Gather", lw.op("Shape", ids), lw.ints([0]), axis=0)
        lw.op("ConstantOfShape", batch, out=lw.output(1), value=_zero(TensorProto.INT32))
    lw.declare(lw.output(1), TensorProto.INT32, (lw.dims(ids) or [None])[:1])


def _zero(elem_type: int) -> TensorProto:
    return numpy_helper.from_array(np.zeros(1, dtype=np_dtype(elem_type)))


_EPSILON = {"epsilon"}
_FUSED_MATMUL = {"alpha", "transA", "transB", "transBatchA", "transBatchB"}
_ROTARY = {"interleaved", "is_packed_batching", "num_heads", "rotary_embedding_dim"}

#: each lowering with the attributes it reads (onnxruntime's schemas): any other one set is
#: refused by name (:func:`~onnxgrad.normalize.lowering.reading_only`)
CONTRIB_LOWERINGS = {
    (MS, "Gelu"): reading_only(lower_gelu, set()),
    (MS, "BiasGelu"): reading_only(lower_gelu, set()),
    (MS, "FastGelu"): reading_only(lower_fast_gelu, set()),
    (MS, "QuickGelu"): reading_only(lower_quick_gelu, {"alpha"}),
    (MS, "BiasAdd"): reading_only(lower_bias_add, set()),
    (MS, "BiasSplitGelu"): reading_only(lower_bias_split_gelu, set()),
    (MS, "FusedMatMul"): reading_only(lower_fused_matmul, _FUSED_MATMUL),
    (MS, "SkipLayerNormalization"): reading_only(lower_skip_layer_norm, _EPSILON),
    (MS, "SkipSimplifiedLayerNormalization"): reading_only(
        lower_skip_simplified_layer_norm, _EPSILON
    ),
    ("", "SimplifiedLayerNormalization"): reading_only(
        lower_simplified_layer_norm, {"axis", "epsilon", "stash_type"}
    ),
    (MS, "EmbedLayerNormalization"): reading_only(
        lower_embed_layer_norm, {"epsilon", "mask_index_type"}
    ),
    (MS, "RotaryEmbedding"): reading_only(lower_rotary_embedding, _ROTARY, {"scale": 1.0}),
    **ATTENTION_LOWERINGS,
}


def lowered_contrib(model: ModelProto) -> ModelProto:
    """``model`` with onnxruntime's fused transformer operators lowered (module docstring)."""
    return lower_nodes(model, CONTRIB_LOWERINGS)
