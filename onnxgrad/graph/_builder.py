"""Appending nodes and constants to a graph with fresh names, in the form its opset wants."""

from __future__ import annotations

import numpy as np
from onnx import GraphProto, helper, numpy_helper

from onnxgrad._onnx_utils import NameScope, all_names, reduce_axes_are_input
from onnxgrad.graph._scopes import iter_graphs

#: The doc string of the ``Constant`` nodes onnxgrad's rewrites emit: structural constants
#: (loss coefficients, a lowering's masks and bounds) that normalisation never promotes to
#: weights (:mod:`onnxgrad.normalize.constants`).
STRUCTURAL_CONSTANT = "onnxgrad: structural constant"
#: The doc string of the initializers holding a converter's fitted preprocessing statistics
#: (a lowered ``Scaler``'s offset and scale): initializers, so they can be named and trained,
#: but no default weight (:mod:`onnxgrad.graph.weight_roles`).
FITTED_STATISTIC = "onnxgrad: fitted preprocessing statistic"


def mark_structural_constants(graph: GraphProto) -> None:
    """Mark every ``Constant`` node of ``graph`` and its subgraphs :data:`STRUCTURAL_CONSTANT`
    (in place): a graph onnxgrad built (a gradient) holds no weight in a Constant node, so
    normalising it again never promotes one."""
    for g in iter_graphs(graph):
        for node in g.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                node.doc_string = STRUCTURAL_CONSTANT


class GraphBuilder:
    """Adds nodes and initializers to ``graph`` (in place), every new name prefixed by
    ``prefix`` and unique across the graph and its subgraphs."""

    def __init__(self, graph: GraphProto, opset: int, prefix: str):
        self.graph = graph
        self.opset = opset
        self.prefix = prefix
        self._values = NameScope(all_names(graph))
        self._nodes = NameScope(n.name for g in iter_graphs(graph) for n in g.node if n.name)

    def op(
        self, op_type: str, *inputs: str, out: str | None = None, hint: str = "", **attributes
    ) -> str:
        """Append ``op_type(inputs)`` and return its output name: ``out`` if given, else a
        fresh ``<prefix>_<hint>`` (the hint defaults to the op type)."""
        if out is None:
            out = self._values.unique(f"{self.prefix}_{hint or op_type.lower()}")
        else:
            self._values.reserve(out)
        node_name = self._nodes.unique(f"{self.prefix}_{op_type}")
        self.graph.node.append(
            helper.make_node(op_type, list(inputs), [out], name=node_name, **attributes)
        )
        return out

    def const(self, value: np.ndarray, base: str) -> str:
        """Append a ``Constant`` node holding ``value`` and return its output name.

        Not an initializer, and marked :data:`STRUCTURAL_CONSTANT`: loss coefficients, axes
        and a lowering's masks must never be taken for weights.
        """
        name = self._values.unique(f"{self.prefix}_{base}")
        tensor = numpy_helper.from_array(np.asarray(value), name=name)
        node_name = self._nodes.unique(f"{self.prefix}_Constant")
        self.graph.node.append(
            helper.make_node(
                "Constant", [], [name], name=node_name, value=tensor, doc_string=STRUCTURAL_CONSTANT
            )
        )
        return name

    def nested(self, graph: GraphProto) -> GraphBuilder:
        """A builder appending to ``graph`` (a Loop/Scan/If body) with this builder's opset and
        prefix, whose new names stay unique across both graphs."""
        sub = GraphBuilder(graph, self.opset, self.prefix)
        sub._values, sub._nodes = self._values, self._nodes
        return sub

    def fresh(self, hint: str) -> str:
        """A new value name ``<prefix>_<hint>`` (made unique), for a subgraph's inputs."""
        return self._values.unique(f"{self.prefix}_{hint}")

    def is_used(self, name: str) -> bool:
        """Whether ``name`` already names a value of the graph (or one this builder made)."""
        return name in self._values

    def initializer(self, value: np.ndarray, base: str, doc_string: str = "") -> str:
        """Append an initializer holding ``value`` (a weight when it holds floats, unless
        ``doc_string`` is :data:`FITTED_STATISTIC`) and return its name, ``<prefix>_<base>``
        made unique."""
        name = self._values.unique(f"{self.prefix}_{base}")
        tensor = numpy_helper.from_array(np.asarray(value), name=name)
        tensor.doc_string = doc_string
        self.graph.initializer.append(tensor)
        return name

    def reduce(
        self,
        op_type: str,
        x: str,
        axes: list[int] | None = None,
        keepdims: int = 0,
        out: str | None = None,
        hint: str = "",
    ) -> str:
        """``op_type`` (a Reduce* op) over ``axes``, all axes when ``None``.

        Axes are an input from opset 13 for ReduceSum and from 18 for the others, an
        attribute before.
        """
        if axes is None:
            return self.op(op_type, x, out=out, hint=hint, keepdims=keepdims)
        axes_as_input = reduce_axes_are_input(op_type, self.opset)
        if axes_as_input:
            axes_name = self.const(np.array(axes, dtype=np.int64), "axes")
            return self.op(op_type, x, axes_name, out=out, hint=hint, keepdims=keepdims)
        return self.op(op_type, x, out=out, hint=hint, axes=list(axes), keepdims=keepdims)

    def rename_output(self, value: str, name: str) -> str:
        """Make the node that computes ``value`` write ``name`` instead; return ``name``."""
        node = next(n for n in reversed(self.graph.node) if value in n.output)
        self._values.reserve(name)
        node.output[list(node.output).index(value)] = name
        return name
