r"""Rewrites of the forward graph that leave every value a user can see unchanged and make
the gradient cheaper.

* ``MaxPool(Relu(x))`` becomes ``Relu(MaxPool(x))``. ReLU is non-decreasing, so
  :math:`\max_i \mathrm{relu}(x_i) = \mathrm{relu}(\max_i x_i)` exactly, in floating point
  too (NaNs aside), whatever the pads or ``ceil_mode`` (every window holds at least one
  element of ``x``).
  The gradient is the same: where the window's maximum is positive both route ``g`` to its
  first occurrence; where it is not, both give 0 (the ReLU's derivative at a non-positive
  input). The ReLU and its gradient then run on the pooled tensor, ``k^2`` times smaller for
  a ``k x k`` pool (the conv, ReLU, pool blocks of LeNet- and VGG-like networks).
* Gathers taking every slice of an axis become one ``Split`` (:func:`gathers_as_split`).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from onnx import GraphProto, NodeProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import NameScope, all_names, is_default_op
from onnxgrad.graph._scopes import node_inputs

#: largest axis whose slices :func:`gathers_as_split` turns into a Split
MAX_UNBIND = 16


def pool_before_relu(graph: GraphProto) -> int:
    """Swap every ``Relu`` -> ``MaxPool`` pair of ``graph`` (not its subgraphs) whose ReLU
    output only that pool reads and whose pool has no ``Indices`` output; returns how many.
    The pool's output keeps its name, now given by the ReLU."""
    if not any(is_default_op(node, "MaxPool") for node in graph.node):
        return 0
    readers = Counter(name for node in graph.node for name in node_inputs(node))
    readers.update(output.name for output in graph.output)
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output}
    scope = NameScope(all_names(graph))
    swapped = 0
    for index, pool in enumerate(graph.node):
        if not is_default_op(pool, "MaxPool") or len([o for o in pool.output if o]) != 1:
            continue
        source = producer.get(pool.input[0])
        relu = graph.node[source] if source is not None else None
        if relu is None or not is_default_op(relu, "Relu") or readers[relu.output[0]] != 1:
            continue
        pooled = scope.unique(f"{pool.output[0]}_before_relu")
        x, y = relu.input[0], pool.output[0]
        pool.input[0], pool.output[0] = x, pooled
        relu.input[0], relu.output[0] = pooled, y
        _swap(graph, source, index)
        producer[pooled], producer[y] = source, index
        swapped += 1
    return swapped


def _swap(graph: GraphProto, first: int, second: int) -> None:
    """Exchange two nodes: the pool takes the ReLU's place, before its own readers."""
    a, b = NodeProto(), NodeProto()
    a.CopyFrom(graph.node[first])
    b.CopyFrom(graph.node[second])
    graph.node[first].CopyFrom(b)
    graph.node[second].CopyFrom(a)


def gathers_as_split(graph: GraphProto, types: dict, opset: int) -> int:
    """Replace the ``Gather``s that take every slice of a tensor along one axis once each
    (constant scalar indices ``0 ... n-1`` of an axis of static size ``n``: PyTorch's
    ``unbind`` of a packed query/key/value projection) by one ``Split`` into slices of 1
    and a ``Squeeze`` per slice; returns how many groups. Each Gather's output keeps its
    name and its values (``Gather(x, i, axis) = Squeeze(Split(x, axis)[i], axis)``).

    The gradient becomes one ``Concat`` of the slices' gradients, where the Gathers' sum
    of ``n`` scatters into zeros of ``x``'s shape held ``2n`` tensors of that size at once.
    """
    if opset < 11:
        return 0
    constants = _int_constants(graph)
    groups: dict[tuple[str, int], dict[int, int]] = {}
    for index, node in enumerate(graph.node):
        key_position = _unbind_slice(node, types, constants)
        if key_position is not None:
            key, position = key_position
            groups.setdefault(key, {}).setdefault(position, index)
    if not groups:
        return 0
    scope = NameScope(all_names(graph))
    replaced: dict[int, list[NodeProto]] = {}
    removed: set[int] = set()
    count = 0
    for (data, axis), positions in groups.items():
        size = types[data].shape[axis]
        gathers = [graph.node[i] for i in positions.values()]
        if sorted(positions) != list(range(size)) or len(gathers) != size:
            continue
        first = min(positions.values())
        replaced[first] = _split_nodes(graph, data, axis, positions, scope, opset)
        piece = (*types[data].shape[:axis], 1, *types[data].shape[axis + 1 :])
        for name in replaced[first][0].output:
            types[name] = type(types[data])(types[data].elem_type, piece)
        removed.update(positions.values())
        count += 1
    if count:
        nodes = []
        for index, node in enumerate(graph.node):
            if index in replaced:
                nodes.extend(replaced[index])
            elif index not in removed:
                nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
    return count


def _int_constants(graph: GraphProto) -> dict[str, int]:
    """Scalar integer constants of ``graph`` (initializers and ``Constant`` outputs)."""
    tensors = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if is_default_op(node, "Constant") and node.attribute[0].name == "value":
            tensors[node.output[0]] = node.attribute[0].t
    values = {}
    for name, tensor in tensors.items():
        if not tensor.dims and tensor.data_type in (TensorProto.INT64, TensorProto.INT32):
            values[name] = int(numpy_helper.to_array(tensor))
    return values


def _unbind_slice(node: NodeProto, types: dict, constants: dict[str, int]):
    """``((data, axis), position)`` of a Gather of one constant scalar index along an axis
    of static size, else ``None``."""
    if not is_default_op(node, "Gather") or node.input[1] not in constants:
        return None
    value = types.get(node.input[0])
    if value is None or value.shape is None:
        return None
    rank = len(value.shape)
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    axis = axis + rank if axis < 0 else axis
    size = value.shape[axis] if 0 <= axis < rank else None
    if not isinstance(size, int) or not 1 < size <= MAX_UNBIND:
        return None
    position = constants[node.input[1]]
    position = position + size if position < 0 else position
    return ((node.input[0], axis), position) if 0 <= position < size else None


def _split_nodes(graph, data, axis, positions, scope, opset) -> list[NodeProto]:
    size = len(positions)
    pieces = [scope.unique(f"{data}_slice{i}") for i in range(size)]
    split_attrs = {"axis": axis}
    if opset >= 18:
        split_attrs["num_outputs"] = size
    nodes = [
        helper.make_node("Split", [data], pieces, name=scope.unique(f"{data}_Split"), **split_attrs)
    ]
    axes_name = scope.unique(f"{data}_axis")
    if opset >= 13:
        nodes.append(
            helper.make_node(
                "Constant",
                [],
                [axes_name],
                name=scope.unique(f"{data}_axis_Constant"),
                value=numpy_helper.from_array(np.array([axis], dtype=np.int64)),
            )
        )
    for position, index in sorted(positions.items()):
        gather = graph.node[index]
        inputs, attrs = (
            ([pieces[position], axes_name], {})
            if opset >= 13
            else (
                [pieces[position]],
                {"axes": [axis]},
            )
        )
        squeeze = helper.make_node(
            "Squeeze", inputs, [gather.output[0]], name=gather.name or None, **attrs
        )
        squeeze.metadata_props.extend(gather.metadata_props)
        nodes.append(squeeze)
    return nodes
