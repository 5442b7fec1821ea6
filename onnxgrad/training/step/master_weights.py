"""float32 master weights for the float16 and bfloat16 weights of a model being trained.

Mixed-precision training keeps each low-precision weight ``W`` (float16 or bfloat16) as a
float32 tensor ``W32``, the one the optimizer updates, and lets the model compute with
``Cast(W32, to=type(W))``: the forward pass computes in the model's own precision, the
gradient ``dL/dW32 = Cast(dL/dW, float32)`` leaves the low-precision backward in float32, and
updates smaller than ``W``'s precision (``2^-11 |W|`` in float16) accumulate instead of
rounding away. :func:`with_master_weights` rewrites a loss model that way (``W32`` keeps the
weight's name, so checkpoints name the weights as the model does); a low-precision loss is
cast to float32 too, the type of the optimizer's arithmetic. :func:`as_stored` rounds trained
master weights back to the model's types for deployment, :func:`as_master` makes the
first master weights of the model's values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import ModelLike, NameScope, all_names, load_model, np_dtype, subgraphs
from onnxgrad.normalize.bfloat16 import bfloat16_in_float32

#: element types whose trained weights get float32 master weights
LOW_PRECISION = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})


def with_master_weights(model: ModelProto, weights: Sequence[str], loss: bool = True) -> ModelProto:
    """Rewrite ``model`` (private) in place: every float16 or bfloat16 initializer of
    ``weights`` becomes a float32 master weight read through a ``Cast`` back to its type.
    With ``loss`` (the first output is the loss): a float16 or bfloat16 loss is cast to
    float32, and the loss's own bfloat16 operators compute in float32 as the model's
    (:mod:`onnxgrad.normalize.bfloat16`)."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    low = [w for w in weights if w in initializers and initializers[w].data_type in LOW_PRECISION]
    names = NameScope(all_names(graph))
    casts = []
    renames = {}
    for w in low:
        init = initializers[w]
        value = numpy_helper.to_array(init).astype(np.float32)
        renames[w] = names.unique(f"{w}_{_type_name(init.data_type)}")
        casts.append(
            helper.make_node("Cast", [w], [renames[w]], to=init.data_type, name=renames[w])
        )
        init.CopyFrom(numpy_helper.from_array(value, name=w))
    if renames:
        _rename_reads(graph, renames)
        for info in (*graph.input, *graph.value_info):
            if info.name in renames:
                info.type.tensor_type.elem_type = TensorProto.FLOAT
        nodes = casts + list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes)
    if not loss:
        return model
    _float32_loss(graph, names)
    return bfloat16_in_float32(model)


def as_master(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``weights`` with every float16 or bfloat16 array as its float32 master weight."""
    low = {np_dtype(t) for t in LOW_PRECISION}
    return {
        n: np.asarray(v).astype(np.float32) if np.asarray(v).dtype in low else np.asarray(v)
        for n, v in weights.items()
    }


def as_stored(model: ModelLike, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``weights`` with every float32 master weight of a float16 or bfloat16 initializer of
    ``model`` (or its path) rounded to that type (round to nearest even); the others
    unchanged."""
    if not isinstance(model, ModelProto):
        model = load_model(model)
    types = {init.name: init.data_type for init in model.graph.initializer}
    result = {}
    for name, value in weights.items():
        array = np.asarray(value)
        stored = types.get(name)
        if stored in LOW_PRECISION and array.dtype == np.float32:
            array = array.astype(np_dtype(stored))
        result[name] = array
    return result


def _float32_loss(graph, names: NameScope) -> None:
    loss = graph.output[0]
    tensor_type = loss.type.tensor_type
    if tensor_type.elem_type not in LOW_PRECISION:
        return
    low = names.unique(f"{loss.name}_{_type_name(tensor_type.elem_type)}")
    _rename_all(graph, {loss.name: low})
    graph.node.append(helper.make_node("Cast", [low], [loss.name], to=TensorProto.FLOAT, name=low))
    tensor_type.elem_type = TensorProto.FLOAT


def _rename_reads(graph, renames: Mapping[str, str]) -> None:
    """Every read of a renamed value, in ``graph`` and the subgraphs that do not shadow it."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renames.get(name, name)
        for sub in subgraphs(node):
            local = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            local |= {o for n in sub.node for o in n.output}
            inner = {k: v for k, v in renames.items() if k not in local}
            if inner:
                _rename_reads(sub, inner)


def _rename_all(graph, renames: Mapping[str, str]) -> None:
    for node in graph.node:
        for i, name in enumerate(node.output):
            node.output[i] = renames.get(name, name)
    _rename_reads(graph, renames)


def _type_name(elem_type: int) -> str:
    return TensorProto.DataType.Name(elem_type).lower()


__all__ = ["LOW_PRECISION", "as_master", "as_stored", "with_master_weights"]
