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
)
from onnxgrad.graph._builder import GraphBuilder
from onnxgrad.graph._scores import (
    ALIASES,
    SCORES,
    dims_of,
    elem_type_of,
    is_number,
    penalty_term,
)
from onnxgrad.graph.ml_lowering import lowered_if_needed
from onnxgrad.graph.select import prune_graph

#: The lowest default-domain opset the loss nodes are written for.
MIN_LOSS_OPSET = 13


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
    A model below default-domain opset 13, or with ``ai.onnx.ml`` operators, goes through
    :func:`onnxgrad.lower_ml_operators` first (a ZipMap's probability tensor becomes the
    output ``probabilities``); the nodes are standard ONNX ops in the form the opset defines.
    """
    model = lowered_if_needed(load_model(model), min_opset=MIN_LOSS_OPSET)
    opset = default_opset(model)
    score = _score(score_name, kwargs)
    graph = model.graph
    prediction = _chosen_output(graph, output_index)
    penalties = _penalties(graph, penalty)
    _keep_only(graph, prediction)
    _check_new_names(graph, loss_name=loss_name, label_name=label_name, weight_name=weight_name)
    _check_penalised_weights_remain(graph, penalties, prediction.name)
    _add_inputs(graph, prediction, label_name, weight_name, score.classification)

    dtype = elem_type_of(prediction)
    weight_types = {init.name: init.data_type for init in graph.initializer}
    builder = GraphBuilder(graph, opset, prefix=loss_name)
    loss = score.build(builder, prediction, label_name, weight_name, **score.options)
    for name, kind, coef in penalties:
        term = penalty_term(builder, name, weight_types[name], kind, coef, dtype)
        loss = builder.op("Add", loss, term, hint="with_penalty")
    builder.rename_output(loss, loss_name)
    graph.output.insert(0, helper.make_tensor_value_info(loss_name, dtype, []))
    return finalize_model(model)


def _score(score_name: str, kwargs: Mapping[str, Any]) -> _Score:
    if not isinstance(score_name, str):
        raise TypeError(f"score_name must be a string, got {type(score_name).__name__}")
    name = ALIASES.get(score_name, score_name)
    if name not in SCORES:
        known = sorted([*SCORES, *ALIASES])
        raise ValueError(f"unknown score {score_name!r}, expected one of {known}")
    build, defaults, classification = SCORES[name]
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
        floats = [o for o in outputs if elem_type_of(o) in FLOAT_TYPES]
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
    if elem_type_of(chosen) not in FLOAT_TYPES:
        raise ValueError(
            f"output {chosen.name!r} is not a float tensor "
            f"({TensorProto.DataType.Name(elem_type_of(chosen))}): a loss needs a float output"
        )
    copy = ValueInfoProto()
    copy.CopyFrom(chosen)
    return copy


def _check_penalised_weights_remain(
    graph: GraphProto, penalties: list[tuple[str, str, float]], prediction: str
) -> None:
    unused = sorted({name for name, _, _ in penalties} - {i.name for i in graph.initializer})
    if unused:
        raise ValueError(f"penalty on initializers {unused}, which {prediction!r} does not use")


def _add_inputs(
    graph: GraphProto,
    prediction: ValueInfoProto,
    label_name: str,
    weight_name: str | None,
    classification: bool,
) -> None:
    graph.input.append(_label_info(prediction, label_name, classification))
    if weight_name is not None:
        graph.input.append(_weight_info(prediction, weight_name))


def _label_info(prediction: ValueInfoProto, name: str, classification: bool) -> ValueInfoProto:
    if classification:
        info = helper.make_tensor_value_info(name, TensorProto.INT64, dims_of(prediction)[:1])
    else:
        info = ValueInfoProto()
        info.CopyFrom(prediction)
        info.name = name
        info.doc_string = ""
    return info


def _weight_info(prediction: ValueInfoProto, name: str) -> ValueInfoProto:
    dims = dims_of(prediction)
    return helper.make_tensor_value_info(
        name, elem_type_of(prediction), [dims[0] if dims else None]
    )


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
        coefs = {"l2": spec} if is_number(spec) else spec
        if not isinstance(coefs, Mapping) or set(coefs) - {"l1", "l2"}:
            raise ValueError(
                f"penalty on {name!r} must be a number (L2) or a dict with keys 'l1', 'l2', "
                f"got {spec!r}"
            )
        for kind, coef in coefs.items():
            if not is_number(coef) or not np.isfinite(coef) or coef < 0:
                raise ValueError(f"penalty {kind} on {name!r} must be a number >= 0, got {coef!r}")
            if coef:
                terms.append((name, kind, float(coef)))
    return terms
