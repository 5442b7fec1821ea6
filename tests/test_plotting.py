"""Pictures and DOT text of graphs, checked against structure counted from the protos."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.plotting import graph_network, layered_layout, plot_onnxs, to_dot
from tests.models import linear_regression_model, seed004_model

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
plt = pytest.importorskip("matplotlib.pyplot")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _expected_edges(model) -> set[tuple[str, str]]:
    """(producer, consumer) pairs, as vertex labels' first line, straight from the proto."""
    producer = {i.name: i.name for i in model.graph.input}
    producer.update({i.name: i.name for i in model.graph.initializer})
    edges = set()
    for index, node in enumerate(model.graph.node):
        edges.update((producer[name], f"node{index}") for name in node.input if name)
        producer.update((name, f"node{index}") for name in node.output)
    edges.update((producer[o.name], f"out:{o.name}") for o in model.graph.output)
    return edges


def _edge_names(network) -> set[tuple[str, str]]:
    def name(vertex):
        kind, key = vertex
        return {"node": f"node{key}", "output": f"out:{key}"}.get(kind, key)

    return {(name(u), name(v)) for u, v in network.edges}


def _if_model():
    """y = If(cond, then: x + b, else: x - b): the branches read outer x and b."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    out = helper.make_tensor_value_info("r", TensorProto.FLOAT, [3])
    then = helper.make_graph([helper.make_node("Add", ["x", "b"], ["r"])], "then", [], [out])
    other = helper.make_graph([helper.make_node("Sub", ["x", "b"], ["r"])], "else", [], [out])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        "if",
        [x, helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.ones(3, dtype=np.float32), name="b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(
    "model",
    [seed004_model(), linear_regression_model(np.ones(2), np.zeros(1))],
    ids=["seed004", "linreg"],
)
def test_network_has_one_vertex_per_value_source_and_one_edge_per_use(model):
    network = graph_network(model)
    graph = model.graph
    expected = len(graph.input) + len(graph.initializer) + len(graph.node) + len(graph.output)
    assert network.number_of_nodes() == expected
    assert _edge_names(network) == _expected_edges(model)


def test_subgraph_reads_are_edges_of_the_node_holding_them():
    network = graph_network(_if_model())
    assert set(network.predecessors(("node", 0))) == {
        ("input", "cond"),
        ("input", "x"),
        ("initializer", "b"),
    }


def test_layout_draws_every_edge_downwards_without_overlap():
    network = graph_network(seed004_model())
    positions = layered_layout(network)
    assert set(positions) == set(network)
    for source, target in network.edges:
        assert positions[source][1] > positions[target][1]
    assert len(set(positions.values())) == len(positions)
    weight_row = positions[("initializer", "init_b11")][1]
    reshape_row = positions[("node", 10)][1]
    assert weight_row == reshape_row + 1


def test_plot_one_model_returns_its_axes_with_a_box_per_vertex(tmp_path):
    model = seed004_model()
    before = model.SerializeToString()
    ax = plot_onnxs(model, title="Seed 004")
    network = graph_network(model)
    assert ax.get_title() == "Seed 004"
    arrows = [t for t in ax.texts if isinstance(t, matplotlib.text.Annotation)]
    assert len(ax.texts) - len(arrows) == network.number_of_nodes()
    assert len(arrows) == network.number_of_edges()
    ax.figure.savefig(tmp_path / "graph.png")
    assert (tmp_path / "graph.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert model.SerializeToString() == before


def test_plot_several_models_side_by_side_from_paths(tmp_path):
    path = tmp_path / "lr.onnx"
    path.write_bytes(linear_regression_model(np.ones(2), np.zeros(1)).SerializeToString())
    axes = plot_onnxs(seed004_model(), str(path), title=["poly", "linear"])
    assert isinstance(axes, np.ndarray) and axes.shape == (2,)
    assert [a.get_title() for a in axes] == ["poly", "linear"]
    assert axes[0].figure is axes[1].figure


def test_plot_on_given_axes():
    _, given = plt.subplots(1, 2)
    axes = plot_onnxs(seed004_model(), seed004_model(), ax=given)
    assert list(axes) == list(given)
    assert all(a.texts for a in given)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"title": "one"}, "one per model"),
        ({"title": ["a", "b", "c"]}, "list of 2"),
        ({"ax": "not axes"}, "ax must hold 2"),
    ],
)
def test_plot_rejects_mismatched_titles_and_axes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plot_onnxs(seed004_model(), seed004_model(), **kwargs)


def test_plot_needs_a_model():
    with pytest.raises(ValueError, match="at least one model"):
        plot_onnxs()


def test_plot_rejects_something_else_than_a_model():
    with pytest.raises(TypeError, match="ModelProto or a path"):
        plot_onnxs(42)


def test_dot_lists_every_vertex_and_edge_and_escapes_names():
    model = linear_regression_model(np.ones(2), np.zeros(1))
    model.graph.node[0].name = 'say "hi"\\'
    dot = to_dot(model)
    assert dot.startswith('digraph "lr" {') and dot.rstrip().endswith("}")
    vertices = re.findall(r"^  (v\d+) \[label=\"((?:[^\"\\]|\\.)*)\"", dot, flags=re.M)
    edges = re.findall(r"^  (v\d+) -> (v\d+)", dot, flags=re.M)
    graph = model.graph
    assert len(vertices) == len(graph.input) + len(graph.initializer) + 2 + len(graph.output)
    assert len(edges) == len(_expected_edges(model))
    labels = dict(vertices)
    assert any(label == 'MatMul\\nsay \\"hi\\"\\\\' for label in labels.values())
    assert re.search(r'-> v\d+ \[label="y1"\];', dot)


def _small_cnn() -> onnx.ModelProto:
    """Conv-Relu-MaxPool twice, Flatten, Gemm: a CNN whose gradient has ~100 nodes."""
    rng = np.random.default_rng(0)

    def weight(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [
            weight("w1", 4, 1, 3, 3),
            weight("b1", 4),
            weight("w2", 4, 4, 3, 3),
            weight("b2", 4),
            weight("w3", 3, 16),
            weight("b3", 3),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _train_step_model() -> onnx.ModelProto:
    from onnxgrad.training import LearningRateSGDNesterov, make_train_step

    return make_train_step(seed004_model(), learning_rate=LearningRateSGDNesterov()).model


def _cnn_gradient() -> onnx.ModelProto:
    from onnxgrad import add_loss_output, onnx_derivative
    from onnxgrad.derivative import DerivativeOptions

    return onnx_derivative(
        add_loss_output(_small_cnn()), options=DerivativeOptions.Loss, label="label"
    )


def _overlaps(boxes) -> list[tuple[int, int]]:
    """Pairs of boxes (x0, y0, x1, y1) that intersect, by a sweep along x."""
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0])
    found, active = [], []
    for i in order:
        x0, y0, _, y1 = boxes[i]
        active = [j for j in active if boxes[j][2] > x0]
        found += [(j, i) for j in active if boxes[j][1] < y1 and y0 < boxes[j][3]]
        active.append(i)
    return found


@pytest.mark.parametrize("build", [_train_step_model, _cnn_gradient], ids=["train_step", "cnn"])
def test_large_graphs_are_drawn_without_overlapping_boxes(build):
    model = build()
    assert 40 <= len(model.graph.node) <= 400, len(model.graph.node)
    ax = plot_onnxs(model)
    figure = ax.figure
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    labels = [t for t in ax.texts if not isinstance(t, matplotlib.text.Annotation)]
    boxes = [tuple(t.get_bbox_patch().get_window_extent(renderer).extents) for t in labels]
    assert not _overlaps(boxes), [
        labels[i].get_text() for pair in _overlaps(boxes)[:3] for i in pair
    ]
    assert min(t.get_fontsize() for t in labels) >= 5
    plt.close(figure)


def test_a_node_named_after_its_op_is_labelled_once():
    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.DOUBLE, name="Cast")
    numbered = helper.make_node("Neg", ["y"], ["z"], name="Neg_12")
    named = helper.make_node("Neg", ["z"], ["t"], name="flip")
    graph = helper.make_graph(
        [node, numbered, named],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("t", TensorProto.DOUBLE, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    labels = {v: data["label"] for v, data in graph_network(model).nodes(data=True)}
    assert labels[("node", 0)] == "Cast"
    assert labels[("node", 1)] == "Neg"
    assert labels[("node", 2)] == "Neg\nflip"
