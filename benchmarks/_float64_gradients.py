r"""Float64 numpy gradients for the ``ops`` sweep's HVP check (:mod:`benchmarks._modes_ops`)
on operators whose ONNX function body keeps some float32 arithmetic in a float64 model.

The HVP is judged against central differences of the reverse gradient ``G``. Where
onnxgrad's gradient graph comes from the function body, and that body computes its
statistics in ``stash_type`` (float32 by default) while the case runs in float64, ``G``
carries float32 rounding (~1e-7 relative), which quotients at step 1e-6 magnify to ~0.1:
the one-sided differences then disagree and the case has no judged point. These functions
compute ``G`` of the same operator in float64 with numpy instead, independently of onnxgrad.

RMSNormalization (opset 23), normalised axes ``A = [axis, rank)`` of ``n`` entries in all,
``r = sqrt(mean_A(x^2) + epsilon)``, ``y = x / r * w`` and the output gradient ``g``:

.. math::
    \bar x = \frac{g w}{r} - x \frac{\sum_A g w x}{n r^3}, \qquad
    \bar w = \sum_{\text{broadcast axes}} \frac{g x}{r}.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import ModelProto, TensorProto, helper

#: ``(node, {input: value}, output gradient) -> {input: gradient}``
Gradient = Callable[..., dict[str, np.ndarray]]


def float64_gradient(model: ModelProto) -> Callable[[dict, list], dict[str, np.ndarray]] | None:
    """``(point, output gradients) -> {input: gradient}`` of a single-node float64 ``model``
    whose operator has a numpy gradient here, else ``None``."""
    graph = model.graph
    if len(graph.node) != 1 or graph.node[0].op_type not in _GRADIENTS:
        return None
    if any(i.type.tensor_type.elem_type != TensorProto.DOUBLE for i in graph.input):
        return None
    node = graph.node[0]
    rule = _GRADIENTS[node.op_type]
    return lambda point, seeds: rule(node, point, seeds[0])


def _rms_normalization(node, point: dict, g: np.ndarray) -> dict[str, np.ndarray]:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    x, w = point[node.input[0]], point[node.input[1]]
    axis = attributes.get("axis", -1) % x.ndim
    axes = tuple(range(axis, x.ndim))
    n = int(np.prod(x.shape[axis:]))
    r = np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + attributes.get("epsilon", 1e-5))
    u = g * w
    x_grad = u / r - x * np.sum(u * x, axis=axes, keepdims=True) / (n * r**3)
    return {node.input[0]: x_grad, node.input[1]: _unbroadcast(g * x / r, w.shape)}


def _unbroadcast(value: np.ndarray, shape: tuple) -> np.ndarray:
    """``value`` summed over the axes that numpy broadcasting added to ``shape``."""
    value = value.sum(axis=tuple(range(value.ndim - len(shape))))
    stretched = tuple(k for k, size in enumerate(shape) if size == 1 and value.shape[k] != 1)
    return value.sum(axis=stretched, keepdims=True)


_GRADIENTS: dict[str, Gradient] = {"RMSNormalization": _rms_normalization}
