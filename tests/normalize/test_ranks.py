"""The rank pass against onnxruntime: every rank it declares is the rank onnxruntime
computes, on models where onnx's shape inference leaves it unknown."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.normalize.ranks import refined_ranks

FLOAT = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=(), opset=13):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _declared_ranks(model) -> dict[str, int]:
    from onnxgrad.graph._scopes import iter_graphs

    ranks = {}
    for graph in iter_graphs(model.graph):
        for info in [*graph.value_info, *graph.output]:
            if info.type.tensor_type.HasField("shape"):
                ranks[info.name] = len(info.type.tensor_type.shape.dim)
    return ranks


def _run_ranks(model, feeds, names) -> dict[str, int]:
    """The ranks onnxruntime computes for ``names`` (exposed as extra outputs)."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    del exposed.graph.value_info[:]
    for name in names:
        exposed.graph.output.append(helper.make_tensor_value_info(name, FLOAT, None))
    session = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    return {n: v.ndim for n, v in zip(names, session.run(list(names), feeds))}


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def test_reshape_to_a_concat_of_static_length_then_downstream():
    """``Reshape(x, Concat(Shape(x)[:2], [-1]))``: inference knows the Concat has 3 values,
    not the result's rank; declared, it flows through Transpose and Softmax."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "two"], ["head"]),
        helper.make_node("Concat", ["head", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Softmax", ["t"], ["y"], axis=-1),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, ["N", 3, None, None])],
        [helper.make_tensor_value_info("y", FLOAT, None)],
        [_ints("zero", [0]), _ints("two", [2]), _ints("minus_one", [-1])],
    )
    before = onnx.shape_inference.infer_shapes(model)
    assert "r" not in _declared_ranks(before)
    declared = _declared_ranks(onnx.shape_inference.infer_shapes(refined_ranks(model)))
    feeds = {"x": np.ones((2, 3, 4, 5), np.float32)}
    assert {n: declared[n] for n in ("r", "t")} == _run_ranks(model, feeds, ["r", "t"])


def _lstm_through_if():
    """PyTorch's LSTM export: ``h0`` unsqueezed (``[1, N, H]``) in one branch, taken as it is
    in the other, so inference cannot tell its rank; the LSTM reads it as ``initial_h``,
    which fixes it at 3, and the If's output at 2."""
    hidden, size = 4, 3
    rng = np.random.default_rng(0)
    unbatched = helper.make_graph(
        [helper.make_node("Unsqueeze", ["h", "axis0"], ["h_unsqueezed"])],
        "then",
        [],
        [helper.make_tensor_value_info("h_unsqueezed", FLOAT, None)],
    )
    batched = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["h_same"])],
        "else",
        [],
        [helper.make_tensor_value_info("h_same", FLOAT, None)],
    )
    nodes = [
        helper.make_node("If", ["flag"], ["h_chosen"], then_branch=unbatched, else_branch=batched),
        helper.make_node("Unsqueeze", ["h_chosen", "axis0"], ["h0"]),
        helper.make_node("Unsqueeze", ["x", "axis0"], ["sequence"]),
        helper.make_node(
            "LSTM", ["sequence", "W", "R", "", "", "h0", "h0"], ["Y", "Y_h"], hidden_size=hidden
        ),
    ]
    initializers = [
        _ints("axis0", [0]),
        numpy_helper.from_array(np.array(False), "flag"),
        numpy_helper.from_array(rng.standard_normal((1, 4 * hidden, size)).astype(np.float32), "W"),
        numpy_helper.from_array(
            rng.standard_normal((1, 4 * hidden, hidden)).astype(np.float32), "R"
        ),
    ]
    inputs = [
        helper.make_tensor_value_info("x", FLOAT, ["N", size]),
        helper.make_tensor_value_info("h", FLOAT, [None, None]),
    ]
    outputs = [helper.make_tensor_value_info("Y_h", FLOAT, [1, None, hidden])]
    return _model(nodes, inputs, outputs, initializers), hidden


def test_lstm_state_through_an_if_gets_its_schema_rank():
    model, hidden = _lstm_through_if()
    assert "h0" not in _declared_ranks(onnx.shape_inference.infer_shapes(model))
    refined = refined_ranks(model)
    onnx.checker.check_model(refined, full_check=True)
    declared = _declared_ranks(onnx.shape_inference.infer_shapes(refined))
    feeds = {"x": np.ones((2, 3), np.float32), "h": np.zeros((2, hidden), np.float32)}
    names = ["h_chosen", "h0", "sequence"]
    assert {n: declared[n] for n in names} == _run_ranks(model, feeds, names)
    state = next(i for i in refined.graph.value_info if i.name == "h0")
    dims = state.type.tensor_type.shape.dim
    assert (dims[0].dim_value, dims[2].dim_value) == (1, hidden)


def test_if_whose_branches_agree_on_rank():
    then = helper.make_graph(
        [helper.make_node("Relu", ["x2"], ["a"])],
        "then",
        [],
        [helper.make_tensor_value_info("a", FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x2"], ["b"])],
        "else",
        [],
        [helper.make_tensor_value_info("b", FLOAT, None)],
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "two"], ["head"]),
        helper.make_node("Reshape", ["x", "head"], ["x2"]),
        helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=other),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("x", FLOAT, [None, None, None]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", FLOAT, None)],
        [_ints("zero", [0]), _ints("two", [2])],
    )
    refined = onnx.shape_inference.infer_shapes(refined_ranks(model))
    assert _declared_ranks(refined)["y"] == 2


def test_a_model_inference_fully_types_is_left_as_it_is():
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", FLOAT, [2, 3])],
    )
    before = model.SerializeToString()
    assert refined_ranks(model).SerializeToString() == before


def _squeezed(declared: str | None):
    """PyTorch 1.9's GRU exports: ``Squeeze`` without axes on ``[batch, 1, 4]`` (its rank
    depends on ``batch``), sliced, then concatenated with a rank-2 value (``declared``
    None) or tanh'd with the squeezed value's rank declared as an output or a value_info."""
    nodes = [
        helper.make_node("Squeeze", ["x"], ["sq"]),
        helper.make_node("Slice", ["sq", "zero", "two", "one"], ["sl"]),
    ]
    outputs = [helper.make_tensor_value_info("y", FLOAT, None)]
    value_info = []
    initializers = [_ints("zero", [0]), _ints("two", [2]), _ints("one", [1])]
    if declared is None:
        nodes.append(helper.make_node("MatMul", ["h", "w"], ["hw"]))
        nodes.append(helper.make_node("Concat", ["sl", "hw"], ["y"], axis=1))
        w = np.arange(6, dtype=np.float32).reshape(3, 2) / 6
        initializers.append(numpy_helper.from_array(w, "w"))
    else:
        nodes.append(helper.make_node("Tanh", ["sl"], ["y"]))
        squeezed = helper.make_tensor_value_info("sq", FLOAT, ["batch", 4])
        (outputs if declared == "output" else value_info).append(squeezed)
    inputs = [
        helper.make_tensor_value_info("x", FLOAT, ["batch", 1, 4]),
        helper.make_tensor_value_info("h", FLOAT, ["batch", 3]),
    ][: 2 if declared is None else 1]
    model = _model(nodes, inputs, outputs, initializers)
    model.graph.value_info.extend(value_info)
    return model


@pytest.mark.parametrize("declared", [None, "output", "value_info"])
def test_a_squeeze_without_axes_gets_its_rank_from_its_users_or_its_declaration(declared):
    """The rank pass declares the ranks onnxruntime computes, and the input gradient through
    the Slice (refused before: "needs the rank of 'sq'") equals central differences."""
    from onnx.reference import ReferenceEvaluator

    from onnxgrad import onnx_derivative

    model = _squeezed(declared)
    if declared is None:
        assert _declared_ranks(onnx.shape_inference.infer_shapes(model)).get("sl") is None
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 1, 4)).astype(np.float32)}
    if declared is None:
        feeds["h"] = rng.standard_normal((3, 3)).astype(np.float32)
    declared_ranks = _declared_ranks(onnx.shape_inference.infer_shapes(refined_ranks(model)))
    assert {n: declared_ranks[n] for n in ("sq", "sl")} == _run_ranks(model, feeds, ["sq", "sl"])

    gradient = onnx_derivative(model, inputs=["x"], weights=[])
    seed = rng.standard_normal((3, 4 if declared is None else 2)).astype(np.float32)
    grad_inputs = {i.name for i in gradient.graph.input}
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    run_feeds = {k: v for k, v in {**feeds, "y_grad": seed}.items() if k in grad_inputs}
    if "sq_grad" in grad_inputs:
        run_feeds["sq_grad"] = np.zeros((3, 4), np.float32)
    computed = dict(zip([o.name for o in session.get_outputs()], session.run(None, run_feeds)))
    reference = ReferenceEvaluator(model)
    direction, step = rng.standard_normal((3, 1, 4)), 1e-3

    def projected(sign):
        shifted = {**feeds, "x": (feeds["x"] + sign * step * direction).astype(np.float32)}
        return float(np.sum(reference.run(["y"], shifted)[0].astype(np.float64) * seed))

    expected = (projected(1) - projected(-1)) / (2 * step)
    assert np.sum(computed["x_grad"] * direction) == pytest.approx(expected, rel=1e-3)


def _carried_loops(grow: bool):
    """A Loop (condition only) whose result starts a second Loop (trip count 2): inference
    gives neither Loop's carried value a rank; the second body keeps it (``tanh(v) + v``),
    or with ``grow`` adds one (``Unsqueeze(v, 0)``, a rank no iteration count fixes)."""
    counters = [
        helper.make_tensor_value_info("i", TensorProto.INT64, []),
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
    ]

    def body(name, nodes, state, result):
        infos = [helper.make_tensor_value_info(n, FLOAT, None) for n in state]
        outputs = [
            helper.make_tensor_value_info(n, TensorProto.BOOL if k == 0 else FLOAT, None)
            for k, n in enumerate(result)
        ]
        return helper.make_graph(nodes, name, counters + infos, outputs)

    first = body(
        "first",
        [
            helper.make_node("Tanh", ["a"], ["a_next"]),
            helper.make_node("Less", ["i", "one"], ["c_out"]),
        ],
        ["a"],
        ["c_out", "a_next"],
    )
    step = (
        [helper.make_node("Unsqueeze", ["v", "axis0"], ["v_next"])]
        if grow
        else [
            helper.make_node("Tanh", ["v"], ["t"]),
            helper.make_node("Add", ["t", "v"], ["v_next"]),
        ]
    )
    second = body(
        "second",
        [*step, helper.make_node("Identity", ["c"], ["c_out2"])],
        ["v"],
        ["c_out2", "v_next"],
    )
    nodes = [
        helper.make_node("Loop", ["", "true", "x"], ["v_mid"], body=first),
        helper.make_node("Loop", ["two", "", "v_mid"], ["y"], body=second),
    ]
    initializers = [
        _ints("axis0", [0]),
        _ints("two", 2),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array(True), "true"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", FLOAT, None)],
        initializers,
    )


def _body_input_ranks(model) -> dict[str, int]:
    from onnxgrad.graph._scopes import iter_graphs

    return {
        i.name: len(i.type.tensor_type.shape.dim)
        for graph in iter_graphs(model.graph)
        if graph is not model.graph
        for i in graph.input
        if i.type.tensor_type.HasField("shape")
    }


def test_a_loop_carried_value_keeps_its_initial_rank_by_induction():
    """Neither inference nor a rule gives the carried values a rank; the fixed point over
    carried ranks declares both bodies' inputs and both Loops' results at rank 2, the ranks
    onnxruntime computes."""
    model = _carried_loops(grow=False)
    assert not {"a", "v"} & set(_body_input_ranks(model))
    refined = refined_ranks(onnx.ModelProto.FromString(model.SerializeToString()))
    assert {n: r for n, r in _body_input_ranks(refined).items() if n in "av"} == {"a": 2, "v": 2}
    declared = _declared_ranks(refined)
    feeds = {"x": np.ones((2, 3), np.float32)}
    assert {n: declared[n] for n in ("v_mid", "y")} == _run_ranks(model, feeds, ["v_mid", "y"])


def test_a_carried_value_whose_rank_the_body_changes_gets_no_rank():
    """``v <- Unsqueeze(v, 0)``: the assumption 'v keeps rank 2' gives the body's output rank
    3, so it is dropped; the first Loop's, which holds, stays."""
    refined = refined_ranks(_carried_loops(grow=True))
    ranks = _body_input_ranks(refined)
    assert ranks.get("a") == 2
    assert "v" not in ranks
    assert _declared_ranks(refined).get("y") is None
