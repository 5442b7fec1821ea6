"""Pictures of ONNX graphs: :func:`plot_onnxs` (matplotlib) and :func:`to_dot` (graphviz text).

A model becomes a data-flow graph with one vertex per graph input, initializer, node and
graph output, and one edge per value passed from a producer to a consumer. The picture is
laid out top-down from the topological generations of that graph, so no graphviz binary is
needed; :func:`to_dot` gives the same graph to graphviz users.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import GraphProto, TensorProto, TypeProto, helper

from onnxgrad._onnx_utils import ModelLike, load_model, subgraphs

if TYPE_CHECKING:
    import networkx as nx
    from matplotlib.axes import Axes

__all__ = ["graph_network", "layered_layout", "plot_onnxs", "to_dot"]

Vertex = tuple[str, Any]


@dataclass(frozen=True)
class _Style:
    color: str
    shape: str


#: vertex kind -> colours shared by the matplotlib picture and the DOT text.
STYLES = {
    "input": _Style("#d5f5e3", "ellipse"),
    "initializer": _Style("#eaeded", "note"),
    "node": _Style("#ffffff", "box"),
    "output": _Style("#d6eaf8", "ellipse"),
}


def graph_network(model: ModelLike) -> nx.DiGraph:
    """The data-flow graph of ``model`` (a ModelProto or a path).

    Vertices are ``("input", name)``, ``("initializer", name)``, ``("node", index)`` and
    ``("output", name)``, each with the attributes ``kind``, ``label`` and ``order`` (its rank
    in the graph's own order). An edge carries the list of ``values`` it passes. A node
    holding subgraphs (If, Loop, Scan) is linked to the outer values its subgraphs read.
    """
    import networkx as nx

    graph = load_model(model).graph
    network = nx.DiGraph(name=graph.name)
    producer: dict[str, Vertex] = {}
    initializers = {init.name for init in graph.initializer}

    def add(vertex: Vertex, label: str) -> None:
        network.add_node(vertex, kind=vertex[0], label=label, order=network.number_of_nodes())

    for info in graph.input:
        if info.name not in initializers:
            add(("input", info.name), f"{info.name}\n{type_text(info.type)}")
            producer[info.name] = ("input", info.name)
    for init in graph.initializer:
        add(("initializer", init.name), f"{init.name}\n{tensor_text(init)}")
        producer[init.name] = ("initializer", init.name)
    for index, node in enumerate(graph.node):
        vertex = ("node", index)
        add(vertex, f"{node.op_type}\n{node.name}" if node.name else node.op_type)
        for name in _read_names(node):
            if name in producer:
                _link(network, producer[name], vertex, name)
        producer.update((name, vertex) for name in node.output if name)
    for info in graph.output:
        vertex = ("output", info.name)
        add(vertex, f"{info.name}\n{type_text(info.type)}")
        if info.name in producer:
            _link(network, producer[info.name], vertex, info.name)
    return network


def _link(network: nx.DiGraph, source: Vertex, target: Vertex, value: str) -> None:
    if network.has_edge(source, target):
        values = network.edges[source, target]["values"]
        if value not in values:
            values.append(value)
    else:
        network.add_edge(source, target, values=[value])


def layered_layout(network: nx.DiGraph) -> dict[Hashable, tuple[float, float]]:
    """Top-down positions ``{vertex: (x, y)}``; every edge points downwards.

    The depth of a vertex is its topological generation (the longest path reaching it), except
    for sources with successors — weights mostly — which sit one row above their first
    consumer instead of at the top. Row ``d`` lies at ``y = -d``, centred on ``x = 0``. Rows
    start in graph order, then three sweeps (down, up, down) sort each row by the mean
    abscissa of its neighbours in the rows already placed (the barycentre heuristic against
    edge crossings).
    """
    import networkx as nx

    depth = {v: d for d, layer in enumerate(nx.topological_generations(network)) for v in layer}
    for vertex in network:
        successors = list(network.successors(vertex))
        if network.in_degree(vertex) == 0 and successors:
            depth[vertex] = max(0, min(depth[s] for s in successors) - 1)
    rows: dict[int, list[Hashable]] = {}
    for vertex in sorted(network, key=lambda v: network.nodes[v]["order"]):
        rows.setdefault(depth[vertex], []).append(vertex)
    x = {v: _centred(i, len(row)) for row in rows.values() for i, v in enumerate(row)}
    for neighbours, order in (
        (network.predecessors, sorted(rows)),
        (network.successors, sorted(rows, reverse=True)),
        (network.predecessors, sorted(rows)),
    ):
        for d in order:
            row = sorted(rows[d], key=lambda v, n=neighbours: _barycentre(x, n(v), x[v]))
            rows[d] = row
            x.update((v, _centred(i, len(row))) for i, v in enumerate(row))
    return {v: (x[v], -float(depth[v])) for v in network}


def _centred(index: int, count: int) -> float:
    return index - (count - 1) / 2


def _barycentre(x: dict, neighbours, default: float) -> float:
    xs = [x[n] for n in neighbours]
    return float(np.mean(xs)) if xs else default


def plot_onnxs(
    *models: ModelLike,
    title: str | Sequence[str] | None = None,
    ax: Axes | Sequence[Axes] | None = None,
) -> Axes | np.ndarray:
    """Draw the graphs of ``models`` side by side (matplotlib, no graphviz needed).

    :param models: ModelProtos or paths, one picture each.
    :param title: a title for a single model, or one title per model.
    :param ax: the axes to draw on: one Axes for one model, a sequence of as many Axes as
        models otherwise; new axes are created when ``None``.
    :return: the Axes for one model, a numpy array of Axes for several (as onnxcustom).
    """
    if not models:
        raise ValueError("plot_onnxs needs at least one model")
    titles = _titles(title, len(models))
    networks = [graph_network(model) for model in models]
    layouts = [layered_layout(network) for network in networks]
    axes = _axes(ax, networks, layouts)
    for network, positions, axis, text in zip(networks, layouts, axes, titles):
        _draw(network, positions, axis)
        if text is not None:
            axis.set_title(text)
    return axes[0] if len(models) == 1 else np.array(axes, dtype=object)


def _titles(title: str | Sequence[str] | None, count: int) -> list[str | None]:
    if title is None:
        return [None] * count
    if isinstance(title, str):
        if count != 1:
            raise ValueError(f"title must be a list of {count} titles, one per model")
        return [title]
    titles = list(title)
    if len(titles) != count or not all(isinstance(t, str) for t in titles):
        raise ValueError(f"title must be a list of {count} strings, got {title!r}")
    return titles


def _axes(ax: Any, networks: list[nx.DiGraph], layouts: list[dict]) -> list[Axes]:
    """The given axes, or new ones sized so that boxes of 7-point text do not overlap."""
    if ax is None:
        plt = _pyplot()
        widths = [_extent(layout)[0] * _slot_inches(n) for n, layout in zip(networks, layouts)]
        height = max(_extent(layout)[1] for layout in layouts)
        figsize = (min(1 + sum(widths), 60), min(2 + 0.9 * height, 60))
        _, axes = plt.subplots(1, len(layouts), figsize=figsize, squeeze=False)
        return list(axes[0])
    axes = [ax] if hasattr(ax, "annotate") else list(np.ravel(np.asarray(ax, dtype=object)))
    if len(axes) != len(layouts):
        raise ValueError(f"ax must hold {len(layouts)} axes, one per model, got {len(axes)}")
    return axes


def _slot_inches(network: nx.DiGraph) -> float:
    """Width of one column: the longest label line at about 0.07 inch a character."""
    longest = max(
        (len(line) for _, label in network.nodes(data="label") for line in label.split("\n")),
        default=1,
    )
    return max(1.0, 0.07 * longest + 0.3)


def _extent(layout: dict) -> tuple[float, float]:
    xs = [x for x, _ in layout.values()] or [0.0]
    ys = [y for _, y in layout.values()] or [0.0]
    return max(xs) - min(xs) + 1, max(ys) - min(ys) + 1


def _draw(network: nx.DiGraph, positions: dict, axis: Axes) -> None:
    for source, target in network.edges:
        axis.annotate(
            "",
            xy=positions[target],
            xytext=positions[source],
            arrowprops={"arrowstyle": "-|>", "color": "#566573", "shrinkA": 9, "shrinkB": 9},
        )
    for vertex, data in network.nodes(data=True):
        x, y = positions[vertex]
        style = STYLES[data["kind"]]
        boxstyle = "square,pad=0.3" if data["kind"] == "node" else "round,pad=0.3"
        axis.text(
            x,
            y,
            data["label"],
            ha="center",
            va="center",
            fontsize=7,
            bbox={"boxstyle": boxstyle, "facecolor": style.color, "edgecolor": "#2c3e50"},
        )
    width, height = _extent(positions)
    xs = [x for x, _ in positions.values()] or [0.0]
    axis.set_xlim(min(xs) - 0.8, min(xs) + width - 0.2)
    axis.set_ylim(-height + 0.4, 0.6)
    axis.set_axis_off()


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "plot_onnxs needs matplotlib: pip install 'onnxgrad[plot]' (or use to_dot)"
        ) from exc
    return plt


def to_dot(model: ModelLike) -> str:
    """The graph of ``model`` in graphviz's DOT language (``dot -Tpng`` renders it).

    Inputs and outputs are ellipses, initializers notes, nodes boxes (op type and name);
    an edge between two nodes is labelled with the value it passes.
    """
    network = graph_network(model)
    ids = {vertex: f"v{data['order']}" for vertex, data in network.nodes(data=True)}
    lines = [f"digraph {_quote(network.graph['name'] or 'onnx')} {{", "  rankdir=TB;"]
    lines.append('  node [fontsize=10, fontname="Helvetica"];')
    for vertex, data in network.nodes(data=True):
        style = STYLES[data["kind"]]
        lines.append(
            f"  {ids[vertex]} [label={_quote(data['label'])}, shape={style.shape}, "
            f'style=filled, fillcolor="{style.color}"];'
        )
    for source, target, data in network.edges(data=True):
        between_nodes = source[0] == "node" and target[0] == "node"
        label = f" [label={_quote(', '.join(data['values']))}]" if between_nodes else ""
        lines.append(f"  {ids[source]} -> {ids[target]}{label};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _read_names(node) -> list[str]:
    """What a node reads: its inputs, then the outer names its subgraphs use."""
    names = [name for name in node.input if name]
    for sub in subgraphs(node):
        names.extend(sorted(_outer_names(sub) - set(names)))
    return names


def _outer_names(graph: GraphProto) -> set[str]:
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    defined |= {name for node in graph.node for name in node.output}
    read = {o.name for o in graph.output}
    for node in graph.node:
        read.update(_read_names(node))
    return read - defined


def type_text(type_proto: TypeProto) -> str:
    """``float32 [N, 2]``: element type and shape (``?`` for unknown dimensions)."""
    if not type_proto.HasField("tensor_type"):
        return type_proto.WhichOneof("value") or "?"
    tensor = type_proto.tensor_type
    dtype = dtype_name(tensor.elem_type)
    if not tensor.HasField("shape"):
        return dtype
    dims = [
        d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?")
        for d in tensor.shape.dim
    ]
    return f"{dtype} [{', '.join(dims)}]"


def tensor_text(init: TensorProto) -> str:
    """``float32 (2, 1)``: element type and dimensions of a tensor."""
    return f"{dtype_name(init.data_type)} {tuple(init.dims)}"


def dtype_name(elem_type: int) -> str:
    try:
        return str(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError):
        return "?"
