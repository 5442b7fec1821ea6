"""Weights stored as ``Constant`` nodes (paddle2onnx, spox...) become initializers.

A float ``Constant`` is promoted when it holds a parameter: it reaches an output through
inputs the op schemas mark differentiable (:mod:`onnxgrad.graph._differentiable`: not a
Resize scale, a Clip bound, a Pad value...) and it has more than one element or is read
in a layer's parameter slot (a Conv or Gemm kernel or bias, a normalisation scale or bias,
a recurrent weight, a PRelu slope). A scalar read elsewhere (an epsilon, a scale, a fill
value) is a structural constant and stays a node. Constants
inside subgraphs (``If`` branches, loop bodies) become initializers of the main graph, which
every subgraph reads by outer scope, and so do a subgraph's own float initializers that hold
a parameter by the same rule (a ``Scan`` body's kernels): their names are unique in the
model, so the subgraph reads the same values. The constants onnxgrad's own rewrites emit are marked
structural (:data:`~onnxgrad.graph._builder.STRUCTURAL_CONSTANT`) and stay nodes. Which
initializers are trainable is decided later, by role (:func:`onnxgrad.get_train_initializer`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from onnx import (
    AttributeProto,
    GraphProto,
    ModelProto,
    NodeProto,
    TensorProto,
    helper,
    numpy_helper,
)

from onnxgrad._onnx_utils import FLOAT_TYPES, normalize_domain, np_dtype, subgraphs
from onnxgrad.graph._builder import STRUCTURAL_CONSTANT
from onnxgrad.graph._differentiable import differentiable_values, model_opsets
from onnxgrad.graph._scopes import node_inputs

#: ``(op_type, input index)`` of the default domain that hold a layer's parameters.
PARAMETER_SLOTS = frozenset(
    {
        *(("Conv", i) for i in (1, 2)),
        *(("ConvTranspose", i) for i in (1, 2)),
        *(("Gemm", i) for i in (0, 1, 2)),
        ("MatMul", 0),
        ("MatMul", 1),
        *(("BatchNormalization", i) for i in (1, 2)),
        *(("InstanceNormalization", i) for i in (1, 2)),
        *(("LayerNormalization", i) for i in (1, 2)),
        *(("GroupNormalization", i) for i in (1, 2)),
        ("RMSNormalization", 1),
        *((op, i) for op in ("LSTM", "GRU", "RNN") for i in (1, 2, 3)),
        ("PRelu", 1),
    }
)


def promote_constant_weights(model: ModelProto) -> ModelProto:
    """Move the float ``Constant`` nodes that hold parameters (see the module docstring) to
    initializers of the main graph, same names and values."""
    promote_constants(model)
    return model


#: where a subgraph sits: ``(first output of the node holding it, attribute, index in a
#: list of graphs or -1)`` for each level below the main graph
GraphPath = tuple[tuple[str, str, int], ...]


class Shell(NamedTuple):
    """A promoted ``Constant`` node without its tensor (``None`` for a subgraph's
    initializer), and the graph it was in."""

    node: NodeProto | None
    path: GraphPath


def promote_constants(model: ModelProto) -> dict[str, Shell]:
    """:func:`promote_constant_weights` in place; what the promoted nodes were (in any
    graph), by output name, without their tensor (:func:`restore_constants` puts them
    back)."""
    chosen = constant_weights(model)
    if not chosen:
        return {}
    promoted, shells = [], {}
    for graph, path in _graph_paths(model.graph):
        kept = []
        for node in graph.node:
            tensor = _float_constant(node) if node.output and node.output[0] in chosen else None
            if tensor is None:
                kept.append(node)
                continue
            tensor.name = node.output[0]
            promoted.append(tensor)
            shells[node.output[0]] = Shell(_shell(node), path)
        if len(kept) != len(graph.node):
            del graph.node[:]
            graph.node.extend(kept)
        if graph is not model.graph:
            lifted = _lifted_initializers(graph, chosen)
            promoted += lifted
            shells.update((init.name, Shell(None, path)) for init in lifted)
    model.graph.initializer.extend(promoted)
    return shells


def _lifted_initializers(graph: GraphProto, chosen: set[str]) -> list[TensorProto]:
    """The initializers of ``graph`` (a subgraph) named in ``chosen``, taken out of it."""
    lifted = [init for init in graph.initializer if init.name in chosen]
    if lifted:
        kept = [init for init in graph.initializer if init.name not in chosen]
        lifted = [_copied(init) for init in lifted]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return lifted


def _copied(tensor: TensorProto) -> TensorProto:
    copy = TensorProto()
    copy.CopyFrom(tensor)
    return copy


def restore_constants(graph: GraphProto, shells: Mapping[str, Shell]) -> None:
    """Put promoted ``Constant`` nodes and subgraph initializers back into the graphs they
    were in (``shells`` of :func:`promote_constants`, some of them; a node goes to the main
    graph where its subgraph's holder is gone), their values taken from the main graph's
    initializers of those names, which go; each node goes before the first node reading it."""
    if not shells:
        return
    nodes, lifted = {}, {}
    for init in graph.initializer:
        shell = shells.get(init.name)
        if shell is not None and shell.node is None:
            home = _locate(graph, shell.path)
            if home is not None:  # else it stays a main-graph initializer
                lifted[init.name] = (home, _copied(init))
        elif shell is not None:
            node = nodes[init.name] = NodeProto()
            node.CopyFrom(shell.node)
            if not node.attribute:  # a ``value`` tensor: the initializer's
                value = node.attribute.add(name="value", type=AttributeProto.TENSOR)
                value.t.CopyFrom(init)
    kept = [
        init for init in graph.initializer if init.name not in nodes and init.name not in lifted
    ]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    for home, init in lifted.values():
        home.initializer.append(init)
    by_graph: dict[GraphPath, dict[str, NodeProto]] = {}
    for name, node in nodes.items():
        path = shells[name].path
        by_graph.setdefault(path if _locate(graph, path) is not None else (), {})[name] = node
    for path, restored in by_graph.items():
        _insert_before_readers(_locate(graph, path), restored)


def _insert_before_readers(graph: GraphProto, nodes: dict[str, NodeProto]) -> None:
    rebuilt = []
    for node in graph.node:
        used = node_inputs(node)
        rebuilt += [nodes.pop(name) for name in [n for n in nodes if n in used]]
        rebuilt.append(node)
    del graph.node[:]
    graph.node.extend([*nodes.values(), *rebuilt])


def _graph_paths(graph: GraphProto, path: GraphPath = ()):
    """Each graph of the model with its :data:`GraphPath`, depth first."""
    yield graph, path
    for node in graph.node:
        holder = next((o for o in node.output if o), "")
        for attribute in node.attribute:
            if attribute.type == AttributeProto.GRAPH:
                yield from _graph_paths(attribute.g, (*path, (holder, attribute.name, -1)))
            elif attribute.type == AttributeProto.GRAPHS:
                for index, sub in enumerate(attribute.graphs):
                    yield from _graph_paths(sub, (*path, (holder, attribute.name, index)))


def _locate(graph: GraphProto, path: GraphPath) -> GraphProto | None:
    """The subgraph at ``path`` below ``graph`` (``None`` when its holder is gone)."""
    for holder, name, index in path:
        node = next((n for n in graph.node if holder and holder in n.output), None)
        attribute = next((a for a in node.attribute if a.name == name), None) if node else None
        if attribute is None:
            return None
        if index < 0:
            graph = attribute.g
        elif index < len(attribute.graphs):
            graph = attribute.graphs[index]
        else:
            return None
    return graph


def _shell(node: NodeProto) -> NodeProto:
    """``node`` without its ``value`` tensor (its other attributes are a few floats)."""
    shell = NodeProto(name=node.name, op_type=node.op_type, domain=node.domain)
    shell.output.extend(node.output)
    shell.attribute.extend(a for a in node.attribute if a.name != "value")
    shell.metadata_props.extend(node.metadata_props)
    shell.doc_string = node.doc_string
    return shell


def constant_weights(model: ModelProto) -> set[str]:
    """The outputs of the ``Constant`` nodes, and the subgraphs' initializers,
    :func:`promote_constant_weights` promotes."""
    if not any(_float_constant_node(n) for g in _graphs(model.graph) for n in g.node) and not any(
        _float_initializers(g) for g in _subgraphs(model.graph)
    ):
        return set()  # no candidate: the analyses below would find nothing
    counts = _name_counts(model.graph)
    slots = _parameter_reads(model.graph)
    opsets = model_opsets(model)
    live = set().union(*(differentiable_values(g, opsets, {}) for g in _graphs(model.graph)))
    chosen = set()
    for graph in _graphs(model.graph):
        for node in graph.node:
            name = node.output[0] if len(node.output) == 1 else ""
            if counts[name] == 1 and name in live and _is_parameter(node, name, slots):
                chosen.add(name)
    for graph in _subgraphs(model.graph):
        for init in _float_initializers(graph):
            held = int(np.prod(init.dims)) > 1 or init.name in slots
            if counts[init.name] == 1 and init.name in live and held:
                chosen.add(init.name)
    return chosen


def _subgraphs(graph: GraphProto):
    """Every graph of the model but the main one."""
    return itertools.islice(_graphs(graph), 1, None)


def _float_initializers(graph: GraphProto) -> list[TensorProto]:
    return [init for init in graph.initializer if init.data_type in FLOAT_TYPES]


def _graphs(graph: GraphProto):
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from _graphs(sub)


def _float_constant_node(node: NodeProto) -> bool:
    """Whether ``node`` is a default-domain float ``Constant`` (not marked structural)."""
    if node.op_type != "Constant" or normalize_domain(node.domain) or len(node.attribute) != 1:
        return False
    if node.doc_string == STRUCTURAL_CONSTANT:
        return False
    attribute = node.attribute[0]
    if attribute.name == "value":
        return attribute.t.data_type in FLOAT_TYPES
    return attribute.name in ("value_floats", "value_float")


def _float_constant(node: NodeProto) -> TensorProto | None:
    """The value of a default-domain float ``Constant`` node, as a new tensor, or ``None``."""
    if not _float_constant_node(node):
        return None
    attribute = node.attribute[0]
    if attribute.name == "value" and attribute.t.data_type in FLOAT_TYPES:
        tensor = TensorProto()
        tensor.CopyFrom(attribute.t)
        return tensor
    if attribute.name == "value_floats":
        return numpy_helper.from_array(np.array(attribute.floats, dtype=np.float32))
    if attribute.name == "value_float":
        return helper.make_tensor("", TensorProto.FLOAT, [], [attribute.f])
    return None


def _is_parameter(node: NodeProto, name: str, slots: set[str]) -> bool:
    tensor = _float_constant(node)
    if tensor is None:
        return False
    size = int(np.prod(tensor.dims)) if tensor.dims else 1
    return size > 1 or name in slots


def _parameter_reads(graph: GraphProto) -> set[str]:
    """Names read in a :data:`PARAMETER_SLOTS` slot anywhere in the model."""
    names = set()
    for g in _graphs(graph):
        for node in g.node:
            if normalize_domain(node.domain):
                continue
            for index, name in enumerate(node.input):
                if name and (node.op_type, index) in PARAMETER_SLOTS:
                    names.add(name)
    return names


def _name_counts(graph: GraphProto) -> Counter:
    """How many times each name is defined across the model (a promoted name must be
    unique, or moving it to the main graph would change what a subgraph reads)."""
    counts: Counter = Counter()
    for g in _graphs(graph):
        counts.update(i.name for i in g.input)
        counts.update(i.name for i in g.initializer)
        counts.update(o for node in g.node for o in node.output if o)
    return counts


def write_back_constants(model: ModelProto, values: Mapping[str, np.ndarray]) -> dict:
    """Write, in place, the ``values`` of weights that normalisation promoted back into the
    ``Constant`` nodes of ``model`` (any graph) and the subgraphs' initializers that hold
    them, in each one's own element type; the values of other names are returned, for the
    main graph's initializers."""
    remaining = dict(values)
    for graph in _subgraphs(model.graph):
        for init in graph.initializer:
            if init.name in remaining:
                dtype = np_dtype(init.data_type)  # not decoding the old values for it
                array = np.asarray(remaining.pop(init.name), dtype=dtype)
                init.CopyFrom(numpy_helper.from_array(array, name=init.name))
    for graph in _graphs(model.graph):
        for node in graph.node:
            name = node.output[0] if len(node.output) == 1 else ""
            tensor = _float_constant(node) if name in remaining else None
            if tensor is None:
                continue
            value = np.asarray(remaining.pop(name), dtype=numpy_helper.to_array(tensor).dtype)
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(value)))
    return remaining
