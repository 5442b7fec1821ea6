"""Central finite differences in float64: the independent reference of gradient tests.

For a function ``f`` with outputs ``y_k`` and output gradients (seeds) ``g_k``, the
vector-Jacobian product with respect to an input ``x`` is the gradient of the scalar
``s(x) = sum_k <g_k, y_k(x)>``, estimated element by element with
``ds/dx_i ~ (s(x + eps e_i) - s(x - eps e_i)) / (2 eps)`` (error ``O(eps^2)``).

``f`` is any numpy callable ``feeds -> outputs`` or an ONNX model evaluated by
:class:`onnx.reference.ReferenceEvaluator` after its float tensors are cast to double.
Initializers of an ONNX model are overridden by feeds of the same name, so weights are
differentiated like inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, ModelProto, TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from tests.derivative.reference_conv import CONV_OPS

Feeds = Mapping[str, np.ndarray]
Function = Callable[[Feeds], Sequence[np.ndarray]]

_TO_DOUBLE = {TensorProto.FLOAT: TensorProto.DOUBLE, TensorProto.FLOAT16: TensorProto.DOUBLE}
_DTYPE_ATTRIBUTES = {"to", "dtype"}


def to_double(model: ModelProto) -> ModelProto:
    """A copy of ``model`` computing in float64 wherever it computed in float32/float16."""
    copy = ModelProto()
    copy.CopyFrom(model)
    _graph_to_double(copy.graph)
    return copy


def _graph_to_double(graph: GraphProto) -> None:
    for info in [*graph.input, *graph.output]:
        tensor = info.type.tensor_type
        tensor.elem_type = _TO_DOUBLE.get(tensor.elem_type, tensor.elem_type)
    del graph.value_info[:]
    for index, init in enumerate(graph.initializer):
        graph.initializer[index].CopyFrom(_tensor_to_double(init))
    for node in graph.node:
        for attr in node.attribute:
            _attribute_to_double(node, attr)


def _tensor_to_double(tensor: TensorProto) -> TensorProto:
    if tensor.data_type not in _TO_DOUBLE:
        return tensor
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name)


def _attribute_to_double(node: onnx.NodeProto, attr: AttributeProto) -> None:
    if attr.type == AttributeProto.TENSOR:
        attr.t.CopyFrom(_tensor_to_double(attr.t))
    elif attr.type == AttributeProto.GRAPH:
        _graph_to_double(attr.g)
    elif attr.type == AttributeProto.GRAPHS:
        for sub in attr.graphs:
            _graph_to_double(sub)
    elif attr.type == AttributeProto.INT and attr.name in _DTYPE_ATTRIBUTES:
        attr.i = _TO_DOUBLE.get(attr.i, attr.i)
    elif node.op_type == "Constant" and attr.name in ("value_float", "value_floats"):
        values = np.array(attr.f if attr.name == "value_float" else list(attr.floats))
        tensor = numpy_helper.from_array(values.astype(np.float64))
        attr.CopyFrom(helper.make_attribute("value", tensor))


def onnx_function(model: ModelProto, outputs: Sequence[str] | None = None) -> Function:
    """``feeds -> outputs`` evaluating ``model`` in float64 with the reference evaluator.

    Feeds may override initializers; float feeds are cast to float64.
    """
    evaluator = ReferenceEvaluator(to_double(model), new_ops=CONV_OPS)
    names = list(outputs) if outputs is not None else None

    def run(feeds: Feeds) -> list[np.ndarray]:
        doubled = {k: _as_double(v) for k, v in feeds.items()}
        return [np.asarray(y) for y in evaluator.run(names, doubled)]

    return run


def _as_double(value: np.ndarray) -> np.ndarray:
    value = np.asarray(value)
    return value.astype(np.float64) if np.issubdtype(value.dtype, np.floating) else value


def numerical_vjp(
    function: Function,
    feeds: Feeds,
    wrt: Sequence[str],
    seeds: Sequence[np.ndarray | None] | None = None,
    eps: float = 1e-6,
) -> dict[str, np.ndarray]:
    """``{x: d/dx sum_k <g_k, y_k>}`` for each ``x`` in ``wrt`` (float64 arrays).

    :param seeds: the output gradients ``g_k``, one per output; ``None`` (for all or for
        one output) means ones, i.e. the gradient of the sum of the outputs; outputs that
        are not floats are ignored.
    """
    base = {k: _as_double(v) for k, v in feeds.items()}
    outputs = function(base)
    if seeds is None:
        seeds = [None] * len(outputs)
    if len(seeds) != len(outputs):
        raise ValueError(f"{len(seeds)} seeds for {len(outputs)} outputs")
    weights = [
        np.ones_like(y, dtype=np.float64) if g is None else np.asarray(g, dtype=np.float64)
        for g, y in zip(seeds, outputs)
    ]

    def objective(values: Feeds) -> float:
        return sum(
            float(np.sum(g * y))
            for g, y in zip(weights, function(values))
            if np.issubdtype(np.asarray(y).dtype, np.floating)
        )

    gradients = {}
    for name in wrt:
        point = base[name]
        gradient = np.zeros_like(point, dtype=np.float64)
        for index in np.ndindex(point.shape):
            shifted = {}
            for sign in (1, -1):
                moved = point.copy()
                moved[index] += sign * eps
                shifted[sign] = objective({**base, name: moved})
            gradient[index] = (shifted[1] - shifted[-1]) / (2 * eps)
        gradients[name] = gradient
    return gradients


def onnx_numerical_vjp(
    model: ModelProto,
    feeds: Feeds,
    wrt: Sequence[str],
    seeds: Sequence[np.ndarray | None] | None = None,
    outputs: Sequence[str] | None = None,
    eps: float = 1e-6,
) -> dict[str, np.ndarray]:
    """:func:`numerical_vjp` of an ONNX model; ``feeds`` must hold every name in ``wrt``
    (inputs, or initializers to differentiate as weights)."""
    missing = [name for name in wrt if name not in feeds]
    if missing:
        raise ValueError(f"feeds lack {missing}: give the point where to differentiate")
    return numerical_vjp(onnx_function(model, outputs), feeds, wrt, seeds, eps)


def initializer_values(model: ModelProto, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The current values of the initializers ``names``."""
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return {name: values[name] for name in names}


def run_onnxruntime(model: ModelProto, feeds: Feeds) -> dict[str, np.ndarray]:
    """``{output name: value}`` of ``model`` run by an onnxruntime CPU session."""
    import onnxruntime

    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))
