"""Attention computed in tiles of query rows (``recompute="attention"``, and ``"auto"``).

References: float64 central finite differences of the untouched forward model (evaluated by
onnx's reference evaluator, which runs the tiled loops too), and onnxruntime's float32
gradients of the plain graph. Tile heights of 1 row, of rows that leave a shorter last tile,
and of the whole sequence are forced through the tile budget. Structure: the scores and
probabilities live inside the two loops only, and no node of the internal domain is left.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from onnxgrad.derivative import DerivativeOptions
from onnxgrad.derivative.autodiff import attention_tiles
from tests.derivative.fd import onnx_numerical_vjp, run_onnxruntime

BATCH, HEADS, SEQ, WIDTH = 2, 2, 5, 3
WEIGHTS = ["Wq", "Wk", "Wv"]


def attention_model(scores: str = "causal", dtype=np.float64, mask_weight: bool = False):
    """``loss = sum(softmax(f(Q K^T)) V * c)`` over ``[batch, heads, seq, width]`` heads,
    ``Q = x Wq`` etc. reshaped into heads; ``f`` one of the score variants below."""
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    embed = HEADS * WIDTH
    inits = [
        numpy_helper.from_array(rng.standard_normal((embed, embed)).astype(dtype), name)
        for name in WEIGHTS
    ]
    inits += [
        numpy_helper.from_array(np.array([0, 0, HEADS, WIDTH], np.int64), "heads"),
        numpy_helper.from_array(rng.standard_normal((BATCH, HEADS, SEQ, WIDTH)).astype(dtype), "c"),
        numpy_helper.from_array(np.array(WIDTH**-0.5, dtype), "scale"),
    ]
    nodes = []
    for name, perm in (("q", [0, 2, 1, 3]), ("kt", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        weight = f"W{name[0]}"
        nodes += [
            helper.make_node("MatMul", ["x", weight], [f"{name}_flat"]),
            helper.make_node("Reshape", [f"{name}_flat", "heads"], [f"{name}_heads"]),
            helper.make_node("Transpose", [f"{name}_heads"], [name], perm=perm),
        ]
    nodes.append(helper.make_node("MatMul", ["q", "kt"], ["s0"]))
    last = _score_nodes(scores, nodes, inits, dtype, rng, mask_weight)
    nodes += [
        helper.make_node("Softmax", [last], ["p"], axis=-1, name="attention/softmax"),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
        helper.make_node("Mul", ["o", "c"], ["oc"]),
        helper.make_node("ReduceSum", ["oc"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info("x", elem, [BATCH, SEQ, embed])],
        [helper.make_tensor_value_info("loss", elem, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _score_nodes(scores, nodes, inits, dtype, rng, mask_weight) -> str:
    """Append the score ops of variant ``scores`` after ``s0``; returns the softmax input."""
    causal = np.triu(np.full((SEQ, SEQ), -1e4), 1).astype(dtype)
    if scores == "plain":
        return "s0"
    if scores == "causal":  # scale, then an additive [1, 1, S, S] mask
        inits.append(numpy_helper.from_array(causal[None, None], "mask"))
        nodes += [
            helper.make_node("Mul", ["s0", "scale"], ["s1"]),
            helper.make_node("Add", ["s1", "mask"], ["s2"]),
        ]
        return "s2"
    if scores == "padding":  # a [B, 1, 1, S] key mask and a full [B, H, S, S] bias
        keys = np.zeros((BATCH, 1, 1, SEQ), dtype)
        keys[1, ..., -2:] = -1e4
        bias = rng.standard_normal((BATCH, HEADS, SEQ, SEQ)).astype(dtype)
        inits.append(numpy_helper.from_array(keys, "keys"))
        inits.append(numpy_helper.from_array(bias, "bias"))
        nodes += [
            helper.make_node("Div", ["s0", "scale"], ["s1"]),
            helper.make_node("Add", ["s1", "keys"], ["s2"]),
            helper.make_node("Add", ["bias", "s2"], ["s3"]),
        ]
        return "s3"
    if scores == "where":  # Where(causal, scores, lowest), then a soft cap 2 tanh(s / 2)
        allowed = np.tril(np.ones((SEQ, SEQ), bool))
        inits.append(numpy_helper.from_array(allowed, "allowed"))
        inits.append(numpy_helper.from_array(np.array(np.finfo(dtype).min, dtype), "lowest"))
        inits.append(numpy_helper.from_array(np.array(2.0, dtype), "cap"))
        nodes += [
            helper.make_node("Div", ["s0", "cap"], ["s1"]),
            helper.make_node("Tanh", ["s1"], ["s2"]),
            helper.make_node("Mul", ["s2", "cap"], ["s3"]),
            helper.make_node("Where", ["allowed", "s3", "lowest"], ["s4"]),
        ]
        return "s4"
    raise ValueError(scores)


def _weights(model) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in WEIGHTS}


def _gradient(model, recompute="attention", weights=WEIGHTS):
    return onnx_derivative(
        model, list(weights), ["x"], DerivativeOptions.Loss, loss="loss", recompute=recompute
    )


@pytest.fixture(autouse=True)
def tile_small_scores(monkeypatch):
    """The test models' 5 x 5 scores are tiled (the default leaves scores this small)."""
    monkeypatch.setattr(attention_tiles, "MIN_SCORES", 1)


@pytest.fixture
def tile_budget(monkeypatch):
    """Sets the score elements a tile holds (rows = budget // (batch * heads * seq))."""

    def set_rows(rows: int) -> None:
        monkeypatch.setattr(attention_tiles, "TILE_ELEMENTS", rows * BATCH * HEADS * SEQ)
        monkeypatch.setattr(attention_tiles, "MIN_TILE_ROWS", 1)

    return set_rows


@pytest.mark.parametrize("scores", ["plain", "causal", "padding", "where"])
@pytest.mark.parametrize("rows", [1, 2, SEQ])
def test_tiled_gradients_equal_finite_differences(scores, rows, tile_budget):
    tile_budget(rows)
    model = attention_model(scores)
    gradient = _gradient(model)
    assert [n.op_type for n in gradient.graph.node].count("Loop") == 2
    x = np.random.default_rng(1).standard_normal((BATCH, SEQ, HEADS * WIDTH))
    feeds = {"x": x, **_weights(model)}
    names = [o.name for o in gradient.graph.output]
    result = dict(zip(names, ReferenceEvaluator(gradient).run(None, feeds)))
    expected = onnx_numerical_vjp(model, feeds, ["x", *WEIGHTS])
    for name, value in expected.items():
        np.testing.assert_allclose(result[f"{name}_grad"], value, rtol=1e-6, atol=1e-8)
    (loss,) = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_allclose(result["loss"], loss, rtol=1e-12)


@pytest.mark.parametrize("scores", ["causal", "padding", "where"])
def test_onnxruntime_runs_tiles_like_the_plain_graph(scores, tile_budget):
    """float32 in onnxruntime, 2 rows a tile (a shorter last tile), and a batch of 1 where
    the model was built for 2 (the tile height follows the shapes at run time)."""
    tile_budget(2)
    model = attention_model(scores, np.float32)
    x = np.random.default_rng(2).standard_normal((BATCH, SEQ, HEADS * WIDTH)).astype(np.float32)
    feeds = {"x": x, **_weights(model)}
    plain = run_onnxruntime(_gradient(model, recompute=None), feeds)
    tiled = run_onnxruntime(_gradient(model), feeds)
    for name, value in plain.items():
        np.testing.assert_allclose(tiled[name], value, rtol=1e-5, atol=1e-5)


def test_scores_and_probabilities_stay_inside_the_loops():
    model = attention_model("causal", np.float32)
    gradient = _gradient(model)
    top_values = {o for n in gradient.graph.node for o in n.output}
    assert not {"s0", "s1", "s2", "p"} & top_values
    assert all(n.domain in ("", "ai.onnx") for n in gradient.graph.node)
    loops = [n for n in gradient.graph.node if n.op_type == "Loop"]
    bodies = [n.attribute[0].g for n in loops]
    assert all({"Softmax", "MatMul"} <= {n.op_type for n in body.node} for body in bodies)
    onnx.checker.check_model(gradient, full_check=True)


def test_small_static_scores_are_not_tiled(monkeypatch):
    """Below ``MIN_SCORES`` elements a head (both sizes static) the loop costs more time
    than it saves memory; with a symbolic sequence the core is tiled."""
    monkeypatch.setattr(attention_tiles, "MIN_SCORES", SEQ * SEQ + 1)
    model = attention_model("causal", np.float32)
    assert "Loop" not in {n.op_type for n in _gradient(model).graph.node}
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "sequence"
    model.graph.ClearField("value_info")
    for init in model.graph.initializer:
        if init.name == "mask":  # a mask of the sequence's size, read from x
            model.graph.initializer.remove(init)
            break
    model.graph.node.insert(
        0, helper.make_node("ConstantOfShape", ["mask_shape"], ["mask"], name="zero_mask")
    )
    model.graph.node.insert(0, helper.make_node("Shape", ["x"], ["x_shape"], name="x_shape"))
    model.graph.node.insert(
        1,
        helper.make_node(
            "Concat", ["ones", "x_shape_seq", "x_shape_seq"], ["mask_shape"], axis=0, name="cat"
        ),
    )
    model.graph.node.insert(
        1,
        helper.make_node("Slice", ["x_shape", "one", "two"], ["x_shape_seq"], name="seq_len"),
    )
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([1, 1], np.int64), "ones"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(np.array([2], np.int64), "two"),
        ]
    )
    gradient = _gradient(model)
    assert [n.op_type for n in gradient.graph.node].count("Loop") == 2


def test_plain_and_block_choices_do_not_tile():
    model = attention_model("causal", np.float32)
    for recompute in (None, [r"attention/"]):
        assert "Loop" not in {n.op_type for n in _gradient(model, recompute).graph.node}


def test_a_trained_score_bias_keeps_the_plain_attention():
    """A mask that is a weight needs the full score gradient: the core stays as it is, and
    the bias's gradient is still right."""
    model = attention_model("padding")
    gradient = _gradient(model, weights=[*WEIGHTS, "bias"])
    assert "Loop" not in {n.op_type for n in gradient.graph.node}
    x = np.random.default_rng(3).standard_normal((BATCH, SEQ, HEADS * WIDTH))
    bias = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "bias"))
    feeds = {"x": x, "bias": bias, **_weights(model)}
    names = [o.name for o in gradient.graph.output]
    result = dict(zip(names, ReferenceEvaluator(gradient).run(None, feeds)))
    expected = onnx_numerical_vjp(model, feeds, ["bias"])
    np.testing.assert_allclose(result["bias_grad"], expected["bias"], rtol=1e-6, atol=1e-8)


def test_tiled_gradient_differentiates_again():
    """The tiled gradient graph is itself differentiable: d/dx of sum(dloss/dx . u) against
    finite differences of the tiled gradient graph."""
    model = attention_model("causal")
    gradient = onnx_derivative(
        model, [], ["x"], DerivativeOptions.Loss, loss="loss", recompute="attention"
    )
    inputs = {"x": np.random.default_rng(4).standard_normal((BATCH, SEQ, HEADS * WIDTH))}
    second = onnx_derivative(gradient, [], ["x"], DerivativeOptions.FillGrad, outputs=["x_grad"])
    (result,) = ReferenceEvaluator(second).run(None, inputs)
    expected = onnx_numerical_vjp(gradient, inputs, ["x"], outputs=["x_grad"])
    np.testing.assert_allclose(result, expected["x"], rtol=1e-5, atol=1e-7)


def test_float32_tiles_in_onnxruntime_match_a_float32_model():
    """The loops type their states from the model: a float32 model's tiled gradient runs in
    onnxruntime with the tile budget at its default (one tile here)."""
    model = attention_model("where", np.float32)
    x = np.random.default_rng(5).standard_normal((1, SEQ, HEADS * WIDTH)).astype(np.float32)
    c = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "c"))
    for init in model.graph.initializer:
        if init.name == "c":
            init.CopyFrom(numpy_helper.from_array(c[:1], "c"))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    feeds = {"x": x, **_weights(model)}
    plain = run_onnxruntime(_gradient(model, recompute=None), feeds)
    tiled = run_onnxruntime(_gradient(model), feeds)
    for name, value in plain.items():
        np.testing.assert_allclose(tiled[name], value, rtol=1e-5, atol=1e-6)
