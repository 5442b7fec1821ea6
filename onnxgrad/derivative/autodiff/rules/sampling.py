r"""GridSample: ``y[n, c, o] = sum_p A_n[o, p] X[n, c, p]`` is linear in ``X`` for every
mode and padding mode, with interpolation weights ``A_n`` that only depend on the grid.
``A_n^T`` is obtained by sampling the ``P`` unit images (``P`` the number of input
positions) with the node's own grid and settings, so the gradient follows the runtime's
own GridSample exactly: :math:`\bar X_n = \bar y_n A_n`. It costs ``N P Q`` values (``Q``
the number of output positions): meant for the small images of grids and attention maps,
not for large ones. The grid's schema marks it non-differentiable; it gets no gradient.
"""

from __future__ import annotations

from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._nn_helpers import tensor_rank
from onnxgrad.derivative.autodiff.rules._shape_helpers import (
    as_tensor,
    filled,
    numel,
    reshape,
    reshape_like,
    shape_parts,
)

_ATTRIBUTES = ("align_corners", "mode", "padding_mode")


@register("GridSample", since=16)
def grid_sample_grad(b, node, grads, needs):
    (g,) = grads
    x, grid = node.inputs
    rank = tensor_rank(b, node, x)
    batch, *spatial = shape_parts(b, x, 0, 1) + shape_parts(b, x, 2)
    positions = numel(b, spatial)
    identity = b.op("EyeLike", filled(b, [positions, positions], 0, x))
    units = reshape(b, identity, [1, positions, *spatial])
    units = b.op("Expand", units, as_tensor(b, [batch, *[1] * (rank - 1)]))
    attrs = {name: node.attr(name) for name in _ATTRIBUTES if node.has_attr(name)}
    weights = reshape(b, b.op("GridSample", units, grid, **attrs), [batch, positions, -1])
    seeds = reshape(b, g, [batch, *shape_parts(b, x, 1, 2), -1])
    spread = b.op("MatMul", seeds, b.op("Transpose", weights, perm=[0, 2, 1]))
    return [reshape_like(b, spread, x), None]
