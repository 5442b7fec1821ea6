"""``backend="ort"``: validity of the gradient graphs, values, real-exporter inputs, errors
and crash isolation."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.derivative import DerivativeOptions, onnx_derivative
from onnxgrad.derivative.ort import process as _ort_process
from onnxgrad.derivative.ort.backend import short_message
from onnxgrad.normalize import normalized_model
from tests.derivative.fd import initializer_values, onnx_numerical_vjp, run_onnxruntime
from tests.models import seed004_model

pytestmark = pytest.mark.ort_training

D = DerivativeOptions
F = TensorProto.FLOAT
WEIGHTS = ["init", "init_1", "init_b10"]


def _model(nodes, inputs, outputs, initializers=(), opset=17, ir_version=8) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, list(initializers))
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version
    )


def _tensor(name, shape, elem_type=F):
    return helper.make_tensor_value_info(name, elem_type, shape)


def _assert_close(got: dict, expected: dict, rtol=1e-4, atol=1e-5) -> None:
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize(
    "options",
    [D.Zero, D.KeepOutputs, D.FillGrad, D.FillGrad | D.KeepOutputs, D.KeepYieldOp],
    ids=lambda o: str(o),
)
def test_result_is_a_valid_model(options):
    model = seed004_model()
    before = model.SerializeToString()
    grad = onnx_derivative(model, weights=WEIGHTS, options=options, backend="ort")
    assert model.SerializeToString() == before
    onnx.checker.check_model(grad, full_check=True)
    assert grad.ir_version <= 10
    assert {(o.domain, o.version) for o in grad.opset_import} == {("", 14), ("com.microsoft", 1)}
    assert {n.domain for n in grad.graph.node} == {"", "com.microsoft"}
    yields = [n for n in grad.graph.node if n.op_type == "YieldOp"]
    assert len(yields) == (1 if options == D.KeepYieldOp else 0)


def test_accepts_a_path(tmp_path):
    path = tmp_path / "seed004.onnx"
    onnx.save(seed004_model(), path)
    grad = onnx_derivative(str(path), weights=WEIGHTS, backend="ort")
    assert [o.name for o in grad.graph.output] == [
        "x_grad",
        "init_grad",
        "init_1_grad",
        "init_b10_grad",
    ]


def test_fill_grad_is_the_gradient_of_the_sum_of_outputs():
    model = seed004_model()
    grad = onnx_derivative(model, weights=WEIGHTS, options=D.FillGrad, backend="ort")
    x = np.random.default_rng(0).standard_normal((6, 2)).astype(np.float32)
    weights = initializer_values(model, WEIGHTS)
    got = run_onnxruntime(grad, {"x": x, **weights})
    _assert_close(got, onnx_numerical_vjp(model, {"x": x, **weights}, ["x", *WEIGHTS]))


def _opset_model(opset: int) -> onnx.ModelProto:
    """Ops whose signature changed across opsets 13-21, a Constant node, two outputs.

    H = tanh(X @ W + C); H0, H1 = Split(H, [1, 2]); Y = Squeeze(Unsqueeze(H0)) * sum(H1);
    Z = mean(H, axis 1) * Softmax(H)[:, 0].
    """
    axes_as_input = opset >= 18
    node = helper.make_node
    c = numpy_helper.from_array(np.array([0.1, -0.2, 0.3], dtype=np.float32))
    mean = (
        node("ReduceMean", ["H", "axis1"], ["M"], keepdims=0)
        if axes_as_input
        else node("ReduceMean", ["H"], ["M"], axes=[1], keepdims=0)
    )
    nodes = [
        node("Constant", [], ["C"], value=c),
        node("MatMul", ["X", "W"], ["XW"]),
        node("Add", ["XW", "C"], ["A"]),
        node("Tanh", ["A"], ["H"]),
        node("Split", ["H", "split"], ["H0", "H1"], axis=1),
        node("Unsqueeze", ["H0", "axis2"], ["U"]),
        node("Squeeze", ["U", "axis2"], ["S"]),
        node("ReduceSum", ["H1", "axis1"], ["R"], keepdims=1),
        node("Mul", ["S", "R"], ["Y"]),
        mean,
        node("Softmax", ["H"], ["P"], axis=1),
        node("Gather", ["P", "zero"], ["P0"], axis=1),
        node("Mul", ["M", "P0"], ["Z"]),
    ]
    initializers = [
        numpy_helper.from_array(np.linspace(-1, 1, 12).astype(np.float32).reshape(4, 3), "W"),
        numpy_helper.from_array(np.array([1, 2], dtype=np.int64), "split"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
        numpy_helper.from_array(np.array(0, dtype=np.int64), "zero"),
    ]
    return _model(
        nodes,
        [_tensor("X", [None, 4])],
        [_tensor("Y", [None, 1]), _tensor("Z", [None])],
        initializers,
        opset=opset,
    )


@pytest.mark.parametrize("opset", range(13, 22))
def test_opsets_13_to_21_match_finite_differences(opset):
    model = _opset_model(opset)
    grad = onnx_derivative(model, backend="ort")
    # the bias C held by a Constant node is a weight once normalisation promotes it
    assert [o.name for o in grad.graph.output] == ["X_grad", "W_grad", "C_grad"]
    assert grad.opset_import[0].version == opset
    rng = np.random.default_rng(opset)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    seeds = [rng.standard_normal(s).astype(np.float32) for s in [(5, 1), (5,)]]
    promoted = normalized_model(model)
    w = initializer_values(promoted, ["W", "C"])
    got = run_onnxruntime(grad, {"X": x, **w, "Y_grad": seeds[0], "Z_grad": seeds[1]})
    expected = onnx_numerical_vjp(promoted, {"X": x, **w}, ["X", "W", "C"], seeds=seeds)
    _assert_close(got, expected)


def test_initializers_listed_among_inputs():
    """Old exporters list every initializer among the graph inputs too."""
    w = numpy_helper.from_array(np.array([[1.0, -2.0], [0.5, 3.0]], dtype=np.float32), "W")
    b = numpy_helper.from_array(np.array([0.25, -0.75], dtype=np.float32), "B")
    model = _model(
        [
            helper.make_node("Gemm", ["X", "W", "B"], ["G"]),
            helper.make_node("Sigmoid", ["G"], ["Y"]),
        ],
        [_tensor("X", [None, 2]), _tensor("W", [2, 2]), _tensor("B", [2])],
        [_tensor("Y", [None, 2])],
        [w, b],
        opset=13,
        ir_version=7,
    )
    grad = onnx_derivative(model, backend="ort")
    assert [i.name for i in grad.graph.input] == ["X", "W", "B", "Y_grad"]
    assert not grad.graph.initializer
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2)).astype(np.float32)
    y_grad = rng.standard_normal((3, 2)).astype(np.float32)
    weights = initializer_values(model, ["W", "B"])
    got = run_onnxruntime(grad, {"X": x, **weights, "Y_grad": y_grad})
    expected = onnx_numerical_vjp(model, {"X": x, **weights}, ["X", "W", "B"], seeds=[y_grad])
    _assert_close(got, expected)


def test_sources_no_output_depends_on_get_zero_gradients():
    """T only reaches Y through ArgMax (no gradient), U and the input Z reach nothing."""
    node = helper.make_node
    model = _model(
        [
            node("MatMul", ["X", "W"], ["XW"]),
            node("ArgMax", ["T"], ["K"], axis=0, keepdims=0),
            node("Cast", ["K"], ["Kf"], to=F),
            node("Mul", ["XW", "Kf"], ["Y"]),
            node("Neg", ["U"], ["unused"]),
            node("Abs", ["Z"], ["unused_too"]),
        ],
        [_tensor("X", [None, 2]), _tensor("Z", [3])],
        [_tensor("Y", [None, 2])],
        [
            numpy_helper.from_array(np.eye(2, dtype=np.float32), "W"),
            numpy_helper.from_array(np.array([0.0, 2.0, 1.0], dtype=np.float32), "T"),
            numpy_helper.from_array(np.ones((4,), dtype=np.float32), "U"),
        ],
    )
    grad = onnx_derivative(model, weights=["W", "T", "U"], backend="ort")
    assert [o.name for o in grad.graph.output] == ["X_grad", "Z_grad", "W_grad", "T_grad", "U_grad"]
    x = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    weights = initializer_values(model, ["W", "T", "U"])
    feeds = {"X": x, "Z": np.ones(3, dtype=np.float32), **weights}
    got = run_onnxruntime(grad, {**feeds, "Y_grad": np.ones((2, 2), dtype=np.float32)})
    _assert_close(got, onnx_numerical_vjp(model, feeds, ["X", "Z", "W", "T", "U"]))
    assert not got["U_grad"].any() and got["U_grad"].shape == (4,)


def test_op_without_gradient_names_op_and_node():
    model = _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"], name="linear"),
            helper.make_node("Hardmax", ["XW"], ["Y"], name="pick"),
        ],
        [_tensor("X", [None, 2])],
        [_tensor("Y", [None, 2])],
        [numpy_helper.from_array(np.eye(2, dtype=np.float32), "W")],
    )
    with pytest.raises(NotImplementedError, match=r"'Hardmax' \(node 'pick'\).*backend='onnx'"):
        onnx_derivative(model, backend="ort")


def test_gradient_names_clashing_with_inputs_are_refused():
    model = _model(
        [helper.make_node("Mul", ["X", "X_grad"], ["Y"])],
        [_tensor("X", [None, 2]), _tensor("X_grad", [None, 2])],
        [_tensor("Y", [None, 2])],
    )
    with pytest.raises(ValueError, match="X_grad"):
        onnx_derivative(model, inputs=["X"], backend="ort")


def test_intermediate_values_named_like_gradients_are_renamed():
    """A gradient graph differentiated again has values such as ``XW_grad`` and ``X_grad``."""
    model = _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Sin", ["XW"], ["XW_grad"]),
            helper.make_node("Mul", ["XW_grad", "X"], ["X_grad"]),
            helper.make_node("Sigmoid", ["X_grad"], ["Y"]),
        ],
        [_tensor("X", [None, 2])],
        [_tensor("Y", [None, 2])],
        [numpy_helper.from_array(np.array([[0.5, 1.0], [-1.0, 2.0]], dtype=np.float32), "W")],
    )
    grad = onnx_derivative(model, backend="ort")
    x = np.random.default_rng(2).standard_normal((4, 2)).astype(np.float32)
    w = initializer_values(model, ["W"])
    y_grad = np.ones((4, 2), dtype=np.float32)
    got = run_onnxruntime(grad, {"X": x, **w, "Y_grad": y_grad})
    _assert_close(got, onnx_numerical_vjp(model, {"X": x, **w}, ["X", "W"]))


def _average_pool_1d(batch: int | str) -> onnx.ModelProto:
    return _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node(
                "AveragePool", ["XW"], ["Y"], kernel_shape=[2], strides=[2], name="pool"
            ),
        ],
        [_tensor("X", [batch, 3, 4])],
        [_tensor("Y", [batch, 3, 2])],
        [numpy_helper.from_array(np.linspace(-1, 1, 16).astype(np.float32).reshape(4, 4), "W")],
    )


def test_average_pool_with_static_shapes():
    """onnxruntime registers AveragePoolGrad in the default domain, without an ONNX schema:
    it is replaced by the native gradient, so onnx's full checker accepts the result."""
    model = _average_pool_1d(2)
    grad = onnx_derivative(model, backend="ort")
    assert "AveragePoolGrad" not in {n.op_type for n in grad.graph.node}
    onnx.checker.check_model(grad, full_check=True)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    y_grad = rng.standard_normal((2, 3, 2)).astype(np.float32)
    w = initializer_values(model, ["W"])
    got = run_onnxruntime(grad, {"X": x, **w, "Y_grad": y_grad})
    _assert_close(got, onnx_numerical_vjp(model, {"X": x, **w}, ["X", "W"], seeds=[y_grad]))


def test_max_pool_gradient_is_standard_onnx():
    """MaxPoolGrad (default domain, no ONNX schema) is replaced too."""
    model = _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("MaxPool", ["XW"], ["Y"], kernel_shape=[2], strides=[1], name="pool"),
        ],
        [_tensor("X", ["N", 3, 4])],
        [_tensor("Y", ["N", 3, 3])],
        [numpy_helper.from_array(np.linspace(-1, 1, 16).astype(np.float32).reshape(4, 4), "W")],
    )
    grad = onnx_derivative(model, backend="ort")
    assert "MaxPoolGrad" not in {n.op_type for n in grad.graph.node}
    onnx.checker.check_model(grad, full_check=True)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    y_grad = rng.standard_normal((2, 3, 3)).astype(np.float32)
    w = initializer_values(model, ["W"])
    got = run_onnxruntime(grad, {"X": x, **w, "Y_grad": y_grad})
    _assert_close(got, onnx_numerical_vjp(model, {"X": x, **w}, ["X", "W"], seeds=[y_grad]))


def test_average_pool_with_a_dynamic_batch_is_refused():
    """onnxruntime-training 1.19.2's AveragePoolGrad returns an empty tensor or dies of SIGFPE."""
    with pytest.raises(NotImplementedError, match=r"AveragePool node 'pool'.*backend='onnx'"):
        onnx_derivative(_average_pool_1d("N"), backend="ort")


@pytest.mark.torch
def test_pytorch_average_pool_1d_exports():
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(2, 3, 3)
            self.pool = torch.nn.AvgPool1d(2)

        def forward(self, x):
            return self.pool(self.conv(x))

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 2, 10)
    exported = _torch_export(torch, net, x, dynamic=True)
    with pytest.raises(NotImplementedError, match="AveragePool"):
        onnx_derivative(exported, backend="ort")

    exported = _torch_export(torch, net, x, dynamic=False)
    grad = onnx_derivative(exported, options=D.FillGrad, backend="ort")
    weights = {i.name: numpy_helper.to_array(i) for i in exported.graph.initializer}
    got = run_onnxruntime(grad, {"x": x.numpy(), **weights})
    xt = x.clone().requires_grad_(True)
    net(xt).sum().backward()
    np.testing.assert_allclose(got["x_grad"], xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    by_shape = {tuple(p.shape): p.grad.numpy() for p in net.parameters()}
    for name, value in weights.items():
        np.testing.assert_allclose(got[f"{name}_grad"], by_shape[value.shape], rtol=1e-4, atol=1e-5)


def _torch_export(torch, net, x, dynamic: bool) -> onnx.ModelProto:
    import io
    import warnings

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (x,),
            buffer,
            input_names=["x"],
            output_names=["y"],
            opset_version=17,
            dynamo=False,
            dynamic_axes={"x": {0: "N"}, "y": {0: "N"}} if dynamic else None,
        )
    return onnx.load_from_string(buffer.getvalue())


def _output_is_input_model() -> onnx.ModelProto:
    """Outputs Y = X * W, then X and W themselves."""
    return _model(
        [helper.make_node("Mul", ["X", "W"], ["Y"])],
        [_tensor("X", [None, 2])],
        [_tensor("Y", [None, 2]), _tensor("X", [None, 2]), _tensor("W", [2])],
        [numpy_helper.from_array(np.array([2.0, 3.0], dtype=np.float32), "W")],
    )


def test_outputs_that_are_inputs_or_weights():
    model = _output_is_input_model()
    grad = onnx_derivative(model, options=D.FillGrad | D.KeepOutputs, backend="ort")
    assert [o.name for o in grad.graph.output] == ["X_grad", "W_grad", "Y", "X", "W"]
    feeds = {"X": np.array([[1.0, -1.0], [0.5, 2.0]], dtype=np.float32), "W": np.ones(2)}
    feeds["W"] = feeds["W"].astype(np.float32)
    got = run_onnxruntime(grad, feeds)
    _assert_close(got, onnx_numerical_vjp(model, feeds, ["X", "W"]))


def test_a_real_builder_segfault_is_contained(tmp_path):
    """The raw builder dies of SIGSEGV on an output that is a differentiated input
    (ort_derivative avoids it by computing such outputs with an Identity node)."""
    model_path = tmp_path / "model.onnx"
    onnx.save(_output_is_input_model(), model_path)
    with (
        _ort_process.OrtChild(tmp_path) as child,
        pytest.raises(RuntimeError, match=r"crashed \(signal SIGSEGV\) while building"),
    ):
        child.build(model_path, tmp_path / "out.onnx", ["W"], ["X"])


def test_a_crash_of_onnxruntime_becomes_a_runtime_error(monkeypatch):
    suicide = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    monkeypatch.setattr(_ort_process, "worker_command", lambda: [sys.executable, "-c", suicide])
    with pytest.raises(RuntimeError, match=r"crashed \(signal SIGSEGV\).*backend='onnx'"):
        onnx_derivative(seed004_model(), backend="ort")


def test_a_failing_child_reports_its_exit_code_and_last_messages(monkeypatch):
    failing = "import sys; sys.stderr.write('cannot import onnxruntime\\n'); sys.exit(3)"
    monkeypatch.setattr(_ort_process, "worker_command", lambda: [sys.executable, "-c", failing])
    with pytest.raises(RuntimeError, match=r"(?s)exit code 3.*cannot import onnxruntime"):
        onnx_derivative(seed004_model(), backend="ort")


def test_a_child_that_cannot_start_is_reported(monkeypatch, tmp_path):
    missing = str(tmp_path / "no-python")
    monkeypatch.setattr(_ort_process, "worker_command", lambda: [missing])
    with pytest.raises(RuntimeError, match="could not start the child process"):
        onnx_derivative(seed004_model(), backend="ort")


def test_a_model_onnxruntime_cannot_load_is_reported():
    """The builder differentiates float64 MatMul with FusedMatMul, which has no double kernel."""
    model = _model(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        [_tensor("X", [None, 2], TensorProto.DOUBLE)],
        [_tensor("Y", [None, 2], TensorProto.DOUBLE)],
        [numpy_helper.from_array(np.eye(2), "W")],
    )
    with pytest.raises(RuntimeError, match=r"cannot load.*FusedMatMul.*backend='onnx'"):
        onnx_derivative(model, backend="ort")


def test_builder_messages_lose_their_cpp_signature():
    raw = (
        "/onnxruntime_src/orttraining/orttraining/core/framework/gradient_graph_builder.cc:141 "
        "onnxruntime::training::GradientGraphBuilder::GradientGraphBuilder(onnxruntime::Graph*, "
        "const std::unordered_set<std::__cxx11::basic_string<char> >&, const string&) "
        "B couldn't find the consumer node."
    )
    assert short_message(raw) == "B couldn't find the consumer node."
    wrapped = "/src/x.cc:548 f(int)::<lambda(a&)> [ONNXRuntimeError] : 1 : FAIL : bad model"
    assert short_message(wrapped) == "[ONNXRuntimeError] : 1 : FAIL : bad model"


def _native(model: onnx.ModelProto, **kwargs) -> onnx.ModelProto:
    """The native backend's gradient; a rule it lacks skips the comparison."""
    try:
        return onnx_derivative(model, backend="onnx", **kwargs)
    except (ModuleNotFoundError, NotImplementedError) as exc:
        pytest.skip(f"native backend: {exc}")


@pytest.mark.parametrize("opset", [13, 17, 18, 21])
def test_native_backend_agrees(opset):
    model = _opset_model(opset)
    rng = np.random.default_rng(opset)
    feeds = {
        "X": rng.standard_normal((5, 4)).astype(np.float32),
        "W": rng.standard_normal((4, 3)).astype(np.float32),
        "C": rng.standard_normal(3).astype(np.float32),
        "Y_grad": rng.standard_normal((5, 1)).astype(np.float32),
        "Z_grad": rng.standard_normal((5,)).astype(np.float32),
    }
    expected = run_onnxruntime(onnx_derivative(model, backend="ort"), feeds)
    got = run_onnxruntime(_native(model), feeds)
    assert list(got) == list(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_child_that_hangs_is_stopped_after_the_time_limit(monkeypatch):
    hanging = "import time; time.sleep(60)"
    monkeypatch.setattr(_ort_process, "worker_command", lambda: [sys.executable, "-c", hanging])
    monkeypatch.setattr(_ort_process, "TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match=r"did not answer within 0.5 s.*backend='onnx'"):
        onnx_derivative(seed004_model(), backend="ort")
