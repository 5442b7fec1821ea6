r"""DequantizeLinear, ``y = (x - z) s`` with ``s`` the scale broadcast per tensor, per axis
or per block: ``x`` and ``z`` are integers (or float8 codes), so only the scale has a
gradient, :math:`\bar s = \sum g (x - z)` over the elements each scale entry multiplies.
``x - z`` is DequantizeLinear itself with a scale of ones (the op does the broadcasting)."""

from __future__ import annotations

from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._nn_helpers import unsupported
from onnxgrad.derivative.autodiff.rules._shape_helpers import (
    normalize_axis,
    require_rank,
    reshape_like,
    zeros_like,
)


@register("DequantizeLinear", since=11)
def dequantize_linear_grad(b, node, grads, needs):
    (g,) = grads
    results = [None, None, None]
    if not needs[1]:
        return results
    x, scale = node.inputs[0], node.inputs[1]
    ones = b.op("Add", zeros_like(b, scale), b.const(1, like=scale))
    attrs = {name: node.attr(name) for name in ("axis", "block_size", "output_dtype")}
    product = b.mul(g, b.op("DequantizeLinear", x, ones, node.input(2), **attrs))
    scale_rank = require_rank(b, scale, node)
    rank = require_rank(b, x, node)
    if scale_rank == 0 or b.shape(scale) == (1,):
        total = b.reduce_sum(product, None, keepdims=False)
    elif node.attr("block_size", 0):
        total = _block_sums(b, node, product, x, rank)
    else:
        axis = normalize_axis(node.attr("axis", 1), rank)
        total = b.reduce_sum(product, [a for a in range(rank) if a != axis], keepdims=False)
    results[1] = reshape_like(b, total, scale)
    return results


def _block_sums(b, node, product: str, x: str, rank: int) -> str:
    """Sums over consecutive blocks of ``block_size`` along ``axis`` (the last one shorter)."""
    shape = b.static_shape(x)
    if shape is None:
        raise unsupported(node, "blocked quantization of an input of unknown shape")
    axis = normalize_axis(node.attr("axis", 1), rank)
    block = node.attr("block_size")
    blocks = -(-shape[axis] // block)
    missing = blocks * block - shape[axis]
    if missing:
        pads = [0] * (2 * rank)
        pads[rank + axis] = missing
        product = b.op("Pad", product, b.ints(pads))
    split = [*shape[:axis], blocks, block, *shape[axis + 1 :]]
    return b.reduce_sum(b.op("Reshape", product, b.ints(split)), [axis + 1], keepdims=False)
