"""Rule table entries: If (each branch taken; an outer weight read by one branch only),
Scan (every axes/directions attribute, several states and scan inputs, a non-float state,
outer values read by the body), Loop (trip count, condition output, carried values, scan
outputs), nested control flow, and second derivatives of each."""

import numpy as np
from onnx import TensorProto, helper

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(5)


def _info(name):
    return helper.make_tensor_value_info(name, TensorProto.UNDEFINED, None)


def _graph(name, nodes, outputs, inputs=()):
    return helper.make_graph(nodes, name, [_info(i) for i in inputs], [_info(o) for o in outputs])


def _loop_body(name, nodes, outputs, states):
    """A Loop body: typed iteration number and condition, then ``states``."""
    counters = [
        helper.make_tensor_value_info("iter", TensorProto.INT64, []),
        helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
    ]
    return helper.make_graph(
        nodes, name, counters + [_info(i) for i in states], [_info(o) for o in outputs]
    )


_branch = _graph


def if_on_sign(inputs, outputs):
    """``y = sin(x * w) if sum(x) > 0 else x * x``."""
    x, w = inputs
    then_branch = _branch(
        "then",
        [helper.make_node("Mul", [x, w], ["t"]), helper.make_node("Sin", ["t"], ["a"])],
        ["a"],
    )
    else_branch = _branch("else", [helper.make_node("Mul", [x, x], ["b"])], ["b"])
    return [
        helper.make_node("Constant", [], ["zero_float"], value_float=0.0),
        helper.make_node("CastLike", ["zero_float", x], ["zero"]),
        helper.make_node("ReduceSum", [x], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node(
            "If", ["positive"], outputs, then_branch=then_branch, else_branch=else_branch
        ),
    ]


# -- Scan ---------------------------------------------------------------------------------------
def _rnn_body(w="w"):
    """``h' = tanh(h * w + x_t)``, ``y_t = h' * h'`` (``w`` read from the outer scope)."""
    return _graph(
        "rnn_body",
        [
            helper.make_node("Mul", ["h", w], ["hw"]),
            helper.make_node("Add", ["hw", "xt"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h_next"]),
            helper.make_node("Mul", ["h_next", "h_next"], ["yt"]),
        ],
        ["h_next", "yt"],
        ["h", "xt"],
    )


def scan_rnn(**attrs):
    def graph(inputs, outputs):
        outputs = outputs if len(outputs) == 2 else ["h_last", *outputs]
        return [helper.make_node("Scan", inputs[:2], outputs, body=_rnn_body(), **attrs)]

    return graph


def scan_two_streams(inputs, outputs):
    """States ``(a, count)`` (``count`` an int64 counter), inputs ``u`` forward and ``v``
    reversed along axis 1, outputs ``p`` (axis 0) and ``q`` (axis 1, reversed)."""
    body = _graph(
        "two_body",
        [
            helper.make_node("Mul", ["a", "ut"], ["au"]),
            helper.make_node("Tanh", ["au"], ["sin_au"]),
            helper.make_node("Add", ["sin_au", "vt"], ["a_next"]),
            helper.make_node("Add", ["count", "one"], ["count_next"]),
            helper.make_node("Cast", ["count"], ["count_f"], to=TensorProto.DOUBLE),
            helper.make_node("CastLike", ["count_f", "a"], ["count_like"]),
            helper.make_node("Mul", ["a_next", "count_like"], ["pt"]),
            helper.make_node("Mul", ["ut", "vt"], ["qt"]),
        ],
        ["a_next", "count_next", "pt", "qt"],
        ["a", "count", "ut", "vt"],
    )
    return [
        helper.make_node("Constant", [], ["one"], value_int=1),
        helper.make_node(
            "Scan",
            inputs,
            [outputs[0], "count_final", *outputs[1:]],
            body=body,
            num_scan_inputs=2,
            scan_input_axes=[0, 1],
            scan_input_directions=[0, 1],
            scan_output_axes=[0, 1],
            scan_output_directions=[0, 1],
        ),
    ]


h0, w, x = rng.standard_normal((3, 2)), rng.standard_normal(2), rng.standard_normal((4, 3, 2))
rnn_inputs = {"h0": h0, "x": x, "w": w}
SCAN_CASES = [
    OpCase("Scan", rnn_inputs, graph=scan_rnn(num_scan_inputs=1), n_outputs=2, id="Scan"),
    OpCase(
        "Scan",
        {"h0": h0, "x": x.transpose(1, 0, 2).copy(), "w": w},
        graph=scan_rnn(
            num_scan_inputs=1,
            scan_input_axes=[1],
            scan_input_directions=[1],
            scan_output_axes=[1],
            scan_output_directions=[1],
        ),
        n_outputs=2,
        evaluator="onnxruntime",
        id="Scan-axis1-reverse",
    ),
    OpCase(
        "Scan",
        {"h0": h0, "x": x.transpose(1, 0, 2).copy(), "w": w},
        graph=scan_rnn(num_scan_inputs=1, scan_input_axes=[-2], scan_output_axes=[-1]),
        n_outputs=2,
        opset=11,
        evaluator="onnxruntime",
        dynamic_shapes=False,
        id="Scan-negative-axes-opset11",
    ),
    OpCase(
        "Scan",
        {
            "a0": rng.standard_normal(3),
            "count0": np.array(0, dtype=np.int64),
            "u": rng.standard_normal((4, 3)),
            "v": rng.standard_normal((3, 4)),
        },
        graph=scan_two_streams,
        n_outputs=3,
        evaluator="onnxruntime",
        id="Scan-two-streams-int-state",
    ),
]


# -- Loop ---------------------------------------------------------------------------------------
def loop_graph(with_condition=True, with_trip_count=True):
    """``v <- tanh(v * w) + v * iter`` while ``iter < 3`` (trip count 10 when the condition
    is used, else 4; the condition alone where there is no trip count), scan output
    ``v * v``."""
    body = _loop_body(
        "loop_body",
        [
            helper.make_node("Mul", ["v", "w"], ["vw"]),
            helper.make_node("Tanh", ["vw"], ["s"]),
            helper.make_node("Cast", ["iter"], ["iter_f"], to=TensorProto.DOUBLE),
            helper.make_node("CastLike", ["iter_f", "v"], ["iter_like"]),
            helper.make_node("Mul", ["v", "iter_like"], ["vi"]),
            helper.make_node("Add", ["s", "vi"], ["v_next"]),
            helper.make_node("Mul", ["v_next", "v_next"], ["scan_t"]),
            helper.make_node("Less", ["iter", "limit"], ["cond_out"]),
        ],
        ["cond_out", "v_next", "scan_t"],
        ["v"],
    )

    def graph(inputs, outputs):
        trips, keep_going, v0 = inputs[:3]
        raw = ["v_final", "v_scanned"]
        kept = list(zip(raw, [[3], [-1, 3]]))[-len(outputs) :]
        return [
            helper.make_node("Constant", [], ["limit"], value=_int(3)),
            helper.make_node(
                "Loop",
                [trips if with_trip_count else "", keep_going if with_condition else "", v0],
                raw,
                body=body,
            ),
            *_with_shapes([r for r, _ in kept], outputs, [shape for _, shape in kept]),
        ]

    return graph


def _first_of_chain():
    """A Loop body (condition only, one iteration): ``a <- tanh(a * w)``; inference gives
    the Loop's result no rank."""
    return _loop_body(
        "first_body",
        [
            helper.make_node("Mul", ["a", "w"], ["aw"]),
            helper.make_node("Tanh", ["aw"], ["a_next"]),
            helper.make_node("Less", ["iter", "one"], ["cond_out"]),
        ],
        ["cond_out", "a_next"],
        ["a"],
    )


def chained_loops(fixed=True):
    """A Loop (condition only) whose final state starts a second Loop (trip count only):
    inference gives the first Loop's result, hence the second's carried value, no rank;
    the second body fixes it (``Reshape(v, [-1])``) or, unfixed, keeps it only by
    induction (the rank pass's fixed point over carried ranks); scan output ``v * v``."""
    flat_nodes = [helper.make_node("Reshape", ["v", "flat"], ["v_flat"])] if fixed else []
    v = "v_flat" if fixed else "v"
    second = _loop_body(
        "second_body",
        [
            *flat_nodes,
            helper.make_node("Mul", [v, "w"], ["vw"]),
            helper.make_node("Tanh", ["vw"], ["s"]),
            helper.make_node("Add", ["s", v], ["v_next"]),
            helper.make_node("Mul", ["v_next", "v_next"], ["scan_t"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        ["cond_out", "v_next", "scan_t"],
        ["v"],
    )
    flat = helper.make_tensor("flat_value", TensorProto.INT64, [1], [-1])

    def graph(inputs, outputs):
        return [
            helper.make_node("Constant", [], ["flat"], value=flat),
            helper.make_node("Constant", [], ["one"], value=_int(1)),
            helper.make_node("Constant", [], ["true"], value=_bool(True)),
            helper.make_node("Loop", ["", "true", inputs[1]], ["v_mid"], body=_first_of_chain()),
            helper.make_node(
                "Loop", [inputs[0], "", "v_mid"], ["v_final", "v_scanned"], body=second
            ),
            *_with_shapes(["v_final", "v_scanned"], outputs, [[3], [-1, 3]]),
        ]

    return graph


def scan_after_loop(inputs, outputs):
    """The RNN Scan whose initial state is a Loop's result (no rank from inference), its
    body fixing none."""
    return [
        helper.make_node("Constant", [], ["one"], value=_int(1)),
        helper.make_node("Constant", [], ["true"], value=_bool(True)),
        helper.make_node("Loop", ["", "true", inputs[0]], ["h_mid"], body=_first_of_chain()),
        helper.make_node(
            "Scan", ["h_mid", inputs[1]], ["h_last", "ys"], body=_rnn_body(), num_scan_inputs=1
        ),
        *_with_shapes(["h_last", "ys"], outputs, [[3, 2], [4, 3, 2]]),
    ]


def _with_shapes(raw, outputs, shapes):
    """Reshape Loop outputs (whose shapes inference cannot know) to a known rank."""
    nodes = []
    for name, out, shape in zip(raw, outputs, shapes):
        const = helper.make_tensor(f"{out}_shape", TensorProto.INT64, [len(shape)], shape)
        nodes.append(helper.make_node("Constant", [], [f"{out}_shape"], value=const))
        nodes.append(helper.make_node("Reshape", [name, f"{out}_shape"], [out]))
    return nodes


def _bool(value):
    return helper.make_tensor("true_value", TensorProto.BOOL, [], [value])


def _int(value):
    return helper.make_tensor("limit_value", TensorProto.INT64, [], [value])


def nested_loop_scan(inputs, outputs):
    """A Loop (two iterations) whose body runs the Scan RNN over the outer ``x`` with the
    loop's state as initial state, reading the outer ``w`` two levels down (the Reshape
    gives the inner Scan body static shapes, which onnxruntime requires)."""
    body = _loop_body(
        "outer_body",
        [
            helper.make_node("Reshape", ["h", "h_shape"], ["h_known"]),
            helper.make_node(
                "Scan", ["h_known", "x"], ["h_scanned", "ys"], body=_rnn_body(), num_scan_inputs=1
            ),
            helper.make_node("ReduceSum", ["ys", "axis0"], ["y_sum"], keepdims=0),
            helper.make_node("Add", ["h_scanned", "y_sum"], ["h_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        ["cond_out", "h_out"],
        ["h"],
    )
    axis0 = helper.make_tensor("axis0_value", TensorProto.INT64, [1], [0])
    h_shape = helper.make_tensor("h_shape_value", TensorProto.INT64, [2], [3, 2])
    return [
        helper.make_node("Constant", [], ["h_shape"], value=h_shape),
        helper.make_node("Constant", [], ["axis0"], value=axis0),
        helper.make_node("Constant", [], ["true"], value=_bool(True)),
        helper.make_node("Loop", ["trips", "true", "h0"], ["h_final"], body=body),
        *_with_shapes(["h_final"], outputs, [[3, 2]]),
    ]


def scan_with_if(inputs, outputs):
    """A Scan whose body branches on the sign of each slice's sum."""
    then_branch = _branch("then", [helper.make_node("Sin", ["hx"], ["ta"])], ["ta"])
    else_branch = _branch("else", [helper.make_node("Mul", ["hx", "w"], ["tb"])], ["tb"])
    body = _graph(
        "if_body",
        [
            helper.make_node("Add", ["h", "xt"], ["hx"]),
            helper.make_node("ReduceSum", ["xt"], ["total"], keepdims=0),
            helper.make_node("CastLike", ["zero_float", "xt"], ["zero"]),
            helper.make_node("Greater", ["total", "zero"], ["positive"]),
            helper.make_node(
                "If", ["positive"], ["h_next"], then_branch=then_branch, else_branch=else_branch
            ),
            helper.make_node("Identity", ["h_next"], ["yt"]),
        ],
        ["h_next", "yt"],
        ["h", "xt"],
    )
    return [
        helper.make_node("Constant", [], ["zero_float"], value_float=0.0),
        helper.make_node("Scan", inputs[:2], outputs, body=body, num_scan_inputs=1),
    ]


v0, loop_w = rng.standard_normal(3), rng.standard_normal(3)
loop_inputs = {
    "trips": np.array(10, dtype=np.int64),
    "keep_going": np.array(True),
    "v0": v0,
    "w": loop_w,
}
LOOP_CASES = [
    OpCase("Loop", loop_inputs, graph=loop_graph(), n_outputs=2, id="Loop-condition"),
    OpCase(
        "Loop",
        {**loop_inputs, "trips": np.array(3, dtype=np.int64)},
        graph=loop_graph(with_condition=False),
        n_outputs=2,
        evaluator="onnxruntime",  # the reference Loop runs no iteration without a condition
        id="Loop-trip-count",
    ),
    OpCase(
        "Loop",
        {**loop_inputs, "trips": None},
        graph=loop_graph(with_trip_count=False),
        n_outputs=2,
        evaluator="onnxruntime",
        id="Loop-condition-only",
    ),
    OpCase(
        "Loop",
        {"trips": np.array(3, dtype=np.int64), "v0": v0, "w": loop_w},
        graph=chained_loops(),
        n_outputs=2,
        evaluator="onnxruntime",
        id="Loop-unknown-rank-state",
    ),
    OpCase(
        "Loop",
        {"trips": np.array(3, dtype=np.int64), "v0": v0, "w": loop_w},
        graph=chained_loops(fixed=False),
        n_outputs=2,
        evaluator="onnxruntime",
        id="Loop-unknown-rank-state-unfixed",
    ),
    OpCase(
        "Scan",
        {"h0": h0, "x": x, "w": w},
        graph=scan_after_loop,
        n_outputs=2,
        id="Scan-unknown-rank-state",  # onnxruntime runs the model only once ranks are declared
    ),
    OpCase(
        "Loop",
        {"trips": np.array(2, dtype=np.int64), "h0": h0 * 0.3, "x": x * 0.3, "w": w},
        graph=nested_loop_scan,
        n_outputs=1,
        id="Loop-nested-Scan",
    ),
    OpCase(
        "Scan",
        {"h0": h0, "x": x, "w": w},
        graph=scan_with_if,
        n_outputs=2,
        id="Scan-nested-If",
    ),
]

positive = rng.uniform(0.2, 1.0, (2, 3))
CASES = [
    OpCase("If", {"x": positive, "w": rng.standard_normal(3)}, graph=if_on_sign, id="If-then"),
    OpCase("If", {"x": -positive, "w": rng.standard_normal(3)}, graph=if_on_sign, id="If-else"),
    *SCAN_CASES,
    *LOOP_CASES,
]
CASES += [second_order(case) for case in CASES if case.n_outputs == 1]
CASES += [
    second_order(OpCase("Scan", rnn_inputs, graph=scan_rnn(num_scan_inputs=1), id="Scan-y0")),
    second_order(OpCase("Loop", loop_inputs, graph=loop_graph(), id="Loop-y0")),
]
