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

__all__ = ["Drawing", "graph_network", "layered_layout", "plot_onnxs", "sized_layout", "to_dot"]

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
        add(vertex, _node_label(node))
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


def _node_label(node) -> str:
    """The op type, then the node's name when it says more (not ``Cast`` for a Cast, nor
    ``Cast_3``-like numbering of the op type)."""
    name = node.name
    if not name or name.rstrip("_0123456789") in ("", node.op_type):
        return node.op_type
    return f"{node.op_type}\n{name}"


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


#: Font size of the labels (points) when the picture has room for it.
FONT_POINTS = 7.0
#: Smallest font size (points) a crowded picture shrinks to.
MIN_FONT_POINTS = 2.0
#: Largest figure side (inches) ``plot_onnxs`` creates; a larger graph gets a smaller font.
MAX_FIGURE_INCHES = 100.0
_LINE_SPACING = 1.2
_BOX_PAD = 0.3  # of the font size, the padding matplotlib's bbox adds around the text
_GAP = (1.2, 2.5)  # horizontal and vertical space between boxes, in font sizes


@dataclass(frozen=True)
class Drawing:
    """Where each box of a picture goes, in points at :data:`FONT_POINTS`: ``centres``,
    ``sizes`` (width, height) and the total ``width`` and ``height``."""

    centres: dict[Hashable, tuple[float, float]]
    sizes: dict[Hashable, tuple[float, float]]
    width: float
    height: float


def plot_onnxs(
    *models: ModelLike,
    title: str | Sequence[str] | None = None,
    ax: Axes | Sequence[Axes] | None = None,
) -> Axes | np.ndarray:
    """Draw the graphs of ``models`` side by side (matplotlib, no graphviz needed).

    Boxes are sized to their labels and never overlap: a new figure is made large enough for
    7-point text (up to :data:`MAX_FIGURE_INCHES` a side), and the font shrinks where the
    graph needs more room than that, or than the given axes offer.

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
    drawings = [sized_layout(network) for network in networks]
    axes = _axes(ax, drawings)
    for network, drawing, axis, text in zip(networks, drawings, axes, titles):
        _draw(network, drawing, axis)
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


def sized_layout(network: nx.DiGraph) -> Drawing:
    """:func:`layered_layout`'s rows and orders, with each box as wide and tall as its label
    at :data:`FONT_POINTS`: a row packs its boxes left to right a gap apart, centred on 0;
    rows are a gap below the tallest box of the row above."""
    grid = layered_layout(network)
    sizes = {v: _box_size(label) for v, label in network.nodes(data="label")}
    rows: dict[float, list[Hashable]] = {}
    for vertex in sorted(network, key=lambda v: grid[v][0]):
        rows.setdefault(grid[vertex][1], []).append(vertex)
    gap_x, gap_y = (FONT_POINTS * g for g in _GAP)
    centres, top = {}, 0.0
    for y in sorted(rows, reverse=True):
        row = rows[y]
        widths = [sizes[v][0] for v in row]
        tallest = max(sizes[v][1] for v in row)
        left = -(sum(widths) + gap_x * (len(row) - 1)) / 2
        for vertex, width in zip(row, widths):
            centres[vertex] = (left + width / 2, top - tallest / 2)
            left += width + gap_x
        top -= tallest + gap_y
    half_widths = [abs(x) + sizes[v][0] / 2 for v, (x, _) in centres.items()] or [0.0]
    return Drawing(centres, sizes, 2 * max(half_widths), -top - gap_y)


def _box_size(label: str) -> tuple[float, float]:
    """Width and height, in points, of a label's box at :data:`FONT_POINTS`."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    font = FontProperties(size=FONT_POINTS)
    measure = TextToPath().get_text_width_height_descent
    lines = label.split("\n")
    width = max(measure(line or " ", font, ismath=False)[0] for line in lines)
    height = len(lines) * FONT_POINTS * _LINE_SPACING
    pad = 2 * _BOX_PAD * FONT_POINTS
    return width + pad, height + pad


def _axes(ax: Any, drawings: list[Drawing]) -> list[Axes]:
    """The given axes, or a new figure with room for every drawing at its natural size."""
    if ax is None:
        plt = _pyplot()
        margin = 0.5
        width = sum(d.width for d in drawings) / 72 + margin * (len(drawings) + 1)
        height = max(d.height for d in drawings) / 72 + 2 * margin + 0.4
        figsize = (
            min(max(width, 2.0), MAX_FIGURE_INCHES),
            min(max(height, 2.0), MAX_FIGURE_INCHES),
        )
        widths = [max(d.width, 1.0) for d in drawings]
        figure, axes = plt.subplots(
            1, len(drawings), figsize=figsize, squeeze=False, gridspec_kw={"width_ratios": widths}
        )
        figure.subplots_adjust(
            left=margin / figsize[0],
            right=1 - margin / figsize[0],
            bottom=margin / figsize[1],
            top=1 - (margin + 0.4) / figsize[1],
            wspace=margin * len(drawings) / max(width - 2 * margin, 1.0),
        )
        return list(axes[0])
    axes = [ax] if hasattr(ax, "annotate") else list(np.ravel(np.asarray(ax, dtype=object)))
    if len(axes) != len(drawings):
        raise ValueError(f"ax must hold {len(drawings)} axes, one per model, got {len(axes)}")
    return axes


def _draw(network: nx.DiGraph, drawing: Drawing, axis: Axes) -> None:
    """Boxes and arrows in data units of points at :data:`FONT_POINTS`, the font scaled by
    the size of a data point on the screen, so boxes keep their relative sizes."""
    margin = FONT_POINTS
    axis.set_xlim(-drawing.width / 2 - margin, drawing.width / 2 + margin)
    axis.set_ylim(-drawing.height - margin, margin)
    axis.set_aspect("equal", adjustable="box")
    axis.set_axis_off()
    scale = _points_per_data_unit(axis, drawing, margin)
    fontsize = max(FONT_POINTS * min(scale, 1.0), MIN_FONT_POINTS)
    for source, target in network.edges:
        axis.annotate(
            "",
            xy=_border(drawing, target, drawing.centres[source]),
            xytext=_border(drawing, source, drawing.centres[target]),
            arrowprops={"arrowstyle": "-|>", "color": "#566573", "shrinkA": 0, "shrinkB": 0},
        )
    for vertex, data in network.nodes(data=True):
        style = STYLES[data["kind"]]
        boxstyle = f"{'square' if data['kind'] == 'node' else 'round'},pad={_BOX_PAD}"
        axis.text(
            *drawing.centres[vertex],
            data["label"],
            ha="center",
            va="center",
            fontsize=fontsize,
            linespacing=_LINE_SPACING,
            bbox={"boxstyle": boxstyle, "facecolor": style.color, "edgecolor": "#2c3e50"},
        )


def _points_per_data_unit(axis: Axes, drawing: Drawing, margin: float) -> float:
    """Screen points per data unit once the axes keep an equal aspect."""
    box = axis.get_position()
    width_in, height_in = axis.figure.get_size_inches()
    available = (box.width * width_in * 72, box.height * height_in * 72)
    needed = (drawing.width + 2 * margin, drawing.height + 2 * margin)
    return min(available[0] / needed[0], available[1] / needed[1])


def _border(drawing: Drawing, vertex: Hashable, towards: tuple[float, float]) -> tuple:
    """The point where the segment from ``vertex``'s centre to ``towards`` leaves its box."""
    (x, y), (width, height) = drawing.centres[vertex], drawing.sizes[vertex]
    dx, dy = towards[0] - x, towards[1] - y
    if dx == dy == 0:
        return x, y
    t = min(width / 2 / abs(dx) if dx else np.inf, height / 2 / abs(dy) if dy else np.inf)
    return x + t * dx, y + t * dy


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
    """``float32 [N, 2]``: element type and shape (``?`` for unknown dimensions); a
    sequence or a map as ``seq(map(int64, float32))`` (a ZipMap's output)."""
    kind = type_proto.WhichOneof("value")
    if kind == "sequence_type":
        return f"seq({type_text(type_proto.sequence_type.elem_type)})"
    if kind == "map_type":
        key = dtype_name(type_proto.map_type.key_type)
        return f"map({key}, {type_text(type_proto.map_type.value_type)})"
    if kind != "tensor_type":
        return kind or "?"
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
