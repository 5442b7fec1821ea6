"""Native gradient graphs differentiate again: a Hessian-vector product equals finite
differences of the gradient."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative
from tests.models import seed004_model, tanh_mlp_loss_model

WEIGHTS = ["W1", "b1", "W2", "b2"]


def _data(rng):
    return {"X": rng.standard_normal((6, 3)), "label": rng.standard_normal((6, 1))}


def _gradient(grad_model, feeds, weights):
    outputs = ReferenceEvaluator(grad_model).run(None, {**feeds, **weights})
    names = [o.name for o in grad_model.graph.output]
    return dict(zip(names, outputs))


def test_hessian_vector_product_matches_finite_differences():
    rng = np.random.default_rng(3)
    model, weights = tanh_mlp_loss_model()
    grad_model = onnx_derivative(model, weights=WEIGHTS, inputs=[], options=DerivativeOptions.Loss)
    hvp_model = onnx_derivative(grad_model, weights=[], inputs=WEIGHTS)
    assert {n.domain for n in hvp_model.graph.node} == {""}

    data = _data(rng)
    direction = {w: rng.standard_normal(v.shape) for w, v in weights.items()}
    seeds = {f"{w}_grad_grad": direction[w] for w in WEIGHTS}
    seeds["loss_grad"] = np.zeros((), dtype=np.float64)
    feeds = {**data, **weights, **seeds}
    hvp = dict(
        zip(
            [o.name for o in hvp_model.graph.output],
            ReferenceEvaluator(hvp_model).run(None, feeds),
        )
    )

    eps = 1e-5
    plus = {w: v + eps * direction[w] for w, v in weights.items()}
    minus = {w: v - eps * direction[w] for w, v in weights.items()}
    g_plus, g_minus = _gradient(grad_model, data, plus), _gradient(grad_model, data, minus)
    for w in WEIGHTS:
        expected = (g_plus[f"{w}_grad"] - g_minus[f"{w}_grad"]) / (2 * eps)
        np.testing.assert_allclose(hvp[f"{w}_grad"], expected, rtol=1e-6, atol=1e-7)

    session = onnxruntime.InferenceSession(
        hvp_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    for name, value in zip([o.name for o in hvp_model.graph.output], session.run(None, feeds)):
        np.testing.assert_allclose(value, hvp[name], rtol=1e-9, atol=1e-10)


def test_gradient_of_gradient_names_do_not_clash():
    model, _ = tanh_mlp_loss_model()
    grad_model = onnx_derivative(model, weights=WEIGHTS, inputs=[], options=DerivativeOptions.Loss)
    hvp_model = onnx_derivative(grad_model, weights=[], inputs=["W1"])
    assert [o.name for o in hvp_model.graph.output] == ["W1_grad"]
    inputs = [i.name for i in hvp_model.graph.input]
    assert inputs[-5:] == [
        "W1_grad_grad",
        "b1_grad_grad",
        "W2_grad_grad",
        "b2_grad_grad",
        "loss_grad",
    ]


@pytest.mark.parametrize("options", [DerivativeOptions.FillGrad, DerivativeOptions.Zero])
def test_second_derivative_has_unique_node_names_and_loads(options):
    first = onnx_derivative(seed004_model(), weights=[], options=DerivativeOptions.FillGrad)
    second = onnx_derivative(first, weights=[], inputs=["x"], options=options)
    names = [n.name for n in second.graph.node if n.name]
    assert len(names) == len(set(names))
    onnxruntime.InferenceSession(second.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("ignore_index", [None, -1])
def test_cross_entropy_gradient_differentiates_again(opset, ignore_index):
    """The logits' gradient of SoftmaxCrossEntropyLoss (a ``ScatterElements`` at the labels
    from opset 16, a one-hot product below; labels ignored outside the classes): its
    Hessian-vector product equals finite differences of the gradient."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    weight = rng.standard_normal((3, 5))
    attrs = {} if ignore_index is None else {"ignore_index": ignore_index}
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["logits"]),
            helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss"], **attrs),
        ],
        "ce",
        [
            helper.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", 3]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    grad_model = onnx_derivative(model, weights=["W"], inputs=[], options=DerivativeOptions.Loss)
    ops = {n.op_type for n in grad_model.graph.node}
    assert ("ScatterElements" in ops) == (opset >= 16)
    hvp_model = onnx_derivative(grad_model, weights=[], inputs=["W"])
    label = np.array([0, 4, 2, 1, 3, 0] if ignore_index is None else [0, -1, 2, 1, -1, 4])
    data = {"X": rng.standard_normal((6, 3)), "label": label}
    direction = rng.standard_normal(weight.shape)
    feeds = {**data, "W": weight, "W_grad_grad": direction, "loss_grad": np.zeros(())}
    (hvp,) = ReferenceEvaluator(hvp_model).run(None, feeds)
    eps = 1e-5
    g_plus = _gradient(grad_model, data, {"W": weight + eps * direction})["W_grad"]
    g_minus = _gradient(grad_model, data, {"W": weight - eps * direction})["W_grad"]
    np.testing.assert_allclose(hvp, (g_plus - g_minus) / (2 * eps), rtol=1e-6, atol=1e-8)
    session = onnxruntime.InferenceSession(
        hvp_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    np.testing.assert_allclose(session.run(None, feeds)[0], hvp, rtol=1e-9, atol=1e-12)


#: Scan, and Loop with a trip count and scan outputs, a condition only, both, and a carried
#: value of no inferred rank: the HVP transposes their reverse rule's Scan once more
CONTROL_FLOW = [
    "Scan",
    "Scan-two-streams-int-state",
    "Loop-trip-count",
    "Loop-condition-only",
    "Loop-condition",
    "Loop-unknown-rank-state",
]


@pytest.mark.parametrize("case_id", CONTROL_FLOW)
def test_control_flow_hvp_matches_finite_differences(case_id):
    """``onnx_hvp`` (forward-over-reverse) through Scan and Loop equals the central
    difference of the gradient along the tangent, run by the case's own oracle."""
    from tests.derivative.autodiff.cases_control_flow import CASES
    from tests.derivative.autodiff.gradcheck import check_hvp

    case = next(c for c in CASES if c.id == case_id)
    check_hvp(case, rtol=1e-5, atol=1e-6, seed=11)


@pytest.mark.parametrize("net", ["ScanNet", "WhileNet"])
def test_torch_loop_hvp_equals_torch_func(net):
    """``onnx_hvp`` of ``|f(x)|^2`` for torch's ``scan``/``while_loop`` exported by the
    dynamo exporter (an ONNX ``Scan``/``Loop``) equals ``torch.func.jvp`` of
    ``torch.func.grad`` on the eager loop, for the inputs and the parameters together."""
    torch = pytest.importorskip("torch")
    from onnxgrad import onnx_hvp
    from tests.derivative import test_torch_recurrent as recurrent

    class Loss(torch.nn.Module):
        def __init__(self, inner, eager: bool):
            super().__init__()
            self.inner, self.eager = inner, eager

        def forward(self, *xs):
            outputs = self.inner.eager(*xs) if self.eager else self.inner(*xs)
            return sum((o * o).sum() for o in outputs)

    torch.manual_seed(0)
    inner = getattr(recurrent, net)().eval()
    shapes = {"ScanNet": [(2, 3), (5, 2, 3)], "WhileNet": [(3,)]}[net]
    inputs = tuple(torch.randn(*s) for s in shapes)
    model = recurrent.export(Loss(inner, eager=False), inputs, dynamo=True)
    eager = Loss(inner, eager=True)
    params = {k: v.detach() for k, v in eager.named_parameters()}
    names = [i.name for i in model.graph.input]
    hvp_model = onnx_hvp(model, weights=list(params), loss=model.graph.output[0].name)

    tangents = tuple(torch.randn_like(x) for x in inputs)
    param_tangents = {k: torch.randn_like(v) for k, v in params.items()}

    def gradient(xs, ps):
        return torch.func.grad(lambda xs, ps: torch.func.functional_call(eager, ps, xs), (0, 1))(
            xs, ps
        )

    _, (x_hvp, p_hvp) = torch.func.jvp(gradient, (inputs, params), (tangents, param_tangents))
    feeds = {n: x.numpy() for n, x in zip(names, inputs)}
    feeds |= {f"{n}_tangent": t.numpy() for n, t in zip(names, tangents)}
    feeds |= {k: v.numpy() for k, v in params.items()}
    feeds |= {f"{k}_tangent": t.numpy() for k, t in param_tangents.items()}
    wanted = {i.name for i in hvp_model.graph.input}
    session = onnxruntime.InferenceSession(
        hvp_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    got = dict(
        zip(
            [o.name for o in hvp_model.graph.output],
            session.run(None, {k: v for k, v in feeds.items() if k in wanted}),
        )
    )
    expected = dict(zip(names, x_hvp)) | p_hvp
    assert set(got) == {f"{k}_grad_tangent" for k in expected}
    for name, value in expected.items():
        np.testing.assert_allclose(
            got[f"{name}_grad_tangent"], value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name
        )
