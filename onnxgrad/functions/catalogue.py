"""``function_onnx_graph``: the catalogue of small fixed graphs, made concrete on request."""

from __future__ import annotations

import functools
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from onnxgrad.functions import losses, penalties, regression, updates  # noqa: F401 (registers)
from onnxgrad.functions._concretize import concretize
from onnxgrad.functions._registry import CATALOGUE, BuildContext, Dim, GraphSpec, check_shape

#: Opset used when ``target_opset`` is None.
DEFAULT_OPSET = 18
SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def get_supported_functions() -> dict[str, str]:
    """Names accepted by :func:`function_onnx_graph`, each with a one-line description."""
    return {name: CATALOGUE[name].description for name in sorted(CATALOGUE)}


def function_onnx_graph(
    name: str,
    target_opset: int | None = None,
    dtype: Any = np.float32,
    weight_name: str | None = None,
    *,
    input_shapes: Mapping[str, Sequence[Dim]] | None = None,
    **kwargs: Any,
) -> onnx.ModelProto:
    """The ONNX graph ``name`` of the catalogue (see :func:`get_supported_functions`).

    :param name: graph name, e.g. ``"axpy"`` or ``"grad_loss_square_error"``
    :param target_opset: default-domain opset, from 13 to the newest one onnxscript knows
        (23 with onnxscript 0.7; default 18)
    :param dtype: float element type, ``numpy.float32`` or ``numpy.float64``
    :param weight_name: name of an extra per-sample weight input of shape ``[N]``, for the
        graphs computing a loss; it defaults to 1 (every sample weighs 1 when it is not fed);
        ``None``: no such input. The penalty of weights ``n_penalty_elastic_error`` has no
        per-sample term and ignores it, as onnxcustom did
    :param input_shapes: declared shapes of some inputs, by input name (dims are ints,
        symbolic names or None). A valid ONNX model declares the rank of every input, so a
        graph working on tensors of any shape is served 2-D by default; the inputs sharing the
        shape of an earlier one (X2 of X1, G, M and V of X...) follow it unless given here
    :param kwargs: options of the graph (``l1_weight``, ``eps``, ``n_tensors``...)
    :return: a new model whose formula is in its ``doc_string``; it passes
        ``onnx.checker.check_model(full_check=True)`` and runs with onnxruntime and
        ``onnx.reference.ReferenceEvaluator``
    """
    spec = _spec(name)
    opset = _opset(target_opset, spec)
    float_type = _dtype(dtype)
    params = _params(spec, kwargs)
    weight = _weight_name(spec, weight_name, params)
    shapes = _input_shapes(spec, input_shapes, params, weight)
    key = (name, opset, float_type.str, weight, _frozen(params), _frozen(shapes))
    return onnx.load_from_string(_build_cached(*key))


@functools.lru_cache(maxsize=256)
def _build_cached(name, opset, dtype_str, weight_name, params, shapes) -> bytes:
    spec = CATALOGUE[name]
    ctx = BuildContext(opset, np.dtype(dtype_str), weighted=weight_name is not None)
    model = concretize(spec, ctx, dict(params), weight_name, dict(shapes))
    return model.SerializeToString()


def _spec(name: Any) -> GraphSpec:
    if not isinstance(name, str):
        raise TypeError(f"graph name must be a str, got {type(name).__name__}")
    if name not in CATALOGUE:
        raise ValueError(
            f"unknown graph {name!r}; supported graphs are: {', '.join(sorted(CATALOGUE))}"
        )
    return CATALOGUE[name]


def _opset(target_opset: Any, spec: GraphSpec) -> int:
    if target_opset is None:
        return max(DEFAULT_OPSET, spec.min_opset)
    if isinstance(target_opset, bool) or not isinstance(target_opset, numbers.Integral):
        raise TypeError(f"target_opset must be an int, got {type(target_opset).__name__}")
    newest = max_function_opset()
    if not spec.min_opset <= target_opset <= newest:
        raise ValueError(
            f"graph {spec.name!r} supports opsets {spec.min_opset} to {newest} (the newest "
            f"opset of the installed onnxscript), got target_opset={target_opset}"
        )
    return int(target_opset)


@functools.cache
def max_function_opset() -> int:
    """The newest default-domain opset the installed onnxscript can author graphs for."""
    import onnxscript

    return max(int(name[5:]) for name in dir(onnxscript) if re.fullmatch(r"opset\d+", name))


def _dtype(dtype: Any) -> np.dtype:
    try:
        float_type = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype {dtype!r} is not a numpy dtype") from exc
    if float_type not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {float_type} is not supported; use numpy.float32 or numpy.float64")
    return float_type


def _params(spec: GraphSpec, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(spec.params))
    if unknown:
        accepted = ", ".join(sorted(spec.params)) or "none"
        raise TypeError(
            f"graph {spec.name!r} got unexpected option(s) {', '.join(unknown)}; "
            f"accepted options: {accepted}"
        )
    return {
        key: param.check(key, kwargs[key]) if key in kwargs else param.default
        for key, param in spec.params.items()
    }


def _weight_name(spec: GraphSpec, weight_name: Any, params: Mapping[str, Any]) -> str | None:
    if weight_name is None or spec.ignores_weight:
        return None
    if not spec.weighted:
        raise ValueError(f"graph {spec.name!r} takes no sample weight (weight_name)")
    if not isinstance(weight_name, str) or not weight_name:
        raise TypeError(f"weight_name must be a non-empty str, got {weight_name!r}")
    ports = [*spec.input_ports(params, False), *spec.output_ports(params)]
    if weight_name in {p.name for p in ports}:
        raise ValueError(
            f"weight_name {weight_name!r} is already an input or output of graph {spec.name!r}"
        )
    return weight_name


def _input_shapes(
    spec: GraphSpec,
    input_shapes: Mapping[str, Sequence[Dim]] | None,
    params: Mapping[str, Any],
    weight_name: str | None,
) -> dict[str, tuple[Dim, ...]]:
    if input_shapes is None:
        return {}
    if not isinstance(input_shapes, Mapping):
        raise TypeError(f"input_shapes must be a mapping, got {type(input_shapes).__name__}")
    names = [p.name for p in spec.input_ports(params, False)]
    if weight_name is not None:
        names.append(weight_name)
    unknown = sorted(set(input_shapes) - set(names))
    if unknown:
        raise ValueError(
            f"input_shapes names unknown inputs {unknown} of graph {spec.name!r}; "
            f"its inputs are {names}"
        )
    return {key: check_shape(key, shape) for key, shape in input_shapes.items()}


def _frozen(mapping: Mapping[str, Any]) -> tuple:
    return tuple(sorted(mapping.items()))
