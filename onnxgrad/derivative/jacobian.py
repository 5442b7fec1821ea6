r"""Whole Jacobians from batched seeds: the columns by forward mode, or the rows by reverse.

For outputs ``y_j`` (``m_j`` values each, ``M`` in all) and sources ``x_i`` (``n_i`` values,
``N`` in all), the Jacobian block ``dy_j/dx_i`` has the shape ``y_j.shape + x_i.shape``
(``torch.func.jacrev``'s layout). Forward mode feeds the ``N`` columns of the identity as
tangents (``onnx_jvp(seeds=N)``) and reads ``J e_k`` as column ``k``; reverse mode feeds the
``M`` rows as output gradients (``onnx_derivative(seeds=M)``) and reads ``J^T e_k`` as row
``k``. ``mode="auto"`` runs the fewer seeds, reverse on a tie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from onnx import ModelProto, ValueInfoProto, helper, numpy_helper

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    NameScope,
    all_names,
    finalize_model,
    replace_repeated,
)
from onnxgrad.derivative.api import onnx_derivative, resolve_request
from onnxgrad.derivative.forward import onnx_jvp
from onnxgrad.derivative.options import DerivativeOptions
from onnxgrad.normalize import normalized_model

MODES = ("auto", "rev", "fwd")


def onnx_jacobian(
    model: ModelLike,
    weights: Sequence[str] | None = (),
    inputs: Sequence[str] | None = None,
    mode: str = "auto",
) -> ModelProto:
    """The Jacobian of every float output ``y`` with respect to every differentiated input
    or weight ``x``, as outputs ``d<y>_d<x>`` of shape ``y.shape + x.shape``.

    The graph takes the model's inputs and the differentiated weights. Every shape must be
    static (the seed count is the number of values).

    :param model: ModelProto or path; never modified.
    :param weights: initializers to differentiate (they become inputs); ``None`` means every
        trainable weight, the default ``()`` none.
    :param inputs: graph inputs to differentiate; ``None`` means every float input.
    :param mode: ``"rev"`` (one reverse pass per output value, as ``jacrev``), ``"fwd"`` (one
        tangent per source value, as ``jacfwd``), ``"auto"``: the one with fewer seeds.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    model = normalized_model(model)
    request = resolve_request(
        model, weights, inputs, DerivativeOptions.Zero, None, None, outputs=None
    )
    sources = [*request.inputs, *request.weights]
    outputs = [o.name for o in model.graph.output if o.name in request.outputs]
    shapes = _static_shapes(model, sources, outputs)
    n_sources = sum(math.prod(shapes[x]) for x in sources)
    n_outputs = sum(math.prod(shapes[y]) for y in outputs)
    if mode == "fwd" or (mode == "auto" and n_sources < n_outputs):
        jvp = onnx_jvp(model, request.weights, request.inputs, seeds=n_sources)
        return _forward_blocks(jvp, sources, outputs, shapes)
    gradient = onnx_derivative(
        model, request.weights, request.inputs, outputs=outputs, seeds=n_outputs
    )
    return _reverse_blocks(gradient, sources, outputs, shapes)


def _static_shapes(model: ModelProto, sources, outputs) -> dict[str, tuple[int, ...]]:
    """The shape of every source and output, ``ValueError`` naming one that is not static."""
    graph = model.graph
    infos: dict[str, ValueInfoProto] = {i.name: i for i in [*graph.input, *graph.output]}
    shapes = {i.name: tuple(i.dims) for i in graph.initializer}
    for name in [*sources, *outputs]:
        if name in shapes and name not in infos:
            continue
        tensor = infos[name].type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if not tensor.HasField("shape") or None in dims:
            raise ValueError(
                f"onnx_jacobian needs static shapes: {name!r} has the shape "
                f"{dims if tensor.HasField('shape') else 'unknown'}"
            )
        shapes[name] = tuple(dims)
    return shapes


class _Nodes:
    """Nodes appended to a graph, with fresh names."""

    def __init__(self, graph):
        self.graph = graph
        self.scope = NameScope(all_names(graph))
        self.nodes: list = []

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        out = out or self.scope.unique(f"jacobian_{op_type}")
        name = self.scope.unique(f"jacobian_{op_type}_node")  # onnxruntime's fusions need names
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=name, **attrs))
        return out

    def ints(self, values) -> str:
        name = self.scope.unique("jacobian_const")
        tensor = numpy_helper.from_array(np.array(values, dtype=np.int64), name)
        node = self.scope.unique("jacobian_Constant_node")
        self.nodes.append(helper.make_node("Constant", [], [name], name=node, value=tensor))
        return name

    def identity_slices(self, size: int, sizes: list[int], elem_type: int) -> list:
        """The identity of ``size`` split into column blocks of ``sizes``: seed ``k`` of
        block ``i`` is its row ``k``."""
        zeros = self.op("ConstantOfShape", [self.ints([size, size])])
        eye = self.op("EyeLike", [zeros], dtype=elem_type)
        blocks, start = [], 0
        for count in sizes:
            bounds = [self.ints([start]), self.ints([start + count]), self.ints([1])]
            blocks.append(self.op("Slice", [eye, *bounds]))
            start += count
        return blocks


def _elem_types(model: ModelProto) -> dict[str, int]:
    infos = [*model.graph.input, *model.graph.output]
    return {i.name: i.type.tensor_type.elem_type for i in infos}


def _forward_blocks(jvp: ModelProto, sources, outputs, shapes) -> ModelProto:
    """Identity columns as the tangents, ``J`` read back as ``[N, m] -> m x N`` blocks."""
    return _blocks(jvp, (sources, "_tangent"), (outputs, "_tangent"), shapes, forward=True)


def _reverse_blocks(gradient: ModelProto, sources, outputs, shapes) -> ModelProto:
    """Identity rows as the output gradients, ``J^T`` read back as ``[M, n]`` blocks."""
    return _blocks(gradient, (outputs, "_grad"), (sources, "_grad"), shapes, forward=False)


def _blocks(model: ModelProto, seeded, read, shapes, forward: bool) -> ModelProto:
    """``model`` with its seed inputs ``<v><suffix>`` (``v`` in ``seeded``) fed the identity,
    and the stacked results ``<u><suffix>`` (``u`` in ``read``, ``K`` seeds by ``size(u)``)
    cut into the blocks ``d<y>_d<x>`` (``J``'s layout: transposed first in forward mode)."""
    (seeded, seed_suffix), (read, read_suffix) = seeded, read
    types = _elem_types(model)
    nodes = _Nodes(model.graph)
    sizes = [math.prod(shapes[v]) for v in seeded]
    seeds = [f"{v}{seed_suffix}" for v in seeded]
    _seed_with_identity(nodes, seeds, [shapes[v] for v in seeded], types[seeds[0]])
    head, nodes.nodes = nodes.nodes, []
    results = []
    for u in read:
        stacked = nodes.op("Reshape", [f"{u}{read_suffix}", nodes.ints([sum(sizes), -1])])
        if forward:
            stacked = nodes.op("Transpose", [stacked], perm=[1, 0])
        pairs = [(u, v) if forward else (v, u) for v in seeded]
        blocks = {f"d{y}_d{x}": ((*shapes[y], *shapes[x]), n) for (y, x), n in zip(pairs, sizes)}
        results += _split_blocks(nodes, stacked, int(forward), blocks, types[f"{u}{read_suffix}"])
    by_name = {r.name: r for r in results}
    outputs, sources = (read, seeded) if forward else (seeded, read)
    ordered = [by_name[f"d{y}_d{x}"] for y in outputs for x in sources]
    return _rewired(model, head, nodes.nodes, set(seeds), ordered)


def _seed_with_identity(nodes: _Nodes, names: list[str], shapes: list, elem_type: int) -> None:
    """``names[i]`` computed as the ``i``-th column block of the identity, each of its
    rows (one seed) reshaped to ``shapes[i]``."""
    sizes = [math.prod(shape) for shape in shapes]
    columns = nodes.identity_slices(sum(sizes), sizes, elem_type)
    for name, shape, block in zip(names, shapes, columns):
        nodes.op("Reshape", [block, nodes.ints([sum(sizes), *shape])], out=name)


def _split_blocks(nodes: _Nodes, matrix: str, axis: int, blocks: dict, elem_type: int) -> list:
    """``matrix`` cut along ``axis`` into consecutive blocks ``{name: (shape, extent along
    axis)}``, each reshaped to its shape; their declarations."""
    infos, start = [], 0
    for name, (shape, count) in blocks.items():
        bounds = [nodes.ints([start]), nodes.ints([start + count]), nodes.ints([axis])]
        nodes.op("Reshape", [nodes.op("Slice", [matrix, *bounds]), nodes.ints(shape)], out=name)
        infos.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        start += count
    return infos


def _rewired(model: ModelProto, head: list, tail: list, seeds: set[str], results) -> ModelProto:
    """``model`` with ``seeds`` computed by ``head`` instead of fed, and ``results`` (made
    by ``tail``) as its only outputs."""
    graph = model.graph
    replace_repeated(graph.input, [i for i in graph.input if i.name not in seeds])
    replace_repeated(graph.node, [*head, *graph.node, *tail])
    replace_repeated(graph.output, results)
    graph.ClearField("value_info")
    if not all(r.type.tensor_type.elem_type in FLOAT_TYPES for r in results):
        raise AssertionError("a Jacobian block without a float type")
    return finalize_model(model)
