r"""BatchNormalization (inference and training mode), InstanceNormalization and LayerNormalization.

All three compute :math:`y = s \hat x + b` with :math:`\hat x = (x - \mu) r` and
:math:`r = 1 / \sqrt{v + \epsilon}`.

* BatchNormalization reads :math:`\mu, v` from its inputs (running statistics, shape ``(C,)``
  along axis 1); sums :math:`\Sigma` run over every axis but 1:
  :math:`\bar x = g s r`, :math:`\bar s = \Sigma g \hat x`, :math:`\bar b = \Sigma g`,
  :math:`\bar\mu = -s r \Sigma g`, :math:`\bar v = -\tfrac12 s r^3 \Sigma g (x - \mu)`.
* Instance and layer normalization compute :math:`\mu, v` from ``x`` over the normalized
  axes (:math:`D` elements, means :math:`\langle\cdot\rangle`); with :math:`h = g s`:
  :math:`\bar x = r (h - \langle h \rangle - \hat x \langle h \hat x \rangle)`.
  LayerNormalization's optional ``Mean`` and ``InvStdDev`` outputs also carry gradients
  :math:`g_\mu, g_r`: :math:`\bar x \mathrel{+}= (g_\mu - g_r r^2 \hat x) / D`.
"""

from __future__ import annotations

import numpy as np

from onnxgrad.derivative.autodiff.builder import GradBuilder
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._nn_helpers import (
    all_but_channel,
    cast_like,
    per_channel,
    tensor_rank,
    unsupported,
)


def _inverse_std(b: GradBuilder, variance: str, epsilon: float, like: str) -> str:
    return b.op("Reciprocal", b.op("Sqrt", b.add(variance, b.const(epsilon, like=like))))


def _normalized_input_grad(b: GradBuilder, h: str, xhat: str, inv: str, axes: list[int]) -> str:
    """``r * (h - <h> - xhat <h xhat>)``, means over ``axes``."""
    mean_h = b.reduce("ReduceMean", h, axes, keepdims=True)
    mean_hx = b.reduce("ReduceMean", b.mul(h, xhat), axes, keepdims=True)
    return b.mul(inv, b.op("Sub", b.op("Sub", h, mean_h), b.mul(xhat, mean_hx)))


def moments(b: GradBuilder, x: str, axes: list[int], epsilon: float) -> tuple[str, str]:
    """Mean and inverse standard deviation of ``x`` over ``axes`` (kept)."""
    mean = b.reduce("ReduceMean", x, axes, keepdims=True)
    centered = b.op("Sub", x, mean)
    variance = b.reduce("ReduceMean", b.mul(centered, centered), axes, keepdims=True)
    return mean, _inverse_std(b, variance, epsilon, x)


# -- BatchNormalization -----------------------------------------------------------------------
@register("BatchNormalization", since=11)
def batch_normalization_grad(b, node, grads, needs):
    if node.opset >= 14 and node.attr("training_mode", 0):
        return _batch_normalization_training_grad(b, node, grads, needs)
    if len([o for o in node.outputs if o]) > 1:
        raise unsupported(node, "training outputs before opset 14 (saved mean and variance)")
    g = grads[0]
    if g is None:
        return [None] * 5
    x, scale, bias, mean, var = node.inputs
    rank = tensor_rank(b, node, x)
    axes = all_but_channel(rank)
    inv = _inverse_std(b, cast_like(b, var, x), node.attr("epsilon", 1e-5), x)
    results = [None] * 5
    if needs[0] or needs[3] or needs[4]:
        gain = b.mul(cast_like(b, scale, x), inv)
    if needs[0]:
        results[0] = b.mul(g, per_channel(b, gain, rank))
    if needs[2] or needs[3]:
        total = b.reduce_sum(g, axes, keepdims=False)
        if needs[2]:
            results[2] = cast_like(b, total, bias, v_like=x)
        if needs[3]:
            results[3] = cast_like(b, b.neg(b.mul(total, gain)), mean, v_like=x)
    if needs[1] or needs[4]:
        centered = b.op("Sub", x, per_channel(b, cast_like(b, mean, x), rank))
        moment = b.reduce_sum(b.mul(g, centered), axes, keepdims=False)
        if needs[1]:
            results[1] = cast_like(b, b.mul(moment, inv), scale, v_like=x)
        if needs[4]:
            half_cube = b.mul(b.mul(inv, inv), b.const(-0.5, like=x))
            results[4] = cast_like(b, b.mul(b.mul(moment, gain), half_cube), var, v_like=x)
    return results


def _batch_normalization_training_grad(b, node, grads, needs):
    r"""``training_mode=1``: :math:`\mu, v` are the batch mean and (biased) variance, the
    running statistics :math:`m' = \alpha m + (1 - \alpha) \mu`,
    :math:`v' = \alpha v_{in} + (1 - \alpha) v`. With :math:`D` elements per channel:
    :math:`\bar x = r (h - \langle h \rangle - \hat x \langle h \hat x \rangle)
    + (1 - \alpha) (g_{m'} + 2 g_{v'} (x - \mu)) / D`, :math:`\bar m = \alpha g_{m'}`,
    :math:`\bar v_{in} = \alpha g_{v'}`."""
    g, g_mean, g_var = [*grads, None, None][:3]
    x, scale = node.inputs[0], node.inputs[1]
    rank = tensor_rank(b, node, x)
    axes = all_but_channel(rank)
    momentum = node.attr("momentum", 0.9)
    results = [None] * 5
    mean, inv = moments(b, x, axes, node.attr("epsilon", 1e-5))
    centered = b.op("Sub", x, mean)
    parts = []
    if g is not None:
        xhat = b.mul(centered, inv)
        if needs[0]:
            h = b.mul(g, per_channel(b, cast_like(b, scale, x), rank))
            parts.append(_normalized_input_grad(b, h, xhat, inv, axes))
        if needs[1]:
            total = b.reduce_sum(b.mul(g, xhat), axes, keepdims=False)
            results[1] = cast_like(b, total, scale, v_like=x)
        if needs[2]:
            results[2] = cast_like(b, b.reduce_sum(g, axes, False), node.inputs[2], v_like=x)
    for k, g_running in ((3, g_mean), (4, g_var)):
        if g_running is None:
            continue
        running = node.inputs[k]
        if needs[k]:
            results[k] = b.mul(g_running, b.const(momentum, like=running))
        if needs[0]:
            share = per_channel(b, cast_like(b, g_running, x, v_like=running), rank)
            if k == 4:
                share = b.mul(b.mul(share, centered), b.const(2.0, like=x))
            parts.append(b.op("Div", b.mul(share, b.const(1 - momentum, like=x)), _count(b, x, g)))
    if parts:
        results[0] = parts[0] if len(parts) == 1 else b.op("Sum", *parts)
    return results


def _count(b: GradBuilder, x: str, like: str | None) -> str:
    """The number of elements per channel, as a scalar of ``x``'s type."""
    shape = b.static_shape(x)
    if shape is not None:
        return b.const(float(np.prod(shape) // shape[1]), like=x)
    per_channel_count = b.op("Div", b.op("Size", x), b.op("Gather", b.shape_of(x), b.ints(1)))
    return b.op("Cast", per_channel_count, to=b.dtype(x))


# -- InstanceNormalization --------------------------------------------------------------------
@register("InstanceNormalization", since=11)
def instance_normalization_grad(b, node, grads, needs):
    (g,) = grads
    x, scale = node.inputs[0], node.inputs[1]
    rank = tensor_rank(b, node, x)
    spatial = list(range(2, rank))
    mean, inv = moments(b, x, spatial, node.attr("epsilon", 1e-5))
    xhat = b.mul(b.op("Sub", x, mean), inv)
    channel_sum = all_but_channel(rank)
    return [
        _normalized_input_grad(b, b.mul(g, per_channel(b, scale, rank)), xhat, inv, spatial)
        if needs[0]
        else None,
        b.reduce_sum(b.mul(g, xhat), channel_sum, keepdims=False) if needs[1] else None,
        b.reduce_sum(g, channel_sum, keepdims=False) if needs[2] else None,
    ]


# -- LayerNormalization -----------------------------------------------------------------------
@register("LayerNormalization", since=17)
def layer_normalization_grad(b, node, grads, needs):
    x, scale, bias = node.inputs[0], node.inputs[1], node.input(2)
    rank = tensor_rank(b, node, x)
    first = node.attr("axis", -1) % rank
    axes = list(range(first, rank))
    mean, inv = moments(b, x, axes, node.attr("epsilon", 1e-5))
    xhat = b.mul(b.op("Sub", x, mean), inv)
    g, g_mean, g_inv = [*grads, None, None][:3]
    y_shape = b.shape(node.outputs[0])
    results = [None] * len(node.inputs)
    if needs[0]:
        results[0] = _layer_input_grad(b, x, scale, g, g_mean, g_inv, mean, inv, xhat, axes)
    if g is not None and needs[1]:
        results[1] = b.unbroadcast(b.mul(g, xhat), scale, y_shape)
    if g is not None and bias is not None and needs[2]:
        results[2] = b.unbroadcast(g, bias, y_shape)
    return results


def _layer_input_grad(b, x, scale, g, g_mean, g_inv, mean, inv, xhat, axes) -> str | None:
    parts = []
    if g is not None:
        parts.append(_normalized_input_grad(b, b.mul(g, scale), xhat, inv, axes))
    if g_mean is not None or g_inv is not None:
        through = cast_like(b, g_mean, x) if g_mean is not None else None
        if g_inv is not None:
            slope = b.mul(b.mul(cast_like(b, g_inv, x), b.mul(inv, inv)), xhat)
            through = b.neg(slope) if through is None else b.op("Sub", through, slope)
        through = b.mul(through, _inverse_count(b, x, mean, axes))
        if g is None and g_inv is None:
            through = b.op("Expand", through, b.shape_of(x))
        parts.append(through)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else b.add(*parts)


def _inverse_count(b: GradBuilder, x: str, mean: str, axes: list[int]) -> str:
    """``1 / D``, D the number of normalized elements per mean."""
    shape = b.static_shape(x)
    if shape is not None:
        return b.const(1.0 / max(int(np.prod([shape[a] for a in axes])), 1), like=x)
    count = b.op("Div", b.op("Size", x), b.op("Size", mean))
    return b.op("Reciprocal", b.op("Cast", count, to=b.dtype(x)))


# -- LpNormalization, LRN ---------------------------------------------------------------------
@register("LpNormalization", since=11)
def lp_normalization_grad(b, node, grads, needs):
    r"""``y = x / n`` with ``n = ||x||_p`` along ``axis`` (``p`` 1 or 2):
    :math:`\bar x = (g - d \sum g y) / n` with :math:`d = y` for ``p = 2``,
    :math:`\operatorname{sign}(x)` for ``p = 1``; 0 where ``n = 0`` (the forward gives
    ``y = 0`` there). The division is by ``n`` with its zeros replaced by 1, so that the
    masked entries are finite in every derivative of this graph too (the transposition that
    gives ``onnx_jvp`` would otherwise divide a zero tangent by ``n = 0``: NaN)."""
    (g,) = grads
    x, y = node.inputs[0], node.outputs[0]
    axes = [node.attr("axis", -1)]
    p = node.attr("p", 2)
    if p not in (1, 2):
        raise unsupported(node, f"p={p}")
    if p == 2:
        norm = b.reduce("ReduceL2", x, axes, keepdims=True)
    else:
        norm = b.reduce_sum(b.op("Abs", x), axes, keepdims=True)
    direction = y if p == 2 else b.op("Sign", x)
    total = b.reduce_sum(b.mul(g, y), axes, keepdims=True)
    zero = b.const(0, like=x)
    vanishes = b.op("Equal", norm, zero)
    safe_norm = b.op("Where", vanishes, b.const(1, like=x), norm)
    grad = b.op("Div", b.op("Sub", g, b.mul(direction, total)), safe_norm)
    return [b.op("Where", vanishes, zero, grad)]


@register("LRN", since=11)
def lrn_grad(b, node, grads, needs):
    r"""``y = x s^{-\beta}`` with ``s = k + \alpha / n \cdot W(x^2)``, ``W`` the sum over
    the channel window ``[c - \lfloor (n-1)/2 \rfloor, c + \lceil (n-1)/2 \rceil]``:
    :math:`\bar x = g s^{-\beta} - 2 \alpha \beta / n \cdot x\, W^T(g y / s)`, ``W^T`` the
    window sum with its two sides swapped."""
    (g,) = grads
    x, y = node.inputs[0], node.outputs[0]
    size = node.attr("size")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    rank = tensor_rank(b, node, x)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    window = _channel_window_sum(b, b.mul(x, x), before, after, rank)
    s = b.add(b.mul(window, b.const(alpha / size, like=x)), b.const(bias, like=x))
    direct = b.mul(g, b.op("Pow", s, b.const(-beta, like=x)))
    spread = _channel_window_sum(b, b.op("Div", b.mul(g, y), s), after, before, rank)
    scale = b.const(-2.0 * alpha * beta / size, like=x)
    return [b.add(direct, b.mul(b.mul(spread, x), scale))]


def _channel_window_sum(b: GradBuilder, t: str, before: int, after: int, rank: int) -> str:
    """``sum_{d = -before}^{after} t[:, c + d]`` (zero outside the channels)."""
    padded = b.op("Pad", t, b.ints([0, before] + [0] * (rank - 2) + [0, after] + [0] * (rank - 2)))
    width = before + after
    total = None
    for k in range(width + 1):
        end = k - width if k < width else np.iinfo(np.int64).max
        piece = b.op("Slice", padded, b.ints([k]), b.ints([end]), b.ints([1]))
        total = piece if total is None else b.add(total, piece)
    return total
