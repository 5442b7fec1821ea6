"""Appending a training loss (and weight penalties) to a model."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
from onnx import (
    GraphProto,
    ModelProto,
    NodeProto,
    TensorProto,
    ValueInfoProto,
    helper,
    numpy_helper,
)

from onnxgrad._entries import normalizing
from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    all_names,
    default_opset,
    finalize_model,
    first_float_output,
    np_dtype,
)
from onnxgrad.graph._builder import GraphBuilder
from onnxgrad.graph._scores import (
    dims_of,
    elem_type_of,
    is_number,
    penalty_term,
    reduce_loss,
)
from onnxgrad.graph.loss_table import (
    DEFAULT_REDUCTION,
    LOGITS,
    PROBABILITIES,
    LossSpec,
    check_reduction,
    resolve_loss,
)
from onnxgrad.graph.select import prune_graph


@normalizing
def add_loss_output(
    model: ModelLike,
    score_name: str = "squared_error",
    loss_name: str = "loss",
    label_name: str = "label",
    weight_name: str | None = None,
    penalty: Mapping[str, float | Mapping[str, float]] | None = None,
    output_index: int | str | None = None,
    reduction: str = DEFAULT_REDUCTION,
    **kwargs: Any,
) -> ModelProto:
    """A copy of ``model`` whose outputs are ``[loss, prediction]``.

    The prediction ``f(x)`` is the output picked by ``output_index`` (an index or a name;
    default: the first float output). ``label_name`` (and ``weight_name``, per-sample weights
    ``w`` of shape ``[N]``) become new inputs. ``score_name`` is a name of the loss table
    (:mod:`onnxgrad.graph.loss_table`, ``docs/losses.md``), aliases included:

    * ``'squared_error'`` (``'l2'``, ``'square_error'``): ``e = (f - y)^2``;
    * ``'absolute_error'`` (``'l1'``): ``e = |f - y|``;
    * ``'elastic'``: ``e = l1_weight |f - y| + l2_weight (f - y)^2``, keyword arguments
      ``l1_weight=0.5, l2_weight=0.5``;
    * ``'log'``: binary log loss on the probability of class 1 (one column, or the two
      columns ``[1 - p, p]`` of a converted classifier), ``e = -log p_y``;
      ``'log_logits'``: the same on one column of raw scores, ``p = sigmoid(s)``;
    * ``'cross_entropy'``: ``e = -log p_y`` on probabilities;
      ``'cross_entropy_logits'``: on logits, ``log p = LogSoftmax(f(x))``.

    ``reduction='sum'`` (the default everywhere, the seeds' graph ending in ``ReduceSum``)
    returns ``sum_i w_i sum_j e_ij``; ``'mean'`` returns ``sum_i w_i mean_j e_ij / sum_i w_i``
    (without weights: the mean over every element, scikit-learn's
    ``mean_squared_error``/``log_loss``, torch's ``'mean'``).

    Regression labels have the prediction's type and shape; class labels are int64 indices
    of shape ``[N]`` or ``[N, 1]``. A class label outside ``0..C-1`` makes the loss NaN
    (never a silent 0). Probabilities are clipped to ``[eps, 1 - eps]`` before the log
    (keyword ``eps``, default: the machine epsilon of the dtype, as scikit-learn's
    ``log_loss``). A logits loss on an output computed by Softmax or Sigmoid is refused
    (the softmax would apply twice): use the probabilities loss.

    ``penalty={'coef': {'l1': a, 'l2': b}, 'intercept': c}`` adds ``a sum|W| + b sum W^2`` for
    the initializer ``W`` named ``coef`` and ``c sum V^2`` for ``intercept`` (a bare number is
    an L2 coefficient).

    The other outputs, and the nodes only they needed, are dropped; the loss, label and
    weight names must be new to what remains (a classifier's ``label`` output does not
    collide with the default label name when the loss is put on its probabilities).
    The model is first made regular by :func:`onnxgrad.normalize.normalized_model` (opset
    13 at least, ``ai.onnx.ml`` operators lowered: a ZipMap's probability tensor becomes the
    output ``probabilities``); the nodes are standard ONNX ops in the form the opset defines.
    """
    opset = default_opset(model)
    spec = resolve_loss(score_name)
    options = spec.checked_options(kwargs)
    check_reduction(reduction)
    graph = model.graph
    prediction = _chosen_output(graph, output_index)
    check_prediction_kind(graph, prediction.name, spec)
    penalties = _penalties(graph, penalty)
    _keep_only(graph, prediction)
    _check_new_names(graph, loss_name=loss_name, label_name=label_name, weight_name=weight_name)
    _check_penalised_weights_remain(graph, penalties, prediction.name)
    _add_inputs(graph, prediction, label_name, weight_name, spec.classification)

    dtype = elem_type_of(prediction)
    weight_types = {init.name: init.data_type for init in graph.initializer}
    builder = GraphBuilder(graph, opset, prefix=loss_name)
    pointwise = spec.build(builder, prediction, label_name, **options)
    loss = reduce_loss(builder, pointwise, weight_name, reduction, np_dtype(dtype))
    for name, kind, coef in penalties:
        term = penalty_term(builder, name, weight_types[name], kind, coef, dtype)
        loss = builder.op("Add", loss, term, hint="with_penalty")
    builder.rename_output(loss, loss_name)
    graph.output.insert(0, helper.make_tensor_value_info(loss_name, dtype, []))
    return finalize_model(model)


#: ops whose output is a raw score, never a probability (also an Add of their output and a bias)
RAW_SCORE_OPS = frozenset({"MatMul", "Gemm", "Conv", "Einsum", "MatMulInteger"})


def check_prediction_kind(graph: GraphProto, output: str, spec: LossSpec) -> None:
    """A logits loss on an output that a Softmax or Sigmoid computes is refused; a
    probabilities loss on an output of a raw-score op (:data:`RAW_SCORE_OPS`, or one of
    them plus a bias) warns."""
    producer = next((n for n in graph.node if output in n.output), None)
    if producer is None:
        return
    if spec.prediction == LOGITS and producer.op_type in ("Softmax", "Sigmoid"):
        fix = "cross_entropy" if spec.name == "cross_entropy_logits" else "log"
        raise ValueError(
            f"loss {spec.name!r} applies a {'softmax' if fix == 'cross_entropy' else 'sigmoid'} "
            f"to logits, but output {output!r} is computed by {node_label(producer)}: it "
            f"already holds probabilities; use {fix!r}"
        )
    if spec.prediction == PROBABILITIES and _raw_scores(graph, producer):
        fix = "cross_entropy_logits" if spec.name == "cross_entropy" else "log_logits"
        warnings.warn(
            f"loss {spec.name!r} expects probabilities, but output {output!r} is computed by "
            f"{node_label(producer)}, raw scores: if it holds logits, use {fix!r}",
            UserWarning,
            stacklevel=3,
        )


def _raw_scores(graph: GraphProto, node: NodeProto) -> bool:
    if node.op_type in RAW_SCORE_OPS:
        return True
    producers = {out: n.op_type for n in graph.node for out in n.output}
    return node.op_type == "Add" and any(producers.get(i) in RAW_SCORE_OPS for i in node.input)


def node_label(node: NodeProto) -> str:
    """``"Softmax node 'name'"``, or ``"the Softmax node computing 'out'"`` when unnamed."""
    if node.name:
        return f"{node.op_type} node {node.name!r}"
    return f"the {node.op_type} node computing {node.output[0]!r}"


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
        chosen = first_float_output(graph)
        if chosen is None:
            raise ValueError(f"the model has no float output to put a loss on: {names}")
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


def reshape_loss(model: ModelProto, loss_name: str, dims: tuple[int, ...]) -> None:
    """Give the loss output ``loss_name`` of ``model`` (changed in place) the shape ``dims``
    of as many elements (``()``: the scalar onnxgrad declares, ``(1, 1)``: onnxcustom's) with
    a final ``Reshape``; the value is unchanged."""
    graph = model.graph
    used = {n for node in graph.node for n in [*node.input, *node.output]}
    used |= {v.name for v in [*graph.input, *graph.initializer]}
    before, shape = (_unused(f"{loss_name}_{role}", used) for role in ("unshaped", "shape"))
    for node in graph.node:
        node.output[:] = [before if o == loss_name else o for o in node.output]
        node.input[:] = [before if i == loss_name else i for i in node.input]
    kept = [v for v in graph.value_info if v.name != loss_name]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    graph.initializer.append(numpy_helper.from_array(np.array(dims, np.int64), shape))
    graph.node.append(helper.make_node("Reshape", [before, shape], [loss_name]))
    declared = next(o for o in graph.output if o.name == loss_name).type.tensor_type.shape
    declared.Clear()
    for d in dims:
        declared.dim.add().dim_value = d


def _unused(name: str, used: set[str]) -> str:
    candidate, k = name, 0
    while candidate in used:
        k += 1
        candidate = f"{name}_{k}"
    used.add(candidate)
    return candidate
