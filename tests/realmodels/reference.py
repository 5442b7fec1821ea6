"""The original model as the finite-difference reference: float64, onnx's reference
evaluator, weights overridden wherever the model stores them (initializers or ``Constant``
nodes, subgraphs included).

The reference evaluator's ``BatchNormalization`` of opsets 9-13 normalises with the batch's
own statistics (its ``momentum`` attribute, which has a default, selects that path); the
specification's one-output node is inference mode, ``(x - mean) / sqrt(var + eps) * scale +
bias``, which onnxruntime computes, so the reference uses that formula at every opset. Its
``GlobalMaxPool`` and ``OneHot`` are replaced likewise (see each class).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from onnx import GraphProto, ModelProto, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnxgrad._onnx_utils import subgraphs
from tests.derivative.fd import to_double


class BatchNormalization(OpRun):
    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None):
        shape = (1, -1) + (1,) * (x.ndim - 2)
        centred = x - mean.reshape(shape)
        return (centred / np.sqrt(var.reshape(shape) + epsilon) * scale.reshape(shape)
                + bias.reshape(shape),)  # fmt: skip


class GlobalMaxPool(OpRun):
    """onnx's reference keeps only the first spatial axis (a rank-4 ``[N, C, L, 1]`` comes
    back ``[N, C, 1]``); the specification keeps every axis, size 1."""

    op_domain = ""

    def _run(self, x):
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)


class OneHot(OpRun):
    """onnx's reference refuses a float64 ``depth`` (the float32 one, made double)."""

    op_domain = ""

    def _run(self, indices, depth, values, axis=None):
        size = int(np.asarray(depth).ravel()[0])
        codes = np.asarray(indices).astype(np.int64)
        codes = np.where(codes < 0, codes + size, codes)
        hot = codes[..., None] == np.arange(size)
        result = np.where(hot, values[1], values[0]).astype(values.dtype)
        return (np.moveaxis(result, -1, -1 if axis is None else axis),)


_FIXED_OPS = [BatchNormalization, GlobalMaxPool, OneHot]


class Reference:
    """``run(feeds, weights)``: the float64 outputs of ``model`` with some weights replaced."""

    def __init__(self, model: ModelProto):
        self.model = to_double(model)
        self.slots = _weight_slots(self.model)

    def weight(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self._slot(name))

    def run(self, feeds: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray]):
        saved = {name: _copy(self._slot(name)) for name in weights}
        try:
            for name, value in weights.items():
                self._slot(name).CopyFrom(
                    numpy_helper.from_array(np.asarray(value, np.float64), name)
                )
            evaluator = ReferenceEvaluator(self.model, new_ops=_FIXED_OPS)
            doubles = {
                k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()
            }
            return evaluator.run(None, doubles)
        finally:
            for name, tensor in saved.items():
                self._slot(name).CopyFrom(tensor)

    def _slot(self, name: str):
        if name not in self.slots:
            raise KeyError(f"weight {name!r} is neither an initializer nor a Constant of the model")
        return self.slots[name]


def _copy(tensor):
    copy = type(tensor)()
    copy.CopyFrom(tensor)
    return copy


def _weight_slots(model: ModelProto) -> dict:
    slots = {}

    def visit(graph: GraphProto) -> None:
        for init in graph.initializer:
            slots[init.name] = init
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                slots[node.output[0]] = node.attribute[0].t
            for sub in subgraphs(node):
                visit(sub)

    visit(model.graph)
    return slots
