"""Native gradients of recurrent and control-flow networks exported by ``torch.onnx``
equal torch.autograd, on onnxruntime and on onnx's reference evaluator.

* ``torch.nn.LSTM/GRU/RNN`` (2 layers, bidirectional, with and without ``batch_first``)
  exported through TorchScript (ONNX LSTM/GRU/RNN ops fed by Slice/Concat of the
  parameters, so every parameter's gradient is compared) and through the dynamo exporter
  (which folds the parameters into new initializers: the input's gradient is compared;
  it unrolls ``nn.RNN`` into per-step cells rather than emitting the RNN op).
* A torch loop exported through the dynamo exporter: ``torch._higher_order_ops.scan``
  becomes an ONNX ``Scan`` and ``while_loop`` a ``Loop`` with a dynamic condition; torch's
  reference is the same loop written in eager Python.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from tests.derivative.autodiff.recurrent_reference import OPS

torch = pytest.importorskip("torch")
nn = torch.nn


def export(module, inputs, dynamo: bool) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(len(inputs))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            return torch.onnx.export(module, tuple(inputs), dynamo=True).model_proto
        buffer = io.BytesIO()
        torch.onnx.export(
            module, tuple(inputs), buffer, input_names=names, dynamo=False,
            opset_version=17, do_constant_folding=False,
        )  # fmt: skip
        return onnx.load_from_string(buffer.getvalue())


def autograd(function, parameters: dict, inputs: list, out_grads: list) -> dict:
    """``{name: gradient}`` of ``sum <function(inputs), out_grads>`` for the inputs
    (``x0``, ``x1``...) and the parameters."""
    inputs = [t.clone().requires_grad_(True) for t in inputs]
    for p in parameters.values():
        p.grad = None
    outputs = function(*inputs)
    sum((o * g).sum() for o, g in zip(outputs, out_grads)).backward()
    grads = {f"x{i}": t.grad.numpy() for i, t in enumerate(inputs)}
    grads.update({name: p.grad.numpy() for name, p in parameters.items()})
    return grads


def native_gradients(model, feeds: dict, out_grads: list, weights: list[str]) -> list[dict]:
    """The gradients of the native graph, run by onnxruntime and by the reference
    evaluator (its LSTM/GRU/RNN kernels replaced by the spec-complete numpy ones)."""
    graph_inputs = [i.name for i in model.graph.input]
    grad_model = onnx_derivative(model, weights=weights, inputs=graph_inputs)
    assert {n.domain for n in grad_model.graph.node} <= {""}
    feeds = dict(feeds)
    feeds.update({f"{o.name}_grad": g for o, g in zip(model.graph.output, out_grads)})
    initializers = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    feeds.update({name: initializers[name] for name in weights})
    names = [o.name for o in grad_model.graph.output]
    session = onnxruntime.InferenceSession(
        grad_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    by_ort = dict(zip(names, session.run(None, feeds)))
    by_reference = dict(zip(names, ReferenceEvaluator(grad_model, new_ops=OPS).run(None, feeds)))
    return [by_ort, by_reference]


class Recurrent(nn.Module):
    def __init__(self, kind: str, batch_first: bool):
        super().__init__()
        cell = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN": nn.RNN}[kind]
        self.rnn = cell(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first)

    def forward(self, x):
        out, state = self.rnn(x)
        states = state if isinstance(state, tuple) else (state,)
        return (out, *states)


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_recurrent_gradients_equal_torch_autograd(kind, dynamo, batch_first):
    torch.manual_seed(0)
    module = Recurrent(kind, batch_first).eval()
    x = torch.randn(2, 5, 3) if batch_first else torch.randn(5, 2, 3)
    model = export(module, [x], dynamo)
    if not (dynamo and kind == "RNN"):  # the dynamo exporter unrolls nn.RNN into cells
        assert kind in {n.op_type for n in model.graph.node}
    with torch.no_grad():
        outputs = module(x)
    out_grads = [torch.randn_like(o) for o in outputs]
    parameters = {f"rnn.{n}": p for n, p in module.rnn.named_parameters()}
    expected = autograd(module, parameters, [x], out_grads)
    expected["x"] = expected.pop("x0")
    by_name = {name.removeprefix("rnn."): name for name in parameters}
    by_name.update({name: name for name in parameters})
    initializers = {i.name for i in model.graph.initializer}
    # the dynamo exporter folds parameters into new values (even the first step of nn.RNN,
    # whose initial state is zero, into a constant that reuses no name): input only there
    weights = [] if dynamo else sorted(n for n in initializers if n in by_name)
    input_name = model.graph.input[0].name
    for got in native_gradients(
        model, {input_name: x.numpy()}, [g.numpy() for g in out_grads], weights
    ):
        np.testing.assert_allclose(got[f"{input_name}_grad"], expected["x"], rtol=1e-4, atol=1e-5)
        for weight in weights:
            np.testing.assert_allclose(
                got[f"{weight}_grad"],
                expected[by_name[weight]],
                rtol=1e-4,
                atol=1e-5,
                err_msg=weight,
            )
        assert dynamo or len(weights) == len(parameters)


class ScanNet(nn.Module):
    """``h <- tanh(lin(h) * w + x_t)``, ``y_t = h * h``, by torch's scan operator."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.lin = nn.Linear(3, 3)

    def step(self, h, x):
        h = torch.tanh(self.lin(h) * self.w + x)
        return h, h * h

    def forward(self, h0, xs):
        from torch._higher_order_ops.scan import scan

        return scan(self.step, h0, xs)

    def eager(self, h0, xs):
        h, ys = h0, []
        for x in xs:
            h, y = self.step(h, x)
            ys.append(y)
        return h, torch.stack(ys)


class WhileNet(nn.Module):
    """``v <- tanh(v * w) + v`` while ``i < 4``, by torch's while_loop operator."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, v):
        from torch._higher_order_ops.while_loop import while_loop

        _, out = while_loop(
            lambda i, v: i < 4, lambda i, v: (i + 1, torch.tanh(v * self.w) + v),
            (torch.tensor(0), v),
        )  # fmt: skip
        return (out,)

    def eager(self, v):
        for _ in range(4):
            v = torch.tanh(v * self.w) + v
        return (v,)


@pytest.mark.parametrize(
    ("factory", "shapes", "op_type"),
    [(ScanNet, [(2, 3), (5, 2, 3)], "Scan"), (WhileNet, [(3,)], "Loop")],
    ids=["scan", "while_loop"],
)
def test_dynamo_loop_gradients_equal_torch_autograd(factory, shapes, op_type):
    torch.manual_seed(0)
    module = factory().eval()
    inputs = [torch.randn(*s) for s in shapes]
    model = export(module, inputs, dynamo=True)
    assert op_type in {n.op_type for n in model.graph.node}
    with torch.no_grad():
        outputs = module.eager(*inputs)
    out_grads = [torch.randn_like(o) for o in outputs]
    parameters = dict(module.named_parameters())
    expected = autograd(module.eager, parameters, inputs, out_grads)
    weights = [n for n in parameters if n in {i.name for i in model.graph.initializer}]
    assert weights == list(parameters)
    names = [i.name for i in model.graph.input]
    feeds = {name: t.numpy() for name, t in zip(names, inputs)}
    for got in native_gradients(model, feeds, [g.numpy() for g in out_grads], weights):
        for i, name in enumerate(names):
            np.testing.assert_allclose(got[f"{name}_grad"], expected[f"x{i}"], rtol=1e-4, atol=1e-5)
        for weight in weights:
            np.testing.assert_allclose(
                got[f"{weight}_grad"], expected[weight], rtol=1e-4, atol=1e-5, err_msg=weight
            )
