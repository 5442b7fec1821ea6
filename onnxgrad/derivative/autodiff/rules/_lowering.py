"""Rules by lowering: an operator rewritten as an exact composition of standard operators
(bilinear sampling as Floor, Gather and weights), whose derivative the engine then builds
with the rules of those operators, as for a function body
(:mod:`~onnxgrad.derivative.autodiff.functions`). The forward graph keeps the operator; the
composition is recomputed in the backward pass only.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import np_dtype, reduce_axes_are_input
from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView
from onnxgrad.derivative.autodiff.functions import through_body


class Lowering:
    """The nodes of the composition standing for ``node`` (values named ``__lowered_<k>``,
    renamed when emitted); the last node writes ``node``'s output."""

    def __init__(self, b: GradBuilder, node: NodeView):
        self.b = b
        self.node = node
        self.opset = b.opset
        self.elem_type = b.dtype(node.inputs[0])
        self.dtype = np_dtype(self.elem_type)
        self.nodes: list[NodeProto] = []

    def op(self, op_type: str, *inputs: str, output: str | None = None, **attrs) -> str:
        name = output or f"__lowered_{len(self.nodes)}"
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], **attrs))
        return name

    def const(self, value, dtype=None) -> str:
        """A constant in the operator's float type (or ``dtype``)."""
        array = np.asarray(value, dtype=self.dtype if dtype is None else dtype)
        return self.op("Constant", value=numpy_helper.from_array(array))

    def ints(self, value) -> str:
        return self.const(value, np.int64)

    def reduce(self, op_type: str, x: str, axes: list[int], output: str | None = None) -> str:
        if reduce_axes_are_input(op_type, self.opset):
            return self.op(op_type, x, self.ints(axes), keepdims=0, output=output)
        return self.op(op_type, x, axes=axes, keepdims=0, output=output)

    def to_float(self, condition: str) -> str:
        return self.op("Cast", condition, to=self.elem_type)

    def to_index(self, x: str) -> str:
        return self.op("Cast", x, to=TensorProto.INT64)

    def clamp(self, x: str, low: float, high: float) -> str:
        return self.op("Min", self.op("Max", x, self.const(low)), self.const(high))

    def gradients(self, grads, needs):
        """The gradients of the node's inputs, through the composition."""
        return through_body(self.nodes, self.b, self.node, grads, needs)
