"""Appending a training loss (and weight penalties) to a model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import GraphProto, ModelProto, TensorProto, ValueInfoProto, helper

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    all_names,
    default_opset,
    finalize_model,
    load_model,
    np_dtype,
)
from onnxgrad.graph._builder import GraphBuilder
from onnxgrad.graph.select import prune_graph

#: The lowest default-domain opset the loss nodes are written for.
MIN_LOSS_OPSET = 13

_ALIASES = {"l2": "squared_error", "l1": "absolute_error"}


@dataclass(frozen=True)
class _Score:
    build: Callable[..., str]
    options: Mapping[str, Any]
    classification: bool


def add_loss_output(
    model: ModelLike,
    score_name: str = "squared_error",
    loss_name: str = "loss",
    label_name: str = "label",
    weight_name: str | None = None,
    penalty: Mapping[str, float | Mapping[str, float]] | None = None,
    output_index: int | str | None = None,
    **kwargs: Any,
) -> ModelProto:
    """A copy of ``model`` whose outputs are ``[loss, prediction]``.

    The prediction ``f(x)`` is the output picked by ``output_index`` (an index or a name;
    default: the first float output). ``label_name`` (and ``weight_name``, per-sample weights
    ``w`` of shape ``[N]``) become new inputs. With ``d = f(x) - y`` summed over every element
    of a sample, the loss, a rank-0 tensor of the prediction's dtype, is

    * ``'squared_error'`` or ``'l2'``: ``sum_i w_i d_i^2``;
    * ``'absolute_error'`` or ``'l1'``: ``sum_i w_i |d_i|``;
    * ``'elastic'``: ``sum_i w_i (l1_weight |d_i| + l2_weight d_i^2)``, keyword arguments
      ``l1_weight=0.5, l2_weight=0.5``;
    * ``'log'``: binary log loss on a 2-column probability output ``p``,
      ``-sum_i w_i (y_i log p_i1 + (1 - y_i) log p_i0) / sum_i w_i``;
    * ``'cross_entropy'``: multi-class log loss ``-sum_i w_i log p_{i,y_i} / sum_i w_i`` on
      probabilities (``probabilities=True``, the default) or on logits
      (``probabilities=False``: ``log p = LogSoftmax(f(x))``).

    Without ``weight_name``, ``w_i = 1`` (so the classification losses are means, as
    scikit-learn's ``log_loss``). The regression labels have the prediction's type and
    shape; classification labels are int64 class indices of shape ``[N]``.
    Probabilities are clipped to ``[eps, 1 - eps]`` before the log (keyword ``eps``,
    default: the machine epsilon of the dtype, as scikit-learn's ``log_loss``).

    ``penalty={'coef': {'l1': a, 'l2': b}, 'intercept': c}`` adds ``a sum|W| + b sum W^2`` for
    the initializer ``W`` named ``coef`` and ``c sum V^2`` for ``intercept`` (a bare number is
    an L2 coefficient).

    The other outputs, and the nodes only they needed, are dropped; the loss, label and
    weight names must be new to what remains (a classifier's ``label`` output does not
    collide with the default label name when the loss is put on its probabilities).
    Needs a default-domain opset >= 13; the nodes are standard ONNX ops in the form that
    opset defines.
    """
    model = load_model(model)
    graph = model.graph
    opset = default_opset(model)
    if opset < MIN_LOSS_OPSET:
        raise ValueError(f"add_loss_output needs opset >= {MIN_LOSS_OPSET}, the model has {opset}")
    score = _score(score_name, kwargs)
    prediction = _chosen_output(graph, output_index)
    penalties = _penalties(graph, penalty)
    _keep_only(graph, prediction)
    _check_new_names(graph, loss_name=loss_name, label_name=label_name, weight_name=weight_name)
    unused = sorted({name for name, _, _ in penalties} - {i.name for i in graph.initializer})
    if unused:
        raise ValueError(
            f"penalty on initializers {unused}, which {prediction.name!r} does not use"
        )
    dtype = prediction.type.tensor_type.elem_type

    label = _label_info(prediction, label_name, score.classification)
    graph.input.append(label)
    if weight_name is not None:
        graph.input.append(_weight_info(prediction, weight_name))

    builder = GraphBuilder(graph, default_opset(model), prefix=loss_name)
    penalty_terms = [
        _penalty_term(builder, graph, name, kind, coef, dtype) for name, kind, coef in penalties
    ]
    data_out = None if penalty_terms else loss_name
    data_term = score.build(
        builder, prediction, label_name, weight_name, dtype, data_out, **score.options
    )
    for k, term in enumerate(penalty_terms):
        last = k == len(penalty_terms) - 1
        data_term = builder.op("Add", data_term, term, out=loss_name if last else None)

    graph.output.insert(0, helper.make_tensor_value_info(loss_name, dtype, []))
    return finalize_model(model)


def _score(score_name: str, kwargs: Mapping[str, Any]) -> _Score:
    if not isinstance(score_name, str):
        raise TypeError(f"score_name must be a string, got {type(score_name).__name__}")
    name = _ALIASES.get(score_name, score_name)
    if name not in _SCORES:
        known = sorted([*_SCORES, *_ALIASES])
        raise ValueError(f"unknown score {score_name!r}, expected one of {known}")
    build, defaults, classification = _SCORES[name]
    unexpected = sorted(set(kwargs) - set(defaults))
    if unexpected:
        raise TypeError(
            f"score {score_name!r} takes no keyword arguments {unexpected}; "
            f"it accepts {sorted(defaults)}"
        )
    return _Score(build, {**defaults, **kwargs}, classification)


def _check_new_names(graph: GraphProto, **names: str | None) -> None:
    existing = all_names(graph)
    given = {k: v for k, v in names.items() if v is not None}
    for arg, name in given.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{arg} must be a non-empty string, got {name!r}")
        if name in existing:
            raise ValueError(f"{arg}={name!r} already exists in the graph")
    values = list(given.values())
    if len(set(values)) != len(values):
        raise ValueError(f"{', '.join(given)} must be different names, got {given}")


def _keep_only(graph: GraphProto, prediction: ValueInfoProto) -> None:
    """Reduce ``graph`` (in place) to what computes ``prediction``."""
    del graph.output[:]
    graph.output.append(prediction)
    prune_graph(graph, keep_inputs=True)


def _chosen_output(graph: GraphProto, output_index: int | str | None) -> ValueInfoProto:
    outputs = list(graph.output)
    names = [o.name for o in outputs]
    if output_index is None:
        floats = [o for o in outputs if _elem_type(o) in FLOAT_TYPES]
        if not floats:
            raise ValueError(f"the model has no float output to put a loss on: {names}")
        chosen = floats[0]
    elif isinstance(output_index, str):
        if output_index not in names:
            raise ValueError(f"unknown output {output_index!r}, the outputs are {names}")
        chosen = outputs[names.index(output_index)]
    elif isinstance(output_index, (int, np.integer)) and not isinstance(output_index, bool):
        if not -len(outputs) <= output_index < len(outputs):
            raise ValueError(f"output_index={output_index} is out of range for outputs {names}")
        chosen = outputs[output_index]
    else:
        raise TypeError(f"output_index must be an int or a name, got {output_index!r}")
    if _elem_type(chosen) not in FLOAT_TYPES:
        raise ValueError(
            f"output {chosen.name!r} is not a float tensor "
            f"({TensorProto.DataType.Name(_elem_type(chosen))}): a loss needs a float output"
        )
    copy = ValueInfoProto()
    copy.CopyFrom(chosen)
    return copy


def _elem_type(info: ValueInfoProto) -> int:
    return info.type.tensor_type.elem_type if info.type.HasField("tensor_type") else 0


def _dims(info: ValueInfoProto) -> list:
    shape = info.type.tensor_type.shape
    if not info.type.tensor_type.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim]


def _label_info(prediction: ValueInfoProto, name: str, classification: bool) -> ValueInfoProto:
    if classification:
        info = helper.make_tensor_value_info(name, TensorProto.INT64, _dims(prediction)[:1])
    else:
        info = ValueInfoProto()
        info.CopyFrom(prediction)
        info.name = name
        info.doc_string = ""
    return info


def _weight_info(prediction: ValueInfoProto, name: str) -> ValueInfoProto:
    dims = _dims(prediction)
    return helper.make_tensor_value_info(name, _elem_type(prediction), [dims[0] if dims else None])


def _penalties(
    graph: GraphProto, penalty: Mapping[str, float | Mapping[str, float]] | None
) -> list[tuple[str, str, float]]:
    """``[(initializer, 'l1' | 'l2', coefficient)]`` from the ``penalty`` argument."""
    if penalty is None:
        return []
    if not isinstance(penalty, Mapping):
        raise TypeError(f"penalty must be a dict {{initializer: coefficients}}, got {penalty!r}")
    initializers = {init.name: init for init in graph.initializer}
    unknown = sorted(set(penalty) - set(initializers))
    if unknown:
        raise ValueError(f"penalty names unknown initializers {unknown}")
    terms = []
    for name, spec in penalty.items():
        if initializers[name].data_type not in FLOAT_TYPES:
            raise ValueError(f"penalty on initializer {name!r}, which is not a float tensor")
        coefs = {"l2": spec} if _is_number(spec) else spec
        if not isinstance(coefs, Mapping) or set(coefs) - {"l1", "l2"}:
            raise ValueError(
                f"penalty on {name!r} must be a number (L2) or a dict with keys 'l1', 'l2', "
                f"got {spec!r}"
            )
        for kind, coef in coefs.items():
            if not _is_number(coef) or not np.isfinite(coef) or coef < 0:
                raise ValueError(f"penalty {kind} on {name!r} must be a number >= 0, got {coef!r}")
            if coef:
                terms.append((name, kind, float(coef)))
    return terms


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def _penalty_term(
    b: GraphBuilder, graph: GraphProto, name: str, kind: str, coef: float, dtype: int
) -> str:
    """``coef * sum |W|`` (``l1``) or ``coef * sum W^2`` (``l2``) in the loss dtype."""
    magnitude = b.op("Abs", name) if kind == "l1" else b.op("Mul", name, name, hint="square")
    total = b.reduce("ReduceSum", magnitude, hint=f"{kind}_{name}")
    weight_type = next(i.data_type for i in graph.initializer if i.name == name)
    if weight_type != dtype:
        total = b.op("Cast", total, to=dtype)
    coef_name = b.const(np.array(coef, dtype=np_dtype(dtype)), f"{kind}_coef_{name}")
    return b.op("Mul", total, coef_name, hint=f"penalty_{kind}_{name}")


def _sum_per_sample(b: GraphBuilder, elementwise: str, weight: str | None, out: str | None) -> str:
    """``sum_i w_i sum_j e_ij`` over the samples ``i`` (first axis) of ``e``."""
    if weight is None:
        return b.reduce("ReduceSum", elementwise, out=out)
    rows = b.op("Flatten", elementwise, axis=1, hint="rows")
    per_sample = b.reduce("ReduceSum", rows, axes=[1], hint="per_sample")
    return b.reduce("ReduceSum", b.op("Mul", per_sample, weight, hint="weighted"), out=out)


def _squared_error(b, prediction, label, weight, dtype, out) -> str:
    diff = b.op("Sub", prediction.name, label, hint="diff")
    return _sum_per_sample(b, b.op("Mul", diff, diff, hint="diff_2"), weight, out)


def _absolute_error(b, prediction, label, weight, dtype, out) -> str:
    diff = b.op("Sub", prediction.name, label, hint="diff")
    return _sum_per_sample(b, b.op("Abs", diff, hint="abs_diff"), weight, out)


def _elastic(b, prediction, label, weight, dtype, out, l1_weight, l2_weight) -> str:
    for arg, value in (("l1_weight", l1_weight), ("l2_weight", l2_weight)):
        if not _is_number(value) or not np.isfinite(value):
            raise ValueError(f"{arg} must be a finite number, got {value!r}")
    np_type = np_dtype(dtype)
    diff = b.op("Sub", prediction.name, label, hint="diff")
    l1_coef = b.const(np.array(l1_weight, dtype=np_type), "l1_weight")
    l2_coef = b.const(np.array(l2_weight, dtype=np_type), "l2_weight")
    l1 = b.op("Mul", b.op("Abs", diff, hint="abs_diff"), l1_coef, hint="l1")
    l2 = b.op("Mul", b.op("Mul", diff, diff, hint="diff_2"), l2_coef, hint="l2")
    return _sum_per_sample(b, b.op("Add", l1, l2, hint="elastic"), weight, out)


def _log(b, prediction, label, weight, dtype, out, eps) -> str:
    n_classes = _n_classes(prediction)
    if n_classes != 2:
        raise ValueError(
            f"score 'log' needs a 2-column probability output, {prediction.name!r} has "
            f"{n_classes} columns: use 'cross_entropy'"
        )
    return _cross_entropy(b, prediction, label, weight, dtype, out, eps, probabilities=True)


def _cross_entropy(b, prediction, label, weight, dtype, out, eps, probabilities) -> str:
    n_classes = _n_classes(prediction)
    np_type = np_dtype(dtype)
    if probabilities is True:
        eps = float(np.finfo(np_type).eps) if eps is None else eps
        if not _is_number(eps) or not 0 < eps < 0.5:
            raise ValueError(f"eps must be a number in (0, 0.5), got {eps!r}")
        low = b.const(np.array(eps, dtype=np_type), "eps")
        high = b.const(np.array(1 - eps, dtype=np_type), "one_minus_eps")
        clipped = b.op("Clip", prediction.name, low, high, hint="clipped")
        log_p = b.op("Log", clipped, hint="log_p")
    elif probabilities is False:
        log_p = b.op("LogSoftmax", prediction.name, axis=1, hint="log_p")
    else:
        raise TypeError(f"probabilities must be True or False, got {probabilities!r}")
    column_shape = b.const(np.array([-1, 1], dtype=np.int64), "column_shape")
    column = b.op("Reshape", label, column_shape, hint="label_column")
    classes = b.const(np.arange(n_classes, dtype=np.int64).reshape((1, -1)), "classes")
    is_class = b.op("Equal", column, classes, hint="is_class")
    one_hot = b.op("Cast", is_class, to=dtype, hint="one_hot")
    picked = b.op("Mul", one_hot, log_p, hint="picked_log_p")
    log_likelihood = b.reduce("ReduceSum", picked, axes=[1], hint="log_likelihood")
    if weight is None:
        mean = b.reduce("ReduceMean", log_likelihood, hint="mean_log_likelihood")
        return b.op("Neg", mean, out=out)
    weighted = b.reduce(
        "ReduceSum", b.op("Mul", log_likelihood, weight, hint="weighted"), hint="weighted_sum"
    )
    total_weight = b.reduce("ReduceSum", weight, hint="total_weight")
    mean = b.op("Div", weighted, total_weight, hint="mean_log_likelihood")
    return b.op("Neg", mean, out=out)


def _n_classes(prediction: ValueInfoProto) -> int:
    dims = _dims(prediction)
    if len(dims) != 2 or not isinstance(dims[1], int):
        raise ValueError(
            f"a classification loss needs an output of shape [N, n_classes] with a known "
            f"number of classes, {prediction.name!r} has shape {dims}"
        )
    return dims[1]


#: score -> (builder, keyword arguments with their defaults, whether labels are classes)
_SCORES: dict[str, tuple[Callable[..., str], dict[str, Any], bool]] = {
    "squared_error": (_squared_error, {}, False),
    "absolute_error": (_absolute_error, {}, False),
    "elastic": (_elastic, {"l1_weight": 0.5, "l2_weight": 0.5}, False),
    "log": (_log, {"eps": None}, True),
    "cross_entropy": (_cross_entropy, {"eps": None, "probabilities": True}, True),
}
