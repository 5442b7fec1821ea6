r"""A LoRA branch beside a convolution, for adapters fed at run time.

:func:`onnxgrad.graph.lora.add_lora` adapts a ``Conv`` kernel ``W`` of shape
``[O, I/g, k_1, ..., k_d]`` (``g`` groups) with ``A`` of shape ``[O, r]`` and ``B`` of shape
``[r, (I/g) k_1 ... k_d]``: the kernel becomes ``W + s reshape(A B, shape(W))``. A kernel
computed per run is no constant, so onnxruntime cannot reorder it into its blocked (NCHWc)
layout at session creation. A convolution is linear in its kernel, so the same output is

    Conv(x, W + s reshape(A B)) = Conv(x, W) + s branch(x),

with, for ``x`` of shape ``[N, I, ...]`` read as ``g`` groups of ``I/g`` channels,

    z = Conv(reshape(x, [N g, I/g, ...]), reshape(B, [r, I/g, k_1, ..., k_d]))
    branch(x) = Conv(reshape(z, [N, g r, ...]), reshape(A, [O, r, 1, ..., 1]), group=g),

the first convolution with the kernel's strides, pads, dilations and ``auto_pad`` (the
output positions of the original), the second a ``1 x ... x 1`` one: group ``j``'s output
channel ``o`` sums ``A[o, :]`` times the ``r`` maps of group ``j``'s channels. Without groups
no reshape is needed. The bias stays on ``Conv(x, W)``, whose kernel stays a constant.
It costs ``r (g (I/g) k + O)`` multiply-adds per output position where the kernel's own
convolution costs ``(I/g) k O`` (``k = k_1 ... k_d``): a few percent beside a wide dense
convolution, ``r (k + 1) / k`` times the convolution itself beside a depthwise one. ``A``
and ``B`` are graph inputs, so onnxruntime runs the branch's convolutions on its generic
kernel (im2col, then a GEMM of ``r`` rows) and sums one more ``Add``: measured faster than
the update only beside wide, dense, unstrided convolutions
(:func:`onnxgrad.graph.lora_choice.conv_branch_pays` chooses, ``s`` is applied to ``A``).
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import np_dtype, subgraphs

#: the attributes of a ``Conv`` that place its output positions (the branch's first ``Conv`` too)
PLACEMENT = ("auto_pad", "dilations", "pads", "strides", "kernel_shape")


def conv_readers(graph, weight: str) -> list[NodeProto] | None:
    """The ``Conv`` nodes reading the float32 or float64 ``weight`` as their kernel, or
    ``None`` where another node (a subgraph's too), another input of a ``Conv`` or a graph
    output reads it, or it has another type (a float16 kernel keeps the update)."""
    init = next((i for i in graph.initializer if i.name == weight), None)
    if init is None or init.data_type not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        return None
    if len(init.dims) < 3 or weight in {o.name for o in graph.output}:
        return None
    readers = [node for node in graph.node if weight in node.input]
    if not readers or not all(_reads_kernel(node, weight) for node in readers):
        return None
    if any(_read_inside(sub, weight) for node in graph.node for sub in subgraphs(node)):
        return None  # the update's rewire names that reader
    return readers


def _read_inside(graph, name: str) -> bool:
    return any(
        name in node.input or any(_read_inside(sub, name) for sub in subgraphs(node))
        for node in graph.node
    )


def _reads_kernel(node: NodeProto, weight: str) -> bool:
    return (
        node.op_type == "Conv"
        and node.domain in ("", "ai.onnx")
        and len(node.input) > 1
        and node.input[1] == weight
        and weight not in (node.input[0], *node.input[2:])
    )


def conv_shape(init, conv: NodeProto) -> tuple[int, int, int, int]:
    """``(g, I/g, k, O)`` of ``conv`` over the kernel ``init`` (``k`` its spatial size)."""
    groups = next((a.i for a in conv.attribute if a.name == "group"), 1)
    dims = list(init.dims)
    return int(groups), int(dims[1]), int(np.prod(dims[2:], dtype=np.int64)), int(dims[0])


def strided(conv: NodeProto) -> bool:
    """Whether one of ``conv``'s strides exceeds 1."""
    return any(s > 1 for a in conv.attribute if a.name == "strides" for s in a.ints)


def add_conv_branches(graph, init, adapter: dict, rank: int, names, node_names) -> dict:
    """Beside each ``Conv`` of ``graph`` reading the kernel ``init`` (:func:`conv_readers`),
    its output plus ``s branch(x)`` (module docstring) where its output was: the ``Conv``
    writes ``<y>_without_lora``. Returns the branch's nodes by the name of the ``Conv`` they
    follow, for the caller to insert (``deployed_products.insert_after``); a ``Conv``
    without a name gets one."""
    readers = conv_readers(graph, init.name)
    if readers is None:
        raise ValueError(f"{init.name!r} is not a float kernel that only Conv nodes read")
    added = {}
    for conv in readers:
        if not conv.name:
            conv.name = node_names.unique(f"{init.name}_Conv")
        added[conv.name] = _branch(conv, init, adapter, rank, names, node_names)
    return added


def _branch(conv: NodeProto, init, adapter: dict, rank: int, names, node_names) -> list:
    """The nodes of ``Conv(x, W) + s branch(x)`` beside ``conv`` (renamed ``<y>_without_lora``)."""
    groups, per_group, _, outputs = conv_shape(init, conv)
    spatial = len(init.dims) - 2
    base = init.name
    nodes: list[NodeProto] = []

    def add(op, inputs, **attrs):
        out = names.unique(f"{base}_lora_{op}")
        nodes.append(helper.make_node(op, inputs, [out], name=node_names.unique(out), **attrs))
        return out

    def shape(values):
        value = numpy_helper.from_array(np.asarray(values, dtype=np.int64))
        return add("Constant", [], value=value)

    a = adapter["a"]
    if adapter["scale"] != 1:  # on the O x r factor, not on the N x O x ... output
        scale = np.asarray(adapter["scale"], dtype=np_dtype(init.data_type))
        a = add("Mul", [a, add("Constant", [], value=numpy_helper.from_array(scale))])
    kernel_b = add("Reshape", [adapter["b"], shape([rank, per_group, *init.dims[2:]])])
    kernel_a = add("Reshape", [a, shape([outputs, rank] + [1] * spatial)])
    x = conv.input[0]
    if groups > 1:  # [N, I, ...] as [N g, I/g, ...]
        x = add("Reshape", [x, shape([-1, per_group] + [0] * spatial)])
    z = add("Conv", [x, kernel_b])
    nodes[-1].attribute.extend(a for a in conv.attribute if a.name in PLACEMENT)
    if groups > 1:  # [N g, r, ...] as [N, g r, ...]
        z = add("Reshape", [z, shape([-1, groups * rank] + [0] * spatial)])
    delta = add("Conv", [z, kernel_a], group=groups)
    y = conv.output[0]
    conv.output[0] = names.unique(f"{y}_without_lora")
    add("Add", [conv.output[0], delta])
    nodes[-1].output[0] = y
    return nodes


__all__ = ["add_conv_branches", "conv_readers", "conv_shape", "strided"]
