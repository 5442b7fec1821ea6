"""Appending nodes with fresh names to a graph under construction."""

from __future__ import annotations

import numpy as np
from onnx import (
    AttributeProto,
    GraphProto,
    ModelProto,
    NodeProto,
    helper,
    numpy_helper,
)

from onnxgrad._onnx_utils import NameScope, all_names, np_dtype


class StepBuilder:
    """Appends nodes to ``graph`` in place; every new value and node name is unique.

    Constants are ``Constant`` nodes, never initializers, so nothing added here can be taken
    for a weight.
    """

    def __init__(self, graph: GraphProto, opset: int):
        self.graph = graph
        self.opset = opset
        self.names = NameScope(all_names(graph))
        self.node_names = NameScope(n.name for n in graph.node if n.name)

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attributes) -> str:
        """Append ``op_type(inputs)``; returns its output (``out``, or a fresh name)."""
        if out is None:
            out = self.names.unique(f"{op_type.lower()}_out")
        else:
            self.names.reserve(out)
        self.graph.node.append(
            helper.make_node(
                op_type,
                list(inputs),
                [out],
                name=self.node_names.unique(f"step_{op_type}"),
                **attributes,
            )
        )
        return out

    def const(self, value, elem_type: int, base: str = "cst") -> str:
        """A ``Constant`` node holding ``value`` with ONNX element type ``elem_type``."""
        name = self.names.unique(base)
        tensor = numpy_helper.from_array(np.asarray(value, dtype=np_dtype(elem_type)), name=name)
        self.graph.node.append(
            helper.make_node(
                "Constant", [], [name], name=self.node_names.unique("step_Constant"), value=tensor
            )
        )
        return name

    def reduce_sum(self, x: str) -> str:
        """The sum of every element of ``x``, a rank-0 tensor (the same node at any opset)."""
        return self.op("ReduceSum", x, keepdims=0)

    def input(self, base: str, elem_type: int, shape) -> str:
        """Declare a new graph input named ``base`` (made unique); returns its name."""
        name = self.names.unique(base)
        self.graph.input.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name


def inline_model(b: StepBuilder, model: ModelProto, feeds: dict[str, str]) -> dict[str, str]:
    """Append the nodes of ``model``'s graph, its inputs fed by ``feeds``.

    Every value the graph computes gets a fresh name; returns ``{graph output: new name}``.
    The graph must not hold initializers, subgraphs or local functions (the authored graphs
    of :mod:`onnxgrad.functions` do not).
    """
    graph = model.graph
    if graph.initializer or model.functions:
        raise ValueError(f"cannot inline graph {graph.name!r}: it has initializers or functions")
    missing = [i.name for i in graph.input if i.name not in feeds]
    if missing:
        raise ValueError(f"inlining graph {graph.name!r}: no value fed to inputs {missing}")
    names = {i.name: feeds[i.name] for i in graph.input}
    for node in graph.node:
        if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attribute):
            raise ValueError(
                f"cannot inline graph {graph.name!r}: node {node.name!r} has subgraphs"
            )
        copy = NodeProto()
        copy.CopyFrom(node)
        del copy.input[:], copy.output[:]
        copy.input.extend(names[i] if i else "" for i in node.input)
        for out in node.output:
            names[out] = b.names.unique(f"{graph.name}_{out}") if out else ""
        copy.output.extend(names[o] for o in node.output)
        copy.name = b.node_names.unique(f"{graph.name}_{node.op_type}")
        b.graph.node.append(copy)
    return {o.name: names[o.name] for o in graph.output}


def rename_values(graph: GraphProto, renames: dict[str, str]) -> None:
    """Rename values in every node of ``graph`` (whose nodes hold no subgraph)."""
    for node in graph.node:
        for i, name in enumerate(node.output):
            node.output[i] = renames.get(name, name)
        for i, name in enumerate(node.input):
            node.input[i] = renames.get(name, name)
