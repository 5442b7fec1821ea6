"""The reverse build does no work a model does not need: passes with nothing to rewrite
return before their per-node analyses (checked by making those analyses fail), the
engine's own node maker writes what ``onnx.helper.make_node`` writes, and batched seeds
infer shapes once. Speed itself is
measured in ``benchmarks/bench_modes.py``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxgrad.derivative.seed_axis as seed_axis
import onnxgrad.normalize.constants as constants
import onnxgrad.normalize.lowering as lowering
import onnxgrad.normalize.ranks as ranks
from onnxgrad import add_loss_output, onnx_derivative, onnx_hvp, onnx_jvp
from onnxgrad._onnx_utils import NameScope
from onnxgrad.derivative.autodiff.builder import new_node
from onnxgrad.graph.loss import _unused as first_free_from_start
from onnxgrad.normalize import normalized_model
from tests.derivative.fd import onnx_numerical_vjp

D = TensorProto.DOUBLE


def float_model() -> onnx.ModelProto:
    """``y = Cast(tanh(x W) * 2 + b)``: Mul, Cast and float initializers, no quantized
    operator, no Constant node, no subgraph, every rank known."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float64), "W")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float64), "b")
    two = numpy_helper.from_array(np.array(2, dtype=np.float64), "two")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Tanh", ["xw"], ["t"]),
        helper.make_node("Mul", ["t", "two"], ["t2"]),
        helper.make_node("Add", ["t2", "b"], ["s"]),
        helper.make_node("Cast", ["s"], ["y"], to=D),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", D, [2, 3])],
        [helper.make_tensor_value_info("y", D, [2, 4])],
        [w, b, two],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _fails(*_, **__):
    raise AssertionError("an analysis ran on a model that needs none")


def test_float_model_skips_the_analyses_it_does_not_need(monkeypatch):
    """No node re-inferred for a straight-through rewrite (Mul and Cast are in that table,
    but only rewrite what reads a DynamicQuantizeLinear), no weight analysis without a
    float Constant, no rank rule walked when inference ranks every value."""
    monkeypatch.setattr(lowering, "_infer_into", _fails)
    monkeypatch.setattr(constants, "differentiable_values", _fails)
    monkeypatch.setattr(ranks, "_walk", _fails)
    model = float_model()
    gradient = onnx_derivative(model, weights=["W", "b"], inputs=["x"])
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 3)), **_weights(model)}
    seed = rng.standard_normal((2, 4))
    got = ReferenceEvaluator(gradient).run(None, {**feeds, "y_grad": seed})
    expected = onnx_numerical_vjp(model, feeds, ["x", "W", "b"], [seed])
    for value, name in zip(got[:3], ["x", "W", "b"], strict=True):
        np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-8)


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {
        i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in ("W", "b")
    }


def test_analyses_still_run_where_they_find_something(monkeypatch):
    """The early returns do not hide work: a float Constant weight is promoted, a value
    whose rank inference cannot tell gets one, a DequantizeLinear is rewritten."""
    model = float_model()
    weight = model.graph.initializer[0]
    constant = helper.make_node("Constant", [], ["W"], value=weight)
    del model.graph.initializer[0]
    model.graph.node.insert(0, constant)
    assert "W" in {i.name for i in normalized_model(model).graph.initializer}

    monkeypatch.setattr(ranks, "_walk", _fails)
    unranked = float_model()
    unranked.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(AssertionError, match="an analysis ran"):
        normalized_model(unranked)


@pytest.mark.parametrize(
    "attributes",
    [
        {},
        {"axis": 1},
        {"keepdims": True},
        {"alpha": 0.5},
        {"mode": "constant"},
        {"perm": [0, 2, 1]},
        {"perm": (1, 0)},
        {"axes": [np.int64(0)], "value": np.int64(3)},
        {"scales": [0.5, 2.0]},
        {"value": numpy_helper.from_array(np.ones((2,), np.float32), "v")},
        {"to": D, "saturate": None},
    ],
    ids=lambda a: ",".join(a) or "none",
)
def test_node_maker_writes_what_make_node_writes(attributes):
    store = onnx.GraphProto()
    made = new_node(store.node, "Op", ["a", "", "b"], ["y"], "name", attributes)
    expected = helper.make_node(
        "Op", ["a", "", "b"], ["y"], name="name", **{k: v for k, v in attributes.items()}
    )
    assert made == expected
    assert made.SerializeToString() == expected.SerializeToString()


#: no dimension of ``float_model`` is 7: a graph input shaped ``[7, ...]`` carries the seeds
SEEDS = 7


def _recording(real, batched: list):
    """``onnx.shape_inference.infer_shapes``, recording in ``batched`` the node outputs of
    every graph it infers with the seed axis (a graph input shaped ``[SEEDS, ...]``)."""

    def infer(model, *args, **kwargs):
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)
        for info in proto.graph.input:
            dims = info.type.tensor_type.shape.dim
            if dims and dims[0].dim_value == SEEDS:
                batched.append({o for node in proto.graph.node for o in node.output})
                break
        return real(model, *args, **kwargs)

    return infer


def _recording_checks(real, batched: list):
    """``onnx.checker.check_model``, recording as :func:`_recording` the graphs it also
    infers (``full_check``: a small graph's checker and strict inference in one call)."""
    record = _recording(lambda model, *args, **kwargs: None, batched)

    def check(model, full_check=False, *args, **kwargs):
        if full_check:
            record(model)
        return real(model, full_check, *args, **kwargs)

    return check


def _central_difference_jvp(model, feeds: dict, tangent: np.ndarray) -> np.ndarray:
    """``J t`` by central differences in float64 along ``t`` (the input ``x``)."""
    run = ReferenceEvaluator(model)
    h = 1e-6
    plus = run.run(None, {"x": feeds["x"] + h * tangent})[0]
    minus = run.run(None, {"x": feeds["x"] - h * tangent})[0]
    return (plus - minus) / (2 * h)


def test_batched_seeds_infer_each_node_once(monkeypatch):
    """``seeds=k`` infers the one-seed graph (the rules read its types), then the seeded
    nodes alone with the seed axis, not the forward nodes again (``xw = x W`` and
    ``t = tanh(xw)`` read no seed); the results still equal finite differences per seed."""
    batched: list[set[str]] = []
    monkeypatch.setattr(
        onnx.shape_inference, "infer_shapes", _recording(onnx.shape_inference.infer_shapes, batched)
    )
    monkeypatch.setattr(
        onnx.checker, "check_model", _recording_checks(onnx.checker.check_model, batched)
    )
    model = float_model()
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 3)), **_weights(model)}
    tangents = rng.standard_normal((SEEDS, 2, 3))
    jvp = onnx_jvp(model, inputs=["x"], seeds=SEEDS)
    (got,) = ReferenceEvaluator(jvp).run(None, {**feeds, "x_tangent": tangents})
    for i in range(SEEDS):
        expected = _central_difference_jvp(model, feeds, tangents[i])
        np.testing.assert_allclose(got[i], expected, rtol=1e-6, atol=1e-8)

    cotangents = rng.standard_normal((SEEDS, 2, 4))
    vjp = onnx_derivative(model, weights=[], inputs=["x"], seeds=SEEDS)
    (got,) = ReferenceEvaluator(vjp).run(None, {**feeds, "y_grad": cotangents})
    for i in range(SEEDS):
        expected = onnx_numerical_vjp(model, feeds, ["x"], [cotangents[i]])["x"]
        np.testing.assert_allclose(got[i], expected, rtol=1e-6, atol=1e-8)

    assert len(batched) == 2, "one inference with the seed axis per batched build"
    for outputs in batched:
        assert outputs and outputs.isdisjoint({"xw", "t"}), sorted(outputs)

    hvp = onnx_hvp(add_loss_output(model), inputs=["x"], seeds=SEEDS)
    assert [d.dim_value for d in hvp.graph.output[0].type.tensor_type.shape.dim] == [SEEDS, 2, 3]


def _cast_to_float(sa, node):
    """A broken ``Mul`` rule: its result cast to float32 (the model computes in float64)."""
    sa.op("Cast", node.input[0], out=node.output[0], to=TensorProto.FLOAT)
    return True


def _sum_over_seeds(sa, node):
    """A broken ``Mul`` rule: its result summed over the seed axis (one rank short)."""
    sa.op("ReduceSum", node.input[0], sa.ints([0]), out=node.output[0], keepdims=0)
    return True


@pytest.mark.parametrize(
    ("rule", "found"),
    [(_cast_to_float, "elem type"), (_sum_over_seeds, "rank")],
    ids=["element type", "rank"],
)
@pytest.mark.parametrize("mode", ["jvp", "vjp"])
def test_an_ill_typed_seeded_node_is_refused_at_build(monkeypatch, rule, found, mode):
    """A rule writing a node whose result contradicts the one-seed type with the seed axis
    in front (another element type, the seed axis lost) is refused when the graph is built,
    naming the node, not when onnxruntime loads it; onnx's checker alone accepts both."""
    monkeypatch.setitem(seed_axis._RULES, "Mul", rule)
    with pytest.raises(ValueError, match=f"invalid node.*{found}.*node name: (Cast|ReduceSum)"):
        if mode == "jvp":
            onnx_jvp(float_model(), inputs=["x"], seeds=SEEDS)
        else:
            onnx_derivative(float_model(), weights=[], inputs=["x"], seeds=SEEDS)


def test_batched_seeds_still_check_the_batched_graph(monkeypatch):
    """Without the second inference, onnx's checker still refuses a batched graph a rule
    broke (here a ``Mul`` rule that reads a value no node computes)."""

    def broken_rule(sa, node):
        sa.same(node, ["nowhere"])
        return True

    monkeypatch.setitem(seed_axis._RULES, "Mul", broken_rule)
    with pytest.raises(onnx.checker.ValidationError, match="nowhere"):
        onnx_jvp(float_model(), inputs=["x"], seeds=SEEDS)


def test_name_scope_resumes_where_it_stopped():
    """``NameScope.unique`` resumes its search at the last suffix it gave a base (the seed
    axis asks for hundreds of ``Unsqueeze_seeded``): the names are those of a search from
    the start, reserved names and bases that look like suffixed names included."""
    used = {"a", "a_2", "b_1"}
    scope, expected = NameScope(used), set(used)
    for step, base in enumerate(["a", "a", "b", "a_1", "a", "b", "b_1", "a", "b"] * 3):
        if step == 10:
            scope.reserve("a_9")
            expected.add("a_9")
        assert scope.unique(base) == first_free_from_start(base, expected)


def declared_model() -> onnx.ModelProto:
    """:func:`float_model` with every value declared, as exporters write it (torch's dynamo
    export declares each node output): the declarations rank every input of its ``Mul``,
    ``Add`` and ``Cast``, whose data onnx's inference may propagate."""
    model = float_model()
    for name, shape in [("xw", [2, 4]), ("t", [2, 4]), ("t2", [2, 4]), ("s", [2, 4])]:
        model.graph.value_info.append(helper.make_tensor_value_info(name, D, shape))
    return model


def _forward_inferences(real, calls: list):
    """``onnx.shape_inference.infer_shapes``, recording in ``calls`` whether it propagated
    data, for every inference of the forward graph (the nodes of :func:`float_model`)."""
    forward = {"xw", "t", "t2", "s", "y"}

    def infer(model, *args, **kwargs):
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)
        if {o for node in proto.graph.node for o in node.output} == forward:
            calls.append(bool(kwargs.get("data_prop")))
        return real(model, *args, **kwargs)

    return infer


@pytest.mark.parametrize("mode", ["reverse", "batched reverse", "forward"])
def test_declared_model_is_inferred_once_per_pass(monkeypatch, mode):
    """Where the model declares every value, the engine's types infer it once (with data
    propagation, bounded by the declarations), after the shapes pass's one plain inference;
    the ranks pass infers nothing, that plain inference having ranked every value
    (:class:`onnxgrad.normalize.facts.Facts`): 2 inferences of the forward graph per reverse
    build (5, then 3 before), 1 per JVP build (3, then 2). A model without these
    declarations, its output declared as inferred, has the engine read the shapes pass's
    inference (:attr:`~onnxgrad.normalize.facts.Facts.inferred`): 1 inference; one whose
    output is declared otherwise still gets the plain pass before the bounded one. The
    gradients still equal central differences."""
    calls: list[bool] = []
    infer = _forward_inferences(onnx.shape_inference.infer_shapes, calls)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", infer)
    rng = np.random.default_rng(3)
    model = declared_model()
    feeds = {"x": rng.standard_normal((2, 3)), **_weights(model)}
    if mode == "forward":
        tangent = rng.standard_normal((2, 3))
        (got,) = ReferenceEvaluator(onnx_jvp(model, inputs=["x"])).run(
            None, {**feeds, "x_tangent": tangent}
        )
        np.testing.assert_allclose(got, _central_difference_jvp(model, feeds, tangent), 1e-6)
        assert calls == [False], calls
    else:
        seeds = SEEDS if mode == "batched reverse" else None
        cotangent = rng.standard_normal((SEEDS, 2, 4) if seeds else (2, 4))
        vjp = onnx_derivative(model, weights=[], inputs=["x"], seeds=seeds)
        (got,) = ReferenceEvaluator(vjp).run(None, {**feeds, "y_grad": cotangent})
        for i, seed in enumerate(cotangent if seeds else [cotangent]):
            expected = onnx_numerical_vjp(model, feeds, ["x"], [seed])["x"]
            np.testing.assert_allclose(got[i] if seeds else got, expected, 1e-6, 1e-8)
        assert calls == [False, True], calls

    calls.clear()
    onnx_derivative(float_model(), weights=[], inputs=["x"])
    assert calls == [False], "undeclared: the shapes pass's inference is the engine's too"
    calls.clear()
    named = float_model()
    named.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    onnx_derivative(named, weights=[], inputs=["x"])
    undeclared = [False, False, True]
    assert calls == undeclared, "declared otherwise: the bound read from a plain pass each time"
