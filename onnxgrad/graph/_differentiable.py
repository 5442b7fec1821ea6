"""Which values of a graph reach its outputs through differentiable edges.

An edge ``value -> node`` is differentiable when the op schema marks that input
``Differentiable``, or ``Unknown`` and the input is not a known non-trainable parameter
(``_NOT_TRAINABLE``). Ops without a schema (custom domains, local functions) count as
``Unknown``. A node passes differentiability on from its inputs only through outputs not
marked ``NonDifferentiable``; a value whose known element type is not a float type never
carries a gradient. A subgraph's outer-scope reads count as inputs of the node holding it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import onnx
from onnx import GraphProto, ModelProto, NodeProto
from onnx.defs import OpSchema

from onnxgrad._onnx_utils import FLOAT_TYPES, normalize_domain, subgraphs
from onnxgrad.graph._scopes import free_names, iter_graphs

_Category = OpSchema.DifferentiationCategory

#: Inputs whose schema says Differentiable or Unknown but which hold constants, statistics or
#: shapes rather than weights: running statistics, resampling scales, random-op shapes,
#: quantisation parameters, rotary caches, and Pow's exponent (a constant-folded ``x ** 2``;
#: its gradient ``z log(x)`` is NaN wherever ``x < 0``).
_NOT_TRAINABLE: dict[tuple[str, str], frozenset[str]] = {
    ("", "Pow"): frozenset({"Y"}),
    ("", "BatchNormalization"): frozenset({"mean", "var", "input_mean", "input_var"}),
    ("", "Upsample"): frozenset({"scales"}),
    ("", "Range"): frozenset({"start", "limit", "delta"}),
    ("", "ConstantOfShape"): frozenset({"input"}),
    ("", "EyeLike"): frozenset({"input"}),
    ("", "Bernoulli"): frozenset({"input"}),
    ("", "Multinomial"): frozenset({"input"}),
    ("", "RandomNormalLike"): frozenset({"input"}),
    ("", "RandomUniformLike"): frozenset({"input"}),
    ("", "DequantizeLinear"): frozenset({"x_scale", "x_zero_point"}),
    ("", "QuantizeLinear"): frozenset({"y_scale", "y_zero_point"}),
    ("", "NonMaxSuppression"): frozenset({"iou_threshold", "score_threshold"}),
    ("", "RotaryEmbedding"): frozenset({"cos_cache", "sin_cache"}),
    # Unknown before opset 13:
    ("", "Clip"): frozenset({"min", "max"}),
    ("", "Resize"): frozenset({"roi", "scales"}),
    ("", "Dropout"): frozenset({"ratio"}),
    ("", "Pad"): frozenset({"constant_value"}),
}


def model_opsets(model: ModelProto) -> dict[str, int]:
    """``{domain: version}`` with ``ai.onnx`` spelled ``''``."""
    return {normalize_domain(op.domain): op.version for op in model.opset_import}


def value_elem_types(model: ModelProto) -> dict[str, int]:
    """Element type of every value shape inference can type, subgraphs included."""
    from onnxgrad._onnx_utils import weightless_view

    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_view(model))
    except Exception:  # inference is a hint here; an untyped value counts as float
        inferred = model
    types: dict[str, int] = {}
    for graph in iter_graphs(inferred.graph):
        for info in [*graph.input, *graph.output, *graph.value_info]:
            if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
                types[info.name] = info.type.tensor_type.elem_type
        for init in graph.initializer:
            types[init.name] = init.data_type
    return types


@functools.lru_cache(maxsize=4096)
def _schema(op_type: str, domain: str, version: int) -> OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, version, domain)
    except onnx.defs.SchemaError:
        return None


def _formal(params, index: int):
    if index < len(params):
        return params[index]
    if params and params[-1].option == OpSchema.FormalParameterOption.Variadic:
        return params[-1]
    return None


def _schema_of(node: NodeProto, opsets: Mapping[str, int]) -> OpSchema | None:
    domain = normalize_domain(node.domain)
    if domain not in opsets:
        return None
    return _schema(node.op_type, domain, opsets[domain])


def input_is_differentiable(node: NodeProto, index: int, opsets: Mapping[str, int]) -> bool:
    """Whether input ``index`` of ``node`` may carry a gradient (see the module docstring)."""
    formal = _formal(getattr(_schema_of(node, opsets), "inputs", ()), index)
    if formal is None:
        return True
    if formal.differentiation_category == _Category.NonDifferentiable:
        return False
    domain = normalize_domain(node.domain)
    return formal.name not in _NOT_TRAINABLE.get((domain, node.op_type), frozenset())


def output_is_differentiable(node: NodeProto, index: int, opsets: Mapping[str, int]) -> bool:
    """Whether output ``index`` of ``node`` may depend differentiably on its inputs."""
    formal = _formal(getattr(_schema_of(node, opsets), "outputs", ()), index)
    return formal is None or formal.differentiation_category != _Category.NonDifferentiable


def differentiable_values(
    graph: GraphProto,
    opsets: Mapping[str, int],
    types: Mapping[str, int],
    outputs: Iterable[str] | None = None,
) -> set[str]:
    """Names from which a small change reaches an output of ``graph`` (or one of
    ``outputs``, values of the graph) through differentiable edges, outer-scope names read by
    its subgraphs included.

    Nodes are visited in reverse topological order (the order the checker enforces).
    """

    def is_float(name: str) -> bool:
        return types.get(name, onnx.TensorProto.FLOAT) in FLOAT_TYPES

    roots = [o.name for o in graph.output] if outputs is None else outputs
    live = {name for name in roots if is_float(name)}
    for node in reversed(graph.node):
        if not any(
            out in live and output_is_differentiable(node, i, opsets)
            for i, out in enumerate(node.output)
        ):
            continue
        live.update(
            name
            for i, name in enumerate(node.input)
            if name and is_float(name) and input_is_differentiable(node, i, opsets)
        )
        for sub in subgraphs(node):
            outer = free_names(sub)
            live.update(
                n for n in differentiable_values(sub, opsets, types) if n in outer and is_float(n)
            )
    return live
