"""Batched seeds and Jacobians: ``k`` seeds in one run equal ``k`` single runs (JVP, VJP,
HVP); ``onnx_jacobian`` (reverse, forward, auto) equals ``torch.func.jacrev`` on a torch
export, its Hessian ``torch.func.hessian``, and finite differences in float64."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp, onnx_jacobian, onnx_jvp
from tests.derivative.test_forward import _mlp, _run, _softmax_model, _with_weights

K = 3


def _ort(model, feeds) -> dict:
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = {i.name for i in session.get_inputs()}
    outputs = session.run(None, {k: v for k, v in feeds.items() if k in names})
    return dict(zip([o.name for o in session.get_outputs()], outputs))


def _assert_k_runs_equal_k_single_runs(single, batched, feeds, seeds: dict, results: list):
    got = _ort(batched, {**feeds, **seeds})
    for i in range(K):
        one = _ort(single, {**feeds, **{name: value[i] for name, value in seeds.items()}})
        for name in results:
            np.testing.assert_allclose(got[name][i], one[name], rtol=1e-12, atol=1e-14)


def test_k_tangents_in_one_run_equal_k_jvps():
    rng = np.random.default_rng(0)
    model, values = _softmax_model(rng, loss=False)
    batched = onnx_jvp(model, weights=["W"], seeds=K)
    assert [d.dim_value for d in batched.graph.input[-1].type.tensor_type.shape.dim] == [K, 3, 4]
    seeds = {f"{s}_tangent": rng.standard_normal((K, *values[s].shape)) for s in ("x", "W")}
    single = onnx_jvp(model, weights=["W"])
    _assert_k_runs_equal_k_single_runs(single, batched, values, seeds, ["y_tangent"])


def test_k_cotangents_in_one_run_equal_k_vjps():
    rng = np.random.default_rng(1)
    model, values = _mlp(rng, loss=False)
    batched = onnx_derivative(model, weights=["W", "b"], seeds=K)
    seeds = {"t_grad": rng.standard_normal((K, 2, 4))}
    single = onnx_derivative(model, weights=["W", "b"])
    results = ["x_grad", "x2_grad", "W_grad", "b_grad"]
    _assert_k_runs_equal_k_single_runs(single, batched, values, seeds, results)


def test_k_tangents_in_one_run_equal_k_hvps():
    rng = np.random.default_rng(2)
    model, values = _softmax_model(rng, loss=True)
    batched = onnx_hvp(model, weights=["W"], inputs=["x"], seeds=K)
    seeds = {f"{s}_tangent": rng.standard_normal((K, *values[s].shape)) for s in ("x", "W")}
    single = onnx_hvp(model, weights=["W"], inputs=["x"])
    _assert_k_runs_equal_k_single_runs(
        single, batched, values, seeds, ["x_grad_tangent", "W_grad_tangent"]
    )


def test_seeds_are_refused_where_the_gradient_has_no_seed_input():
    model, _ = _mlp(np.random.default_rng(3), loss=True)
    with pytest.raises(ValueError, match="seeds= needs"):
        onnx_derivative(model, options=DerivativeOptions.Loss, seeds=2)
    with pytest.raises(ValueError, match="positive integer"):
        onnx_jvp(model, seeds=0)


def _net(torch):
    """Two outputs of two inputs, through a Softmax."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(3, 4)
            self.second = torch.nn.Linear(4, 2)

        def forward(self, x, z):
            p = torch.softmax(self.second(torch.tanh(self.first(x))), -1) * z.sum()
            return p, (x * x).sum(-1)

    return Net()


@pytest.fixture(scope="module")
def exported():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = _net(torch).double()
    x, z = torch.randn(2, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net, (x, z), buffer, input_names=["x", "z"], output_names=["p", "q"],
            dynamo=False, opset_version=17, do_constant_folding=False,
        )  # fmt: skip
    return torch, net, onnx.load_from_string(buffer.getvalue()), x, z


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
def test_jacobian_equals_torch_func(exported, mode):
    torch, net, model, x, z = exported
    expected = torch.func.jacrev(net, argnums=(0, 1))(x, z)
    if mode == "fwd":
        expected = torch.func.jacfwd(net, argnums=(0, 1))(x, z)
    got = _ort(onnx_jacobian(model, mode=mode), {"x": x.numpy(), "z": z.numpy()})
    assert sorted(got) == ["dp_dx", "dp_dz", "dq_dx", "dq_dz"]
    for j, y in enumerate("pq"):
        for i, source in enumerate("xz"):
            block = expected[j][i].detach().numpy()
            np.testing.assert_allclose(got[f"d{y}_d{source}"], block, rtol=1e-10, atol=1e-12)


def test_jacobian_of_the_gradient_equals_torch_hessian(exported):
    """The Jacobian of the gradient graph of ``<p, g_p> + <q, g_q>`` is its Hessian."""
    torch, net, model, x, z = exported
    gradient = onnx_derivative(model, weights=[], inputs=["x"])
    kept = [o for o in gradient.graph.output if o.name == "x_grad"]
    del gradient.graph.output[:]
    gradient.graph.output.extend(kept)
    rng = np.random.default_rng(5)
    g_p, g_q = rng.standard_normal((2, 2)), rng.standard_normal(2)
    feeds = {"x": x.numpy(), "z": z.numpy(), "p_grad": g_p, "q_grad": g_q}
    got = _ort(onnx_jacobian(gradient, inputs=["x"]), feeds)

    def weighted(x):
        p, q = net(x, z)
        return (p * torch.from_numpy(g_p)).sum() + (q * torch.from_numpy(g_q)).sum()

    expected = torch.func.hessian(weighted)(x).detach().numpy()
    assert np.abs(expected).max() > 1e-2
    np.testing.assert_allclose(got["dx_grad_dx"], expected, rtol=1e-9, atol=1e-11)


def test_jacobian_against_finite_differences_with_weights():
    rng = np.random.default_rng(4)
    model, values = _mlp(rng, loss=False)
    jacobian = _run(onnx_jacobian(model, weights=["W"], inputs=["x"], mode="fwd"), values)
    plain = _with_weights(model, values)
    eps = 1e-6
    for source in ("x", "W"):
        expected = np.zeros((2, 4, *values[source].shape))
        for index in np.ndindex(values[source].shape):
            moved = [values[source].copy() for _ in range(2)]
            moved[0][index] += eps
            moved[1][index] -= eps
            up, down = (_run(plain, {**values, source: m})["t"] for m in moved)
            expected[(..., *index)] = (up - down) / (2 * eps)
        np.testing.assert_allclose(jacobian[f"dt_d{source}"], expected, rtol=1e-6, atol=1e-9)


def test_jacobian_needs_static_shapes():
    graph = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["n", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(ValueError, match="static shapes: 'x'"):
        onnx_jacobian(model)
    with pytest.raises(ValueError, match="mode must be"):
        onnx_jacobian(model, mode="forward")


def _conv_net(torch):
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(4, 3, 3, stride=2), torch.nn.Flatten(),
        torch.nn.Linear(3, 2), torch.nn.Softmax(-1),
    )  # fmt: skip
    return net, torch.randn(2, 2, 6, 6)


def _lstm(torch):
    class Recurrent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(3, 4, bidirectional=True, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0]

    return Recurrent(), torch.randn(2, 3, 3)


def _attention(torch):
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(x + self.inner(x, x, x, need_weights=False)[0])

    return Attention(), torch.randn(2, 5, 8)


@pytest.mark.parametrize("make", [_conv_net, _lstm, _attention], ids=["conv", "lstm", "attention"])
def test_k_tangents_of_torch_exports_equal_k_jvps(make):
    """A CNN (Conv, BatchNorm, MaxPool, Linear, Softmax), a bidirectional LSTM and an
    attention block: ``K`` tangents in one run equal ``K`` runs; the CNN and the attention
    have a rule for every seeded node (no Scan), the LSTM's recurrence runs per seed."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module, x = make(torch)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(), (x,), buffer, input_names=["x"], dynamo=False, opset_version=17
        )
    model = onnx.load_from_string(buffer.getvalue())
    batched = onnx_jvp(model, inputs=["x"], seeds=K)
    scans = [n for n in batched.graph.node if n.op_type == "Scan"]
    assert bool(scans) == (make is _lstm), [n.attribute[0].g.node[0].op_type for n in scans]
    rng = np.random.default_rng(6)
    tangents = rng.standard_normal((K, *x.shape)).astype(np.float32)
    (got,) = _ort(batched, {"x": x.numpy(), "x_tangent": tangents}).values()
    single = onnx_jvp(model, inputs=["x"])
    for i in range(K):
        (one,) = _ort(single, {"x": x.numpy(), "x_tangent": tangents[i]}).values()
        assert np.abs(one).max() > 1e-3
        np.testing.assert_allclose(got[i], one, rtol=1e-5, atol=1e-6 * np.abs(one).max())
