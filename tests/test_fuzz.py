"""Fuzzing (hypothesis, derandomised, about a minute): random valid graphs get gradients
equal to float64 finite differences; mutated models get a clean error or a correct result.

Random graphs are DAGs of smooth ops on ``[2, 3]`` float64 values (broadcast weights of
shapes ``[3]``, ``[1, 3]``, ``[2, 1]``, ``[]`` included), with one or two outputs and their
nodes sometimes shuffled (onnxruntime runs unsorted graphs; so must the derivative).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative
from tests.derivative.fd import onnx_numerical_vjp

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

D = TensorProto.DOUBLE
UNARY = ("Tanh", "Sigmoid", "Neg", "Sin", "Cos", "Softmax", "Identity")
BINARY = ("Add", "Sub", "Mul")
WEIGHT_SHAPES = ((2, 3), (3,), (1, 3), (2, 1), ())
#: Exceptions a user may get for a bad model: they name the problem.
CLEAN_ERRORS = (ValueError, TypeError, NotImplementedError)
SETTINGS = hypothesis.settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)


@st.composite
def random_models(draw) -> onnx.ModelProto:
    """A random valid model ``x [2, 3] -> outputs``."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values, nodes, inits = ["x"], [], []
    for index in range(draw(st.integers(1, 8))):
        out = f"v{index}"
        kind = draw(st.sampled_from(("unary", "binary", "weight", "matmul")))
        source = draw(st.sampled_from(values))
        if kind == "unary":
            op = draw(st.sampled_from(UNARY))
            nodes.append(helper.make_node(op, [source], [out], name=f"n{index}"))
        elif kind == "binary":
            other = draw(st.sampled_from(values))
            op = draw(st.sampled_from(BINARY))
            nodes.append(helper.make_node(op, [source, other], [out], name=f"n{index}"))
        else:
            shape = (3, 3) if kind == "matmul" else draw(st.sampled_from(WEIGHT_SHAPES))
            weight = f"w{index}"
            inits.append(numpy_helper.from_array(rng.uniform(-1, 1, shape), weight))
            op = "MatMul" if kind == "matmul" else draw(st.sampled_from(BINARY))
            operands = (
                [source, weight] if draw(st.booleans()) or op == "MatMul" else [weight, source]
            )
            nodes.append(helper.make_node(op, operands, [out], name=f"n{index}"))
        values.append(out)
    outputs = [values[-1]]
    if len(values) > 2 and draw(st.booleans()):
        outputs.append(draw(st.sampled_from(values[1:-1])))
    if draw(st.booleans()):
        order = rng.permutation(len(nodes))
        nodes = [nodes[i] for i in order]
    graph = helper.make_graph(
        nodes,
        "fuzz",
        [helper.make_tensor_value_info("x", D, [2, 3])],
        [helper.make_tensor_value_info(name, D, [2, 3]) for name in outputs],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _point(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.uniform(-1, 1, (2, 3))}
    feeds.update({i.name: numpy_helper.to_array(i) for i in model.graph.initializer})
    return feeds


def _sorted_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model with its nodes in data-flow order, for the reference evaluator (a
    node is taken once all it reads is known; a node that never is stays out)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    known = {i.name for i in model.graph.input} | {i.name for i in model.graph.initializer}
    pending, ordered = list(model.graph.node), []
    while True:
        ready = [n for n in pending if all(i in known for i in n.input if i)]
        if not ready:
            break
        ordered.append(ready[0])
        pending.remove(ready[0])
        known.update(ready[0].output)
    del copy.graph.node[:]
    copy.graph.node.extend(ordered)
    return copy


def check_gradient(model: onnx.ModelProto, reference: onnx.ModelProto) -> None:
    """The native gradient of ``model`` (seeded with ones) equals finite differences of
    ``reference`` (the same function, evaluated by onnx's reference evaluator)."""
    grad = onnx_derivative(model, options=DerivativeOptions.FillGrad)
    weights = [o.name[: -len("_grad")] for o in grad.graph.output if o.name != "x_grad"]
    feeds = _point(reference)
    fed = {i.name for i in grad.graph.input}
    got = ReferenceEvaluator(grad).run(None, {k: v for k, v in feeds.items() if k in fed})
    got = dict(zip([o.name for o in grad.graph.output], got))
    expected = onnx_numerical_vjp(reference, feeds, ["x", *weights])
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-5, atol=1e-7, err_msg=name)


@SETTINGS
@hypothesis.given(random_models())
def test_random_graphs_match_finite_differences(model):
    check_gradient(model, _sorted_copy(model))


def _mutate(model: onnx.ModelProto, kind: str, rng: np.random.Generator) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    node = graph.node[int(rng.integers(len(graph.node)))]
    if kind == "drop node":
        graph.node.remove(node)
    elif kind == "drop initializer" and graph.initializer:
        graph.initializer.remove(graph.initializer[int(rng.integers(len(graph.initializer)))])
    elif kind == "rename input":
        node.input[int(rng.integers(len(node.input)))] = "nowhere"
    elif kind == "self loop":
        node.input[0] = node.output[0]
    elif kind == "negative dim":
        graph.input[0].type.tensor_type.shape.dim[0].dim_value = -2
    elif kind == "foreign domain":
        node.domain = "undeclared.domain"
    elif kind == "duplicate output":
        other = graph.node[0] if graph.node[0] is not node else graph.node[-1]
        other.output[0] = node.output[0]
    elif kind == "unknown op":
        node.op_type = "NotAnOnnxOp"
    elif kind == "wrong arity":
        node.input.append("x")
    elif kind == "drop opset":
        del copy.opset_import[:]
    return copy


MUTATIONS = (
    "drop node",
    "drop initializer",
    "rename input",
    "self loop",
    "negative dim",
    "foreign domain",
    "duplicate output",
    "unknown op",
    "wrong arity",
    "drop opset",
)


@SETTINGS
@hypothesis.given(random_models(), st.sampled_from(MUTATIONS), st.integers(0, 1000))
def test_mutated_models_give_a_clean_error_or_a_correct_result(model, kind, seed):
    mutated = _mutate(model, kind, np.random.default_rng(seed))
    try:
        reference = _sorted_copy(mutated)
        ReferenceEvaluator(reference).run(None, {"x": np.zeros((2, 3))})
    except Exception:  # the mutation broke the model: it must be refused
        reference = None
    try:
        onnx_derivative(mutated, options=DerivativeOptions.FillGrad)
    except CLEAN_ERRORS as exc:
        message = str(exc)
        assert message.strip(), f"{kind}: {type(exc).__name__} without a message"
        return
    assert reference is not None, f"{kind}: accepted a model that cannot run"
    check_gradient(mutated, reference)
